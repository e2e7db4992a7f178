"""Tool calls read back from a model's text (`tool_choice: "auto"`), one parser per output format.

A parser turns the whole text into (content, calls) and, for streaming, turns text deltas into content
deltas and tool-call deltas as vLLM emits them: a call's first delta carries its index, id, type and
name with empty arguments, the following ones carry argument text that the client concatenates.
Parsers are registered by name (`--tool-call-parser`); `hermes` reads the Hermes / Qwen2.5 format
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, which is also what the prompt asks for when
the chat template cannot render tools itself (`epdserve.shared.processing.tool_prompt`).
"""
from __future__ import annotations

import json
import uuid
from typing import Callable, NamedTuple


class ToolCall(NamedTuple):
    name: str
    arguments: str  # JSON text of an object
    id: str

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ParsedOutput(NamedTuple):
    content: str | None  # the text outside the calls; None when there is none
    tool_calls: list[ToolCall]


class ToolParser:
    """Base of the parsers; one instance per response (streaming keeps state)."""

    def parse(self, text: str) -> ParsedOutput:
        raise NotImplementedError

    def parse_delta(self, text: str, final: bool) -> tuple[str, list[dict]]:
        """`text`: the whole output so far; `final`: no more will come. Returns the content not yet
        emitted and the tool-call deltas (OpenAI `delta.tool_calls` entries) not yet emitted."""
        raise NotImplementedError


class HermesToolParser(ToolParser):
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self._content_sent = 0  # characters of text consumed as content or as complete calls
        self._num_calls = 0

    def parse(self, text: str) -> ParsedOutput:
        calls, content, pos = [], [], 0
        while True:
            start = text.find(self.START, pos)
            if start < 0:
                content.append(text[pos:])
                break
            end = text.find(self.END, start)
            call = _hermes_call(text[start + len(self.START):end if end >= 0 else len(text)])
            if call is None:  # not a call after all: keep it as text
                content.append(text[pos:] if end < 0 else text[pos:end + len(self.END)])
                if end < 0:
                    break
            else:
                content.append(text[pos:start])
                calls.append(call)
                if end < 0:
                    break
            pos = end + len(self.END)
        joined = "".join(content).strip() if calls else "".join(content)
        return ParsedOutput(joined or None, calls)

    def parse_delta(self, text: str, final: bool) -> tuple[str, list[dict]]:
        content, deltas = [], []
        while True:
            rest = text[self._content_sent:]
            start = rest.find(self.START)
            if start < 0:
                # Hold back a tail that may be the beginning of "<tool_call>".
                keep = 0 if final else partial_suffix(rest, self.START)
                content.append(rest[:len(rest) - keep])
                self._content_sent += len(rest) - keep
                break
            content.append(rest[:start])
            end = rest.find(self.END, start)
            if end < 0 and not final:
                self._content_sent += start
                break
            body = rest[start + len(self.START):end if end >= 0 else len(rest)]
            call = _hermes_call(body)
            consumed = len(rest) if end < 0 else end + len(self.END)
            if call is None:
                content.append(rest[start:consumed])
            else:
                deltas.extend(call_deltas(self._num_calls, call))
                self._num_calls += 1
            self._content_sent += consumed
            if end < 0:
                break
        text_out = "".join(content)
        if self._num_calls and not deltas and not text_out.strip():
            text_out = ""  # whitespace between or after calls is not content
        return text_out, deltas


def call_deltas(index: int, call: ToolCall) -> list[dict]:
    """A complete call as streamed deltas: the name first, then the arguments."""
    return [{"index": index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}},
            {"index": index, "function": {"arguments": call.arguments}}]


def _hermes_call(body: str) -> ToolCall | None:
    try:
        data = json.loads(body.strip())
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    return ToolCall(data["name"], json.dumps(arguments, ensure_ascii=False), new_call_id())


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


TOOL_PARSERS: dict[str, Callable[[], ToolParser]] = {"hermes": HermesToolParser}


def get_tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of {sorted(TOOL_PARSERS)}") from None
