"""Incremental detokenization and stop strings, one instance per request."""
from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    """Appends the text of each new token; finds stop strings in what was just added.

    `DecodeStream` returns nothing for a token that ends inside a multi-byte character, and the text once
    the character is complete, so the concatenated pieces equal decoding all tokens at once.
    """

    def __init__(self, tokenizer: Tokenizer, stop: list[str], include_stop_str_in_output: bool,
                 skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self.text = ""
        # While streaming, the last `holdback` characters may still become part of a stop string.
        self.holdback = max((len(s) for s in stop), default=1) - 1

    def add_token(self, token_id: int, check_stop: bool = True) -> str | None:
        """Decode one token; return the stop string it completed, if any (the text is then cut there).
        `check_stop=False` while stop strings may not end the request yet (before min_tokens)."""
        piece = self.stream.step(self.tokenizer, token_id)
        if not piece:
            return None
        search_from = max(len(self.text) - self.holdback, 0)
        self.text += piece
        if not check_stop:
            return None
        for stop in self.stop:
            idx = self.text.find(stop, search_from)
            if idx >= 0:
                self.text = self.text[:idx + len(stop)] if self.include_stop else self.text[:idx]
                return stop
        return None

    def visible_text(self, finished: bool) -> str:
        """Text safe to show now: all of it once finished, else without a possible stop-string prefix."""
        if finished or not self.holdback:
            return self.text
        return self.text[:max(len(self.text) - self.holdback, 0)]
