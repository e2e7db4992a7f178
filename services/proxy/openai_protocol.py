"""OpenAI API request bodies, validated: anything malformed becomes a 400 with an OpenAI error body.

Fields follow the OpenAI API plus the extensions vLLM users rely on (top_k, min_p, repetition_penalty,
min_tokens, ignore_eos, stop_token_ids, skip_special_tokens, include_stop_str_in_output, cache_salt,
prompt_logprobs, chat_template_kwargs, include_reasoning). A field of the OpenAI API reference that is not
implemented is refused with a 400 naming it (`REFUSED_FIELDS`), never dropped; a field outside the reference
is kept aside (`model_extra`) for the serving layer to log once per request, as vLLM does, and otherwise
ignored. The fields that constrain or steer the output (response_format, structured_outputs, guided_*,
logit_bias, tools, tool_choice, parallel_tool_calls) are declared in `output_constraints`, mixed in here.
"""
from __future__ import annotations

from typing import Any, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from epdserve.shared.engine import MAX_LOGPROBS, SEED_MAX, SEED_MIN, SamplingParams
from epdserve.services.proxy.output_constraints import ConstraintFields, ToolCallItem, ToolFields


def first_unencodable(body: Any) -> tuple | None:
    """The path of a string (or object key) that is not valid UTF-8, such as a lone surrogate from a JSON
    "\\ud800" escape: nothing downstream (tokenizer, wire codec, JSON response) can encode it. A loop, not
    recursion: JSON nests deeper than Python's stack."""
    todo = [((), body)]
    while todo:
        path, value = todo.pop()
        if isinstance(value, str):
            if not _encodes(value):
                return path
        elif isinstance(value, dict):
            for key, item in value.items():
                if not _encodes(key):
                    return path
                todo.append(((*path, key), item))
        elif isinstance(value, list):
            todo.extend(((*path, i), item) for i, item in enumerate(value))
    return None


def _encodes(text: str) -> bool:
    try:
        text.encode()
        return True
    except UnicodeEncodeError:
        return False


class _Request(BaseModel):
    """A request body: unknown fields kept aside in `model_extra`, floats finite, every string valid UTF-8."""
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _valid_utf8(cls, data: Any) -> Any:
        path = first_unencodable(data)
        if path is not None:
            error = PydanticCustomError("unicode", "text must be valid UTF-8 (found an unpaired surrogate)")
            raise ValidationError.from_exception_data(cls.__name__, [InitErrorDetails(type=error, loc=path,
                                                                                       input=None)])
        return data


def _refuse(field: str, message: str) -> ValidationError:
    error = PydanticCustomError("unsupported", message)
    return ValidationError.from_exception_data("request", [InitErrorDetails(type=error, loc=(field,), input=None)])


def _is_set(value: Any) -> bool:
    """Whether a refused field asks for anything: null, false, "" and empty lists or objects do not."""
    return value not in (None, False, "", [], {})


# Most choices one request may ask for (n, best_of, and n times the prompts of a completion), as OpenAI.
MAX_CHOICES = 128

