"""Every conversion between the engine's types and the wire's (`epdserve.transport.channel.protocol`): the one place
they meet, on the services' side (the engine knows no wire, the transport no engine).

- SamplingParams <-> WireSamplingParams: the same fields by name, less those only the engine sets.
  The names are read from the wire struct, never listed here; tests/unit/test_wire.py holds the two
  field sets equal, so a sampling field added to one class and not the other fails there.
  Two fields change form on the way: logit_bias (a dict <-> LogitBias pairs sorted by token id) and
  structured_outputs (StructuredOutputsParams <-> WireStructuredOutputs, the same kind and spec).
- The engine's per-token logprobs (vLLM-shaped `dict[int, Logprob]` of a RequestOutput) ->
  TokenLogprobs, the one logprobs type that services send and the proxy formats.
- A prompt's M-RoPE positions: three rows (temporal, height, width) <-> MRopePositions.

Imports no torch and nothing of the engine but its plain types: the proxy uses it too.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from epdserve.shared.engine import RequestOutput, RequestOutputKind, SamplingParams, StructuredOutputsParams
from epdserve.transport.channel.protocol import (LogitBias, MRopePositions, TokenLogprobs, WireSamplingParams,
                                                 WireStructuredOutputs)

# SamplingParams fields that never travel: how the caller takes its outputs, and the model's EOS ids,
# which the receiving engine fills in itself.
ENGINE_ONLY_SAMPLING_FIELDS = frozenset({"output_kind", "eos_token_ids"})
WIRE_SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(WireSamplingParams))


def sampling_params_to_wire(params: SamplingParams) -> WireSamplingParams:
    """The parameters as the protocol carries them (stop strings included; services ignore them)."""
    fields = {name: _to_tuple(getattr(params, name)) for name in WIRE_SAMPLING_FIELDS}
    fields["logit_bias"] = tuple(LogitBias(t, float(b)) for t, b in sorted((params.logit_bias or {}).items()))
    so = params.structured_outputs
    fields["structured_outputs"] = None if so is None else WireStructuredOutputs(so.kind, so.spec)
    return WireSamplingParams(**fields)


def sampling_params_from_wire(wire: WireSamplingParams,
                              output_kind: RequestOutputKind = RequestOutputKind.DELTA) -> SamplingParams:
    """Validated engine parameters from the wire (raises ValueError, as for any bad input)."""
    fields = {name: _to_list(getattr(wire, name)) for name in WIRE_SAMPLING_FIELDS}
    fields["logit_bias"] = {b.token_id: b.bias for b in wire.logit_bias} or None
    so = wire.structured_outputs
    fields["structured_outputs"] = None if so is None else StructuredOutputsParams(so.kind, so.spec)
    return SamplingParams(**fields, output_kind=output_kind)


def mrope_positions_to_wire(rows) -> MRopePositions | None:
    """A prompt's three rows of positions (None: 1-D positions) as the protocol carries them."""
    return None if rows is None else MRopePositions(*(tuple(row) for row in rows))


def mrope_positions_from_wire(positions: MRopePositions | None) -> tuple[tuple[int, ...], ...] | None:
    """The three rows the engine takes (it checks their lengths and values)."""
    return None if positions is None else (positions.temporal, positions.height, positions.width)


def logprobs_to_wire(output: RequestOutput, num_top: int | None) -> tuple[TokenLogprobs, ...]:
    """The output's per-token logprobs (sampled token + top `num_top` by rank) as wire structs; () when
    the request asked for none (`num_top` None)."""
    completion = output.outputs[0]
    if num_top is None or not completion.logprobs:
        return ()
    return tuple(_entry_to_wire(token, entry, num_top) for token, entry in zip(completion.token_ids,
                                                                               completion.logprobs))


def prompt_logprobs_to_wire(output: RequestOutput, num_top: int | None) -> tuple[TokenLogprobs, ...]:
    """The output's prompt logprobs, one per prompt token after the first (which has none); () when the
    output carries none."""
    if num_top is None or not output.prompt_logprobs:
        return ()
    return tuple(_entry_to_wire(token, entry, num_top)
                 for token, entry in zip(output.prompt_token_ids[1:], output.prompt_logprobs[1:]))


def _entry_to_wire(token: int, entry: dict, num_top: int) -> TokenLogprobs:
    top = sorted((lp.rank, tid, lp.logprob) for tid, lp in entry.items() if lp.rank <= num_top)
    return TokenLogprobs(entry[token].logprob, tuple(t for _, t, _ in top), tuple(v for *_, v in top),
                         entry[token].rank)


def _to_tuple(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _to_list(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value
