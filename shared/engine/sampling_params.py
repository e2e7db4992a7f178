"""Per-request sampling parameters, shaped like vLLM's so that user scripts carry over."""
from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass, field

# Temperatures below this are greedy (argmax), as in vLLM.
GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20
# What a torch.Generator takes, and what the wire (msgpack) can carry.
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1
# logit_bias values, as in the OpenAI API.
LOGIT_BIAS_MIN, LOGIT_BIAS_MAX = -100.0, 100.0


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # every output carries all text/tokens so far
    DELTA = 1  # every output carries only what is new since the last one
    FINAL_ONLY = 2  # one output, when the request finishes


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """A constraint on the output, vLLM's `StructuredOutputsParams` in one normalized form: `kind` is
    json (`spec` a JSON schema as JSON text), json_object (any JSON object; `spec` empty), regex, choice
    (`spec` a JSON list of the allowed strings) or grammar (EBNF, the GBNF dialect). `(kind, spec)` is
    what the engine compiles and caches grammars by, and what travels on the wire."""

    kind: str
    spec: str = ""

    KINDS = ("json", "json_object", "regex", "choice", "grammar")

    def __post_init__(self) -> None:
        if self.kind not in self.KINDS:
            raise ValueError(f"invalid sampling parameters: structured output kind must be one of {self.KINDS}, "
                             f"got {self.kind!r}")
        if self.kind != "json_object" and (not isinstance(self.spec, str) or not self.spec):
            raise ValueError(f"invalid sampling parameters: a {self.kind} constraint needs a non-empty spec")

    @classmethod
    def json_schema(cls, schema: dict | bool | str) -> "StructuredOutputsParams":
        return cls("json", schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def choices(cls, options: list[str]) -> "StructuredOutputsParams":
        if not options or any(not isinstance(o, str) for o in options):
            raise ValueError("invalid sampling parameters: choice needs a non-empty list of strings")
        return cls("choice", json.dumps(list(options)))


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None: up to the model's length
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # top-N alternatives per generated token (plus the sampled one)
    # Top-N alternatives (plus the actual token) at every prompt position but the first, which nothing
    # predicts; as in vLLM, such a request computes its whole prompt (no prefix-cache hits).
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # token id -> added to its logit before sampling (greedy included), in [-100, 100].
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Filled in by the engine: the model's EOS ids, which also count as stops unless ignore_eos.
    eos_token_ids: tuple[int, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def fail(msg: str) -> None:
            raise ValueError(f"invalid sampling parameters: {msg}")

        if not isinstance(self.n, int) or self.n < 1:
            fail(f"n must be a positive integer, got {self.n!r}")
        if not 0.0 <= self.temperature < math.inf:
            fail(f"temperature must be finite and >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            fail(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            fail(f"top_k must be 0 or -1 (disabled) or a positive integer, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            fail(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            fail(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            fail(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not 0.0 < self.repetition_penalty < math.inf:
            fail(f"repetition_penalty must be finite and > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            fail(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            fail(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            fail(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            fail(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}")
        if self.seed is not None and (not isinstance(self.seed, int) or not SEED_MIN <= self.seed <= SEED_MAX):
            fail(f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}], got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            fail("stop must be a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            fail("stop_token_ids must be non-negative integers")
        if self.logit_bias is not None:
            if any(not isinstance(t, int) or t < 0 for t in self.logit_bias):
                fail("logit_bias keys must be non-negative token ids")
            if any(not isinstance(b, (int, float)) or not LOGIT_BIAS_MIN <= b <= LOGIT_BIAS_MAX
                   for b in self.logit_bias.values()):
                fail(f"logit_bias values must be in [{LOGIT_BIAS_MIN:g}, {LOGIT_BIAS_MAX:g}]")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            fail("structured_outputs must be a StructuredOutputsParams")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_EPS


def sequence_seed(seed: int | None, index: int) -> int | None:
    """Seed of sequence `index` of a request with n > 1 (parallel_sampling.py): seed + index, wrapped into the
    range a seed may take."""
    if seed is None:
        return None
    seed += index
    return seed - (SEED_MAX - SEED_MIN + 1) if seed > SEED_MAX else seed