# Fields of the OpenAI API reference that this server does not implement: name -> why (the 400 says
# "<name>: <why>").
REFUSED_FIELDS = {
    "chat": {
        "audio": "audio output is not supported",
        "functions": "deprecated and not supported: use tools",
        "function_call": "deprecated and not supported: use tool_choice",
        "prediction": "predicted outputs are not supported",
        "reasoning_effort": "not supported: how long a model reasons cannot be set (Qwen3's thinking is switched "
                            "with chat_template_kwargs: {\"enable_thinking\": false})",
        "verbosity": "not supported",
        "web_search_options": "web search is not supported",
        "store": "stored completions are not supported",
        "metadata": "only for stored completions, which are not supported",
        "prompt_cache_key": "not supported (prefix caching is automatic)",
    },
    "completions": {
        "suffix": "not supported: this model has no fill-in-the-middle mode",
    },
}


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    """Every error the API answers with (documented in the OpenAPI schema)."""
    error: ErrorInfo


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(ConstraintFields, _Request):
    model: str | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)  # sequences per prompt, the prompt computed once
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    user: str | None = None
    safety_identifier: str | None = None  # like user: who asks, for abuse monitoring; no effect on the output
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    return_tokens_as_token_ids: bool = False  # logprob tokens as "token_id:<id>" (exact ids, as in vLLM)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # vLLM's: top-N per prompt token
    service_tier: Literal["auto", "default"] | None = None  # one tier here: only the ones that mean "ours"
    modalities: list[Literal["text"]] | None = None  # text out only; "audio" is refused

    _refused: ClassVar[dict[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _refuse_unimplemented(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, why in cls._refused.items():
                if _is_set(data.get(name)):
                    raise _refuse(name, why)
            data = {k: v for k, v in data.items() if k not in cls._refused}  # null: asks for nothing
        return data

    @model_validator(mode="after")
    def _prompt_logprobs_not_streamed(self):
        if self.prompt_logprobs is not None and self.stream:
            raise _refuse("prompt_logprobs", "not available when stream is true")
        return self

    @property
    def unknown_fields(self) -> list[str]:
        """Fields outside the API reference and our extensions (ignored; the serving layer logs them)."""
        return sorted(self.model_extra or ())

    @field_validator("stop")
    @classmethod
    def _stops_are_short(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 16 or any(not s or len(s) > 256 for s in stops):
            raise ValueError("stop: at most 16 non-empty strings of at most 256 characters")
        return v

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """The engine's parameters; raises ValueError (-> 400) on values the engine refuses."""
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty or 1.0,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    _refused: ClassVar[dict[str, str]] = REFUSED_FIELDS["completions"]

    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = Field(default=16, ge=0)  # 0: only with echo (the prompt and its logprobs)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    # Sequences generated per prompt, of which the n with the highest cumulative logprob are returned.
    best_of: int | None = Field(default=None, ge=1, le=MAX_CHOICES)

    @model_validator(mode="after")
    def _zero_tokens_only_with_echo(self):
        if self.max_tokens == 0 and not self.echo:
            raise _refuse("max_tokens", "must be at least 1 (0 only with echo)")
        return self

    @field_validator("best_of")
    @classmethod
    def _best_of_covers_n(cls, best_of: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n", 1)
        if best_of is not None and best_of < n:
            raise ValueError(f"best_of ({best_of}) must be at least n ({n})")
        if best_of is not None and best_of > 1 and info.data.get("stream"):
            raise ValueError("best_of cannot be used with stream")
        return best_of

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each text or token ids: a completion has one choice per prompt and n."""
        p = self.prompt
        prompts = p if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]
        if any(isinstance(q, list) and not q for q in prompts) or p == []:
            raise ValueError("prompt must not be empty")
        if len(prompts) * max(self.n, self.best_of or 1) > MAX_CHOICES:
            raise ValueError(f"prompt: at most {MAX_CHOICES} choices per request (prompts times n or best_of)")
        return prompts


SUPPORTED_PARTS = ("text", "image_url")


class ImageURL(BaseModel):
    url: str
    detail: str | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "image_url"]
    text: str | None = None
    image_url: ImageURL | None = None

    @model_validator(mode="after")
    def _has_its_payload(self):
        if getattr(self, self.type) is None:
            raise ValueError(f"a content part of type {self.type} needs a {self.type} field")
        return self


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallItem] | None = None  # an assistant's calls, in the history
    tool_call_id: str | None = None  # a tool message: the call it answers
    # An assistant's reasoning, in the history, as a reasoning parser returned it: under either name, both
    # reach the chat template (Qwen3's renders `reasoning_content` in the turns after the last user message).
    reasoning_content: str | None = None
    reasoning: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _supported_parts(cls, content: Any) -> Any:
        # Named here: the union's own error would list a mismatch for every member instead.
        for i, part in enumerate(content if isinstance(content, list) else ()):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind not in SUPPORTED_PARTS:
                raise PydanticCustomError("unsupported", "content part {index} is of type {kind}, which is not "
                                          "supported: parts may be text or image_url",
                                          {"index": i, "kind": kind})
        return content

    @model_validator(mode="after")
    def _reasoning_under_both_names(self):
        self.reasoning_content = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        self.reasoning = self.reasoning if self.reasoning is not None else self.reasoning_content
        return self


class ChatCompletionRequest(ToolFields, _SamplingFields):
    _refused: ClassVar[dict[str, str]] = REFUSED_FIELDS["chat"]

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: false leaves a reasoning parser's reasoning out of the answer (it is still generated).
    include_reasoning: bool = True

    @property
    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            return None
        return self.top_logprobs or 0

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs and not self.logprobs:  # as OpenAI: asked for, it would otherwise go unanswered
            raise _refuse("top_logprobs", "needs logprobs: true")
        return self


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(_Request):
    """vLLM's body for POST /v1/load_lora_adapter."""
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRAAdapterRequest(_Request):
    """vLLM's body for POST /v1/unload_lora_adapter (its lora_int_id is taken and unused: names identify)."""
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None
