"""Structured outputs: grammars compiled by xgrammar, one matcher per constrained request, and the token
bitmask that keeps the sampler inside the grammar.

A constrained request owns a `GrammarState` (a matcher plus the count of tokens it has taken in). Every
token appended to the request's output is fed to its matcher, whichever engine sampled it; so an engine
that takes over a request (decode after prefill sampled the first token, or the recompute fallback when
the KV pull fails) builds a fresh matcher and replays the tokens the request already has. Preemption
keeps the request's output tokens, hence its matcher: recomputing the KV changes no accepted token.

Grammars are compiled once per (kind, spec) and kept in a bounded LRU, as vLLM and SGLang do: compiling
a JSON schema against a 50k vocabulary takes tens of milliseconds, matching one token microseconds.
"""
from __future__ import annotations

import concurrent.futures
import json
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING

import torch

from epdserve.shared.engine.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar

# Compiled grammars kept per engine; each holds per-token tables of a few hundred KB for a 50k vocabulary.
DEFAULT_CACHE_SIZE = 128


class GrammarState:
    """One request's matcher. `accept` is called once per output token, in order."""

    __slots__ = ("matcher", "num_accepted", "rejected_token", "compiler")

    def __init__(self, matcher: "xgrammar.GrammarMatcher", compiler: "GrammarCompiler | None" = None) -> None:
        self.matcher = matcher
        self.num_accepted = 0
        self.rejected_token: int | None = None  # a token the grammar did not allow (the request fails)
        self.compiler = compiler  # counts the time matchers spend taking tokens

    def accept(self, token_id: int) -> None:
        if self.rejected_token is not None or self.matcher.is_terminated():
            return
        start = time.perf_counter()
        if self.matcher.accept_token(token_id):
            self.num_accepted += 1
        else:
            self.rejected_token = token_id
        if self.compiler is not None:
            self.compiler.accept_seconds += time.perf_counter() - start

    def rollback(self, num_tokens: int) -> None:
        """Forget the last `num_tokens` accepted tokens (draft tokens taken in on trial, speculative.py)."""
        if num_tokens:
            self.matcher.rollback(num_tokens)
            self.num_accepted -= num_tokens

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was taken: nothing more may follow."""
        return self.matcher.is_terminated()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)


class GrammarCompiler:
    """Compiles output constraints for one model's vocabulary; thread-safe (requests are made on a
    service's event loop while the engine thread samples)."""

    def __init__(self, hf_tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...],
                 max_cached: int = DEFAULT_CACHE_SIZE) -> None:
        self.hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size  # the model's (logits width), which may exceed the tokenizer's
        self.stop_token_ids = list(stop_token_ids)
        self.max_cached = max_cached
        self._compiler: "xgrammar.GrammarCompiler | None" = None
        self._cache: OrderedDict[tuple[str, str], "xgrammar.CompiledGrammar"] = OrderedDict()
        self._lock = threading.Lock()
        # Where compile_soon compiles: two at a time, so one slow grammar does not hold up every other.
        self._pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="epdserve-grammar")
        self.num_hits = 0
        self.num_compiled = 0
        self.accept_seconds = 0.0  # matchers taking tokens, summed (the bitmask's time is the sampler's)

    def new_state(self, params: StructuredOutputsParams,
                  compiled: "xgrammar.CompiledGrammar | None" = None) -> GrammarState:
        """A fresh matcher for `params`, compiled here unless `compiled` is given (raises ValueError when the
        constraint does not compile)."""
        import xgrammar as xgr

        grammar = compiled if compiled is not None else self.compile(params)
        return GrammarState(xgr.GrammarMatcher(grammar, override_stop_tokens=self.stop_token_ids), self)

    def compile_soon(self, params: StructuredOutputsParams) -> concurrent.futures.Future:
        """`compile(params)` on this compiler's own threads: the caller's thread (an event loop) goes on.
        xgrammar releases the GIL while it compiles. A compile its caller stopped waiting for still ends
        (there is no stopping it), and its grammar is cached."""
        return self._pool.submit(self.compile, params)

    def compile(self, params: StructuredOutputsParams) -> "xgrammar.CompiledGrammar":
        key = (params.kind, params.spec)
        with self._lock:
            grammar = self._cache.get(key)
            if grammar is not None:
                self._cache.move_to_end(key)
                self.num_hits += 1
                return grammar
            compiler = self._xgrammar_compiler()
        # Compiled outside the lock: two threads may compile the same key once each, never wait on each other.
        try:
            grammar = _compile(compiler, params)
        except Exception as exc:  # xgrammar's errors are RuntimeErrors, but any failure is this request's alone
            raise ValueError(f"invalid {_FIELD_NAMES[params.kind]}: {_first_line(exc)}") from None
        if not self._can_start(grammar):
            raise ValueError(f"invalid {_FIELD_NAMES[params.kind]}: no token of this model's vocabulary can "
                             "begin an output it allows")
        with self._lock:
            self.num_compiled += 1
            self._cache[key] = grammar
            self._cache.move_to_end(key)
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
        return grammar

    def __len__(self) -> int:
        return len(self._cache)

    def _can_start(self, grammar: "xgrammar.CompiledGrammar") -> bool:
        """Whether the grammar's first step allows any token (a request it does not is refused up front)."""
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        xgr.GrammarMatcher(grammar, override_stop_tokens=self.stop_token_ids).fill_next_token_bitmask(bitmask)
        return bool(bitmask.any())

    def _xgrammar_compiler(self) -> "xgrammar.GrammarCompiler":
        if self._compiler is None:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(self.hf_tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_token_ids)
            # xgrammar's own cache is off: ours is the one bounded by entries and counted.
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler


