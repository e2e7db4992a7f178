"""One chat choice's text as the assistant's answer: its reasoning, plain content, or tool calls.

With a reasoning parser (`reasoning_parsers`), the reasoning is taken out of the text first and returned as
`reasoning_content` (and as `reasoning`, vLLM's later name for it); everything below reads only what is left.

How the calls are found depends on `tool_choice` (see `output_constraints.ToolFields.tool_mode`):
- none (or no tools): the text is the content.
- auto: the configured tool parser reads calls out of the text (`tool_parsers`).
- named: the output was constrained to the function's arguments, so the text is the arguments.
- required: the output was constrained to a JSON list of {"name", "parameters"} objects.
A choice with calls that stopped on its own finishes with "tool_calls", as in the OpenAI API. With
parallel_tool_calls false, only the first call the parser finds is returned ("required" is held to one
call by its schema already).
"""
from __future__ import annotations

import json

from epdserve.services.proxy.reasoning_parsers import ReasoningParser
from epdserve.services.proxy.tool_parsers import ToolCall, call_deltas, get_tool_parser, new_call_id

REASONING_FIELDS = ("reasoning_content", "reasoning")


class ChatAnswer:
    """Builds the message (whole) or the deltas (streamed) of one choice; one instance per choice."""

    def __init__(self, mode: str | None, parser_name: str = "hermes", function_name: str | None = None,
                 parallel: bool = True, reasoning: ReasoningParser | None = None,
                 include_reasoning: bool = True) -> None:
        """`reasoning`: this choice's reasoning parser (None: no reasoning fields); `include_reasoning`
        false leaves the reasoning out of the answer (vLLM's request field)."""
        self.mode = mode if mode in ("auto", "named", "required") else None
        self.reasoning = reasoning
        self.include_reasoning = include_reasoning
        self._content = ""  # the text after the reasoning, so far (streaming)
        self.parallel = parallel
        self.parser = get_tool_parser(parser_name) if self.mode == "auto" else None
        self.function_name = function_name  # for "named"
        self._call_id = new_call_id()
        self._sent = 0  # characters of the text handled by `delta`
        self._num_calls = 0

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The assistant message for the whole text, and the finish reason to report."""
        if self.reasoning is None:
            content, calls = self._parse(text)
            message = {"role": "assistant", "content": content}
        else:
            reasoning, answer = self.reasoning.parse(text)
            content, calls = self._parse(answer or "")
            message = {"role": "assistant", "content": content or None}  # as vLLM: null when nothing follows
            message |= dict.fromkeys(REASONING_FIELDS, reasoning if self.include_reasoning else None)
        if calls:
            message["tool_calls"] = [c.to_openai() for c in calls]
        return message, self.finish_reason(finish_reason, bool(calls))

    def delta(self, text: str, finished: bool) -> dict:
        """The delta for a stream given the whole text so far ({} when there is nothing new to send)."""
        if self.reasoning is None:
            return self._content_delta(text, finished)
        reasoning, content = self.reasoning.parse_delta(text, finished)
        self._content += content
        delta = self._content_delta(self._content, finished)
        if reasoning and self.include_reasoning:
            delta = dict.fromkeys(REASONING_FIELDS, reasoning) | delta
        return delta

    def _content_delta(self, text: str, finished: bool) -> dict:
        """The content and tool-call delta given the whole text after the reasoning so far."""
        if self.mode is None:
            new, self._sent = text[self._sent:], len(text)
            return {"content": new} if new else {}
        if self.mode == "auto":
            content, calls = self.parser.parse_delta(text, finished)
            if not self.parallel:
                calls = [c for c in calls if c["index"] == 0]
            self._num_calls += sum(1 for c in calls if "id" in c)
            return _delta(content, calls)
        if self.mode == "named":
            calls = []
            if self._num_calls == 0:
                calls.append({"index": 0, "id": self._call_id, "type": "function",
                              "function": {"name": self.function_name, "arguments": ""}})
                self._num_calls = 1
            new, self._sent = text[self._sent:], len(text)
            if new:
                calls.append({"index": 0, "function": {"arguments": new}})
            return _delta(None, calls)
        if not finished:  # required: the list is parsed when it is complete
            return {}
        content, found = self._parse(text)
        calls = [d for i, call in enumerate(found) for d in call_deltas(i, call)]
        self._num_calls = len(found)
        return _delta(content, calls)

    def finish_reason(self, reason: str | None, has_calls: bool | None = None) -> str | None:
        has_calls = self._num_calls > 0 if has_calls is None else has_calls
        return "tool_calls" if has_calls and reason == "stop" else reason

    def _parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if self.mode is None:
            return text, []
        if self.mode == "auto":
            parsed = self.parser.parse(text)
            return parsed.content, parsed.tool_calls if self.parallel else parsed.tool_calls[:1]
        if self.mode == "named":
            return None, [ToolCall(self.function_name, _compact(text), self._call_id)]
        try:
            items = json.loads(text)
        except json.JSONDecodeError:
            return text, []  # cut short (max_tokens): nothing to call
        calls = [ToolCall(item["name"], json.dumps(item.get("parameters", {}), ensure_ascii=False), new_call_id())
                 for item in items if isinstance(item, dict) and isinstance(item.get("name"), str)]
        return None, calls


def _compact(text: str) -> str:
    try:
        return json.dumps(json.loads(text), ensure_ascii=False)
    except json.JSONDecodeError:
        return text  # cut short: the client sees what there is


def _delta(content: str | None, calls: list[dict]) -> dict:
    delta = {}
    if content:
        delta["content"] = content
    if calls:
        delta["tool_calls"] = calls
    return delta
