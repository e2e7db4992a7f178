"""The request fields that constrain or steer the output: `response_format`, vLLM's `structured_outputs`
and older `guided_*` fields, `logit_bias`, and the chat's `tools` / `tool_choice` / `parallel_tool_calls`.

They become the engine's `StructuredOutputsParams` here, at the edge, with a 400 naming the field for
anything malformed. A JSON schema is checked against its metaschema and a regex compiled by Python's
`re` (the proxy does not load xgrammar, which needs torch); an engine refuses what still does not compile
(a 400 too), failing that request alone. `tool_choice` "required" or a named function is enforced as a
JSON schema of the call(s), as vLLM does; "auto" leaves the model free and a tool parser reads its text.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from epdserve.shared.engine import LOGIT_BIAS_MAX, LOGIT_BIAS_MIN, StructuredOutputsParams
from epdserve.transport.channel.limits import DEFAULT_LIMITS


class ConstraintError(ValueError):
    """A constraint field is invalid (-> HTTP 400 naming `param`)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class ConstraintLimits:
    """How much one request may ask of the constraint machinery, each beyond it a 400 naming the field: a
    constraint's text (a JSON schema, regex, grammar or choice list, a forced tool call's schema) takes
    seconds to compile per 100 KB, and logit_bias entries cost the sampler per step."""

    max_spec_bytes: int = 256 << 10
    max_logit_bias: int = 1024

    def __post_init__(self):
        # A bigger constraint would pass here and be dropped on the wire.
        if not 0 < self.max_spec_bytes <= DEFAULT_LIMITS.max_str_len:
            raise ValueError(f"--max-structured-output-bytes must be in [1, {DEFAULT_LIMITS.max_str_len}], "
                             f"got {self.max_spec_bytes}")
        if self.max_logit_bias < 1:
            raise ValueError(f"--max-logit-bias must be at least 1, got {self.max_logit_bias}")

    def check_text(self, text: str, param: str) -> None:
        size = len(text.encode())
        if size > self.max_spec_bytes:
            raise ConstraintError(f"{param}: the constraint is {size} bytes; at most {self.max_spec_bytes} are taken "
                                  "(--max-structured-output-bytes)", param)

    def check(self, constraint: StructuredOutputsParams, param: str) -> StructuredOutputsParams:
        self.check_text(constraint.spec, param)
        return constraint


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the schema is always enforced exactly


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_when_needed(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("a response_format of type json_schema needs a json_schema field")
        return self


class StructuredOutputsField(BaseModel):
    """vLLM's `structured_outputs`: exactly one of its constraints. Other keys are refused."""
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_: dict[str, Any] | bool | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class FunctionDefinition(BaseModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


class ToolCallFunction(BaseModel):
    name: str
    arguments: str


class ToolCallItem(BaseModel):
    """An assistant message's tool call in the history."""
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ConstraintFields(BaseModel):
    """Mixed into both completion requests."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    logit_bias: dict[str, float] | None = None

    def output_constraint(self, limits: ConstraintLimits) -> tuple[StructuredOutputsParams | None, str | None]:
        """The constraint asked for and the field that asked for it; raises ConstraintError."""
        found = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", StructuredOutputsParams("json_object")))
        elif rf is not None and rf.type == "json_schema":
            found.append(("response_format", _json_schema(rf.json_schema.json_schema, "response_format", limits)))
        so = self.structured_outputs
        if so is not None:
            options = [(k, v) for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                           ("grammar", so.grammar)) if v is not None]
            if so.json_object:
                options.append(("json_object", True))
            if len(options) != 1:
                raise ConstraintError("structured_outputs must set exactly one of json, regex, choice, grammar, "
                                      "json_object", "structured_outputs")
            found.append(("structured_outputs", _constraint(*options[0], "structured_outputs", limits)))
        for kind in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{kind}")
            if value is not None:
                found.append((f"guided_{kind}", _constraint(kind, value, f"guided_{kind}", limits)))
        if len(found) > 1:
            raise ConstraintError(f"{found[1][0]} and {found[0][0]} both constrain the output; give one",
                                  found[1][0])
        return (found[0][1], found[0][0]) if found else (None, None)

    def token_biases(self, vocab_size: int, limits: ConstraintLimits) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        if len(self.logit_bias) > limits.max_logit_bias:
            raise ConstraintError(f"logit_bias has {len(self.logit_bias)} entries; at most {limits.max_logit_bias} "
                                  "are taken (--max-logit-bias)", "logit_bias")
        biases = {}
        for key, bias in self.logit_bias.items():
            try:
                token_id = int(key)
            except ValueError:
                raise ConstraintError(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
            if not 0 <= token_id < vocab_size:
                raise ConstraintError(f"logit_bias token id {token_id} is outside the vocabulary [0, {vocab_size})",
                                      "logit_bias")
            if not LOGIT_BIAS_MIN <= bias <= LOGIT_BIAS_MAX:
                raise ConstraintError(f"logit_bias values must be in [{LOGIT_BIAS_MIN:g}, {LOGIT_BIAS_MAX:g}], "
                                      f"got {bias}", "logit_bias")
            biases[token_id] = float(bias)
        return biases


class ToolFields(BaseModel):
    """Mixed into chat requests."""

    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    def tool_mode(self) -> str | None:
        """"none", "auto", "required" or "named" (None without tools); raises ConstraintError."""
        if not self.tools:
            if self.tool_choice not in (None, "none"):
                raise ConstraintError("tool_choice needs tools", "tool_choice")
            return None
        names = [t.function.name for t in self.tools]
        if len(set(names)) != len(names):
            raise ConstraintError("tools must have distinct function names", "tools")
        choice = self.tool_choice or "auto"
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in names:
                raise ConstraintError(f"tool_choice names {choice.function.name!r}, which is not among the tools",
                                      "tool_choice")
            return "named"
        return choice

    def tool_call_constraint(self, limits: ConstraintLimits) -> StructuredOutputsParams | None:
        """The JSON schema a forced call must follow: a named function's arguments, or for "required" a
        list of {"name", "parameters"} objects (one item when parallel_tool_calls is false)."""
        mode = self.tool_mode()
        if mode == "named":
            tool = next(t for t in self.tools if t.function.name == self.tool_choice.function.name)
            return _json_schema(_parameters(tool), "tools", limits)
        if mode != "required":
            return None
        items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                                   "parameters": _parameters(t)},
                  "required": ["name", "parameters"], "additionalProperties": False} for t in self.tools]
        schema = {"type": "array", "minItems": 1, "items": items[0] if len(items) == 1 else {"anyOf": items}}
        if not self.parallel_tool_calls:
            schema["maxItems"] = 1
        return _json_schema(schema, "tools", limits)

    def tools_for_template(self) -> list[dict] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None


def _parameters(tool: Tool) -> dict:
    return tool.function.parameters or {"type": "object", "properties": {}}


def _constraint(kind: str, value: Any, param: str, limits: ConstraintLimits) -> StructuredOutputsParams:
    if kind == "json":
        return _json_schema(value, param, limits)
    if kind == "json_object":
        return StructuredOutputsParams("json_object")
    if kind == "regex":
        limits.check_text(value, param)
        try:
            re.compile(value)
        except re.error as exc:
            raise ConstraintError(f"{param}: invalid regex: {exc}", param) from None
        if not value:
            raise ConstraintError(f"{param}: the regex is empty", param)
        return StructuredOutputsParams("regex", value)
    if kind == "choice":
        if not value or any(not c for c in value):
            raise ConstraintError(f"{param}: choice needs a non-empty list of non-empty strings", param)
        return limits.check(StructuredOutputsParams.choices(value), param)
    if not value.strip():
        raise ConstraintError(f"{param}: the grammar is empty", param)
    return limits.check(StructuredOutputsParams("grammar", value), param)


def _json_schema(schema: Any, param: str, limits: ConstraintLimits) -> StructuredOutputsParams:
    if isinstance(schema, str):
        limits.check_text(schema, param)
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ConstraintError(f"{param}: the JSON schema is not JSON: {exc}", param) from None
    if schema is None:
        schema = {}
    if not isinstance(schema, (dict, bool)):
        raise ConstraintError(f"{param}: a JSON schema must be an object or a boolean", param)
    constraint = limits.check(StructuredOutputsParams.json_schema(schema), param)  # before the costly checks
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise ConstraintError(f"{param}: invalid JSON schema: {exc.message}", param) from None
    except Exception as exc:  # a metaschema the validator cannot use, an unknown type: still the request's fault
        raise ConstraintError(f"{param}: invalid JSON schema: {exc}", param) from None
    return constraint
