"""Every conversion between the engine's types and the wire's (`epdserve.transport.protocol`).

- SamplingParams <-> WireSamplingParams: the same fields by name, less those only the engine sets.
  The names are read from the wire struct, never listed here; tests/unit/test_wire.py holds the two
  field sets equal, so a sampling field added to one class and not the other fails there.
- The engine's per-token logprobs (vLLM-shaped `dict[int, Logprob]` of a RequestOutput) ->
  TokenLogprobs, the one logprobs type that services send and the proxy formats.

Imports neither torch nor the engine: the proxy uses it too.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from epdserve.shared.engine.outputs import RequestOutput
from epdserve.transport.protocol import TokenLogprobs, WireSamplingParams
from epdserve.shared.engine.sampling_params import RequestOutputKind, SamplingParams

# SamplingParams fields that never travel: how the caller takes its outputs, and the model's EOS ids,
# which the receiving engine fills in itself.
ENGINE_ONLY_SAMPLING_FIELDS = frozenset({"output_kind", "eos_token_ids"})
WIRE_SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(WireSamplingParams))


def sampling_params_to_wire(params: SamplingParams) -> WireSamplingParams:
    """The parameters as the protocol carries them (stop strings included; services ignore them)."""
    return WireSamplingParams(**{name: _to_tuple(getattr(params, name)) for name in WIRE_SAMPLING_FIELDS})


def sampling_params_from_wire(wire: WireSamplingParams,
                              output_kind: RequestOutputKind = RequestOutputKind.DELTA) -> SamplingParams:
    """Validated engine parameters from the wire (raises ValueError, as for any bad input)."""
    fields = {name: _to_list(getattr(wire, name)) for name in WIRE_SAMPLING_FIELDS}
    return SamplingParams(**fields, output_kind=output_kind)


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
