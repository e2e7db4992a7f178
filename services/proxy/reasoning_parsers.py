"""A reasoning model's thinking read back from its text (`--reasoning-parser`, with vLLM's parser names).

DeepSeek-R1 and Qwen3 write their reasoning as `<think>...</think>` before the answer. Their chat templates
may open the block in the prompt already (R1's, Qwen3.5's), so the output can start inside the reasoning
with no opening tag: the reasoning runs from the start of the output to the first `</think>`, and an
opening `<think>` the model writes itself before that is dropped; what follows `</think>` is the answer.
An output that never closes the block (cut by max_tokens) is all reasoning. The parsers work on the text,
not on token ids, so a tag the tokenizer writes in several pieces, or that one stream chunk splits from the
next, is found all the same.

- `deepseek_r1`: always as above.
- `qwen3`: the same, unless the request turns thinking off (`chat_template_kwargs: {"enable_thinking":
  false}`: Qwen3's template then closes an empty block in the prompt), when the whole output is the answer.

A constrained output (structured outputs, response_format, a forced tool call) follows its constraint from
its first token (vLLM's starts constraining after the reasoning), so it is the answer unless it opens with
`<think>` itself: a JSON schema's output is the content, a regex may write a `<think>` block first.
"""
from __future__ import annotations

from enum import Enum
from typing import Callable, NamedTuple

from epdserve.services.proxy.tool_parsers import partial_suffix


class Phase(Enum):
    """Where a parser is in the output; a response begins in any of them."""

    REASONING = "reasoning"  # inside the reasoning (at the start: the template opened it)
    OPENS = "opens"  # at the start, in the answer unless the output opens with the start tag
    ANSWER = "answer"  # in the answer (at the start: reasoning is off)


class ParsedReasoning(NamedTuple):
    reasoning: str | None  # None when there is none
    content: str | None


class ReasoningParser:
    """One response's parser (streaming keeps state). Tags are found in the text, one stream delta or
    several; `parse_delta` and `parse` agree on every split of the same text."""

    START, END = "<think>", "</think>"

    def __init__(self, start: Phase = Phase.REASONING) -> None:
        self._phase = start
        self._opened = start is not Phase.REASONING  # whether an opening tag can no longer come
        self._sent = 0  # characters of the text handed out as reasoning, content or tags

    def parse(self, text: str) -> ParsedReasoning:
        """The whole output of a fresh parser."""
        reasoning, content = self.parse_delta(text, True)
        return ParsedReasoning(reasoning or None, content or None)

    def parse_delta(self, text: str, final: bool) -> tuple[str, str]:
        """`text`: the whole output so far; `final`: no more will come. Returns the reasoning and the content
        not yet handed out; a tail that may be the beginning of a tag is held back until it is known."""
        reasoning, content = [], []
        while True:
            rest = text[self._sent:]
            if self._phase is Phase.ANSWER:
                content.append(rest)
                self._sent = len(text)
                break
            if self._phase is Phase.OPENS:
                if rest.startswith(self.START):
                    self._sent += len(self.START)
                    self._phase = Phase.REASONING
                    continue
                if not final and self.START.startswith(rest):
                    break  # may still open
                self._phase = Phase.ANSWER
                continue
            end = rest.find(self.END)
            start = -1 if self._opened else rest.find(self.START)
            if start >= 0 and (end < 0 or start < end):  # the model opened the block itself: the tag is dropped
                reasoning.append(rest[:start])
                self._sent += start + len(self.START)
                self._opened = True
                continue
            if end >= 0:
                reasoning.append(rest[:end])
                self._sent += end + len(self.END)
                self._opened, self._phase = True, Phase.ANSWER
                continue
            keep = 0 if final else max(partial_suffix(rest, self.END),
                                       0 if self._opened else partial_suffix(rest, self.START))
            reasoning.append(rest[:len(rest) - keep])
            self._sent += len(rest) - keep
            break
        return "".join(reasoning), "".join(content)


def _deepseek_r1(thinking: bool | None, constrained: bool) -> ReasoningParser:
    return ReasoningParser(Phase.OPENS if constrained else Phase.REASONING)


def _qwen3(thinking: bool | None, constrained: bool) -> ReasoningParser:
    if thinking is False:
        return ReasoningParser(Phase.ANSWER)
    return _deepseek_r1(thinking, constrained)


# name -> make(enable_thinking as the request's chat_template_kwargs give it (None: not given), whether the
# output is constrained) -> a parser for one response.
REASONING_PARSERS: dict[str, Callable[[bool | None, bool], ReasoningParser]] = {
    "deepseek_r1": _deepseek_r1, "qwen3": _qwen3}


def get_reasoning_parser(name: str, thinking: bool | None = None, constrained: bool = False) -> ReasoningParser:
    try:
        make = REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {sorted(REASONING_PARSERS)}") from None
    return make(thinking, constrained)
