"""Incremental detokenization and stop strings, one instance per request."""
from __future__ import annotations

import logging
import os.path

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

logger = logging.getLogger(__name__)


class IncrementalDetokenizer:
    """Appends the text of each new token; finds stop strings in what was just added.

    `DecodeStream` returns nothing for a token that ends inside a multi-byte character, and the text once
    the character is complete, so the concatenated pieces equal decoding all tokens at once.
    """

    def __init__(self, tokenizer: Tokenizer, stop: list[str], include_stop_str_in_output: bool,
                 skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.token_ids: list[int] = []
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self.text = ""
        # While streaming, the last `holdback` characters may still become part of a stop string.
        self.holdback = max((len(s) for s in stop), default=1) - 1

    def add_token(self, token_id: int, check_stop: bool = True) -> str | None:
        """Decode one token; return the stop string it completed, if any (the text is then cut there).
        `check_stop=False` while stop strings may not end the request yet (before min_tokens)."""
        self.token_ids.append(token_id)
        piece = self._step(token_id)
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

    def _step(self, token_id: int) -> str | None:
        try:
            return self.stream.step(self.tokenizer, token_id)
        except Exception as e:  # tokenizers raises a bare Exception
            if "Invalid prefix" not in str(e):
                raise
        # Byte-fallback tokens (SentencePiece vocabularies: Gemma, Llama 2) can make the text of earlier tokens
        # change when a later one arrives - bytes that made a character now decode as replacement characters
        # - and the stream cannot go on from there. The token's text is then what it adds to decoding all
        # tokens at once; a new stream goes on from it, given it as context (a leading space stays a space).
        logger.warning("token %d changed how earlier tokens decode; the stream's text goes on after it", token_id)
        before = self.tokenizer.decode(self.token_ids[:-1], skip_special_tokens=self.skip_special_tokens)
        after = self.tokenizer.decode(self.token_ids, skip_special_tokens=self.skip_special_tokens)
        self.stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
        self.stream.step(self.tokenizer, token_id)  # context only: its text is the one returned below
        return after[len(os.path.commonprefix([before, after])):]

    def visible_text(self, finished: bool) -> str:
        """Text safe to show now: all of it once finished, else without a possible stop-string prefix."""
        if finished or not self.holdback:
            return self.text
        return self.text[:max(len(self.text) - self.holdback, 0)]