_FIELD_NAMES = {"json": "JSON schema", "json_object": "JSON object constraint", "regex": "regex",
                "choice": "choice list", "grammar": "grammar"}


def _compile(compiler: "xgrammar.GrammarCompiler", params: StructuredOutputsParams) -> "xgrammar.CompiledGrammar":
    import xgrammar as xgr

    if params.kind == "json":
        return compiler.compile_json_schema(params.spec, any_whitespace=False)
    if params.kind == "json_object":
        # Any JSON object, as the OpenAI API promises (the builtin JSON grammar would also allow arrays).
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
    if params.kind == "regex":
        return compiler.compile_regex(params.spec)
    if params.kind == "grammar":
        return compiler.compile_grammar(params.spec)
    # choice: exactly one of the strings, as a regex of escaped alternatives.
    options = json.loads(params.spec)
    if not isinstance(options, list) or not options or any(not isinstance(o, str) for o in options):
        raise ValueError("choice must be a non-empty list of strings")
    return compiler.compile_grammar(xgr.Grammar.from_regex("|".join(_regex_escape(o) for o in options)))


def _regex_escape(text: str) -> str:
    # xgrammar's regex dialect is ECMAScript's: escape its metacharacters, keep everything else literal.
    return "".join("\\" + c if c in r"\^$.|?*+()[]{}/-" else c for c in text)


def _first_line(exc: Exception) -> str:
    # xgrammar prefixes its messages with a timestamp and a C++ source location.
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text.split(": ", 1)[1] if text.startswith("[") and ": " in text else text


def apply_bitmask(logits: torch.Tensor, states: list[GrammarState], rows: list[int],
                  bitmask: torch.Tensor) -> None:
    """Set to -inf, in place, the logits of every token the grammar of `states[j]` forbids in row
    `rows[j]`. logits: [num_rows, vocab] float32; bitmask: [num_rows, ceil(vocab / 32)] int32 scratch."""
    import xgrammar as xgr

    for state, row in zip(states, rows):
        state.fill_bitmask(bitmask, row)
    xgr.apply_token_bitmask_inplace(logits, bitmask[:logits.shape[0]], vocab_size=logits.shape[1], indices=rows)
