"""Conversions between engine and wire types: derived field sets, exact round trips, no torch in the proxy."""
import dataclasses
import subprocess
import sys

import pytest

from epdserve.transport.channel import protocol as p
from epdserve.shared.engine.outputs import CompletionOutput, Logprob, RequestOutput
from epdserve.shared.engine.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from epdserve.services.host.wire import (ENGINE_ONLY_SAMPLING_FIELDS, WIRE_SAMPLING_FIELDS, logprobs_to_wire,
                                  mrope_positions_from_wire, mrope_positions_to_wire, prompt_logprobs_to_wire,
                                  sampling_params_from_wire, sampling_params_to_wire)
from epdserve.transport.channel import codec

# Every wire field away from its default (but n, which must be 1).
PARAMS = SamplingParams(
    temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=2**63, presence_penalty=0.5, frequency_penalty=-0.5,
    repetition_penalty=1.1, max_tokens=33, min_tokens=2, stop=["a", "bc"], stop_token_ids=[3, 4], ignore_eos=True,
    include_stop_str_in_output=True, logprobs=3, prompt_logprobs=2, skip_special_tokens=False,
    logit_bias={7: -100.0, 3: 2.5}, structured_outputs=StructuredOutputsParams("regex", "[a-z]+"))


def test_sampling_params_and_their_wire_form_have_the_same_fields():
    engine = {f.name for f in dataclasses.fields(SamplingParams)}
    assert engine == set(WIRE_SAMPLING_FIELDS) | ENGINE_ONLY_SAMPLING_FIELDS
    assert not ENGINE_ONLY_SAMPLING_FIELDS & set(WIRE_SAMPLING_FIELDS)


def test_defaults_agree():
    assert sampling_params_to_wire(SamplingParams()) == p.WireSamplingParams()
    assert sampling_params_from_wire(p.WireSamplingParams(), RequestOutputKind.CUMULATIVE) == SamplingParams()


def test_every_wire_field_survives_the_trip():
    wire = sampling_params_to_wire(PARAMS)
    default = p.WireSamplingParams()
    assert [f for f in WIRE_SAMPLING_FIELDS if f != "n" and getattr(wire, f) == getattr(default, f)] == []
    received = codec.decode([bytearray(f) for f in codec.encode(p.GenerateRequest("r", (1,), wire, "tcp://x:1"))])
    back = sampling_params_from_wire(received.sampling_params)
    assert back == dataclasses.replace(PARAMS, output_kind=RequestOutputKind.DELTA)
    assert type(back.stop) is list and type(back.stop_token_ids) is list  # the engine's own form
    assert back.eos_token_ids == ()  # the receiving engine fills in its model's


def test_bad_parameters_from_the_wire_are_rejected_like_any_input():
    with pytest.raises(ValueError, match="top_p"):
        sampling_params_from_wire(p.WireSamplingParams(top_p=0.0))


def _output(entries, token_ids):
    completion = CompletionOutput(0, "", token_ids, logprobs=entries)
    return RequestOutput("r", None, [1], [completion], False)


def test_logprobs_keep_the_top_n_by_rank_and_the_sampled_token():
    out = _output([
        {5: Logprob(-0.1, 1), 9: Logprob(-2.5, 2), 7: Logprob(-3.0, 3)},  # sampled the best
        {5: Logprob(-0.2, 1), 9: Logprob(-1.9, 2), 4: Logprob(-6.0, 17)},  # sampled one outside the top 2
    ], [5, 4])
    assert logprobs_to_wire(out, 2) == (p.TokenLogprobs(-0.1, (5, 9), (-0.1, -2.5), 1),
                                        p.TokenLogprobs(-6.0, (5, 9), (-0.2, -1.9), 17))
    assert logprobs_to_wire(out, 0) == (p.TokenLogprobs(-0.1, rank=1), p.TokenLogprobs(-6.0, rank=17))
    assert logprobs_to_wire(out, None) == ()


def test_prompt_logprobs_skip_the_first_token_which_nothing_predicts():
    completion = CompletionOutput(0, "", [8])
    out = RequestOutput("r", None, [3, 5, 4], [completion], False,
                        prompt_logprobs=[None, {5: Logprob(-0.1, 1), 9: Logprob(-2.5, 2)},
                                         {5: Logprob(-0.2, 1), 4: Logprob(-6.0, 17)}])
    assert prompt_logprobs_to_wire(out, 1) == (p.TokenLogprobs(-0.1, (5,), (-0.1,), 1),
                                               p.TokenLogprobs(-6.0, (5,), (-0.2,), 17))
    assert prompt_logprobs_to_wire(out, None) == ()
    assert prompt_logprobs_to_wire(RequestOutput("r", None, [3], [completion], False), 1) == ()
    assert p.TokenLogprobs(-0.1, (5, 9), (-0.1, -2.5)).top == [(5, -0.1), (9, -2.5)]


def test_mrope_positions_cross_as_three_rows():
    rows = ((0, 1, 2, 2, 4), (0, 1, 2, 3, 4), (0, 1, 2, 2, 4))
    wire = mrope_positions_to_wire([list(r) for r in rows])
    assert wire == p.MRopePositions(*rows) and mrope_positions_from_wire(wire) == rows
    assert mrope_positions_to_wire(None) is None and mrope_positions_from_wire(None) is None


def test_the_proxy_process_loads_no_torch():
    """Every module of the proxy, and the command line that starts it: the proxy's process imports them all
    (pyproject.toml's contract checks the same statically)."""
    code = ("import importlib, pkgutil, sys\n"
            "import epdserve.services.proxy as proxy\n"
            "for m in pkgutil.iter_modules(proxy.__path__): importlib.import_module(f'epdserve.services.proxy.{m.name}')\n"
            "import epdserve.services.cli.main\n"
            "loaded = [m for m in sys.modules if m.startswith('epdserve.')]\n"
            "print(len(loaded), 'torch' in sys.modules, sorted(m for m in loaded if m.startswith('epdserve.kernels')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    count, torch_loaded, kernels = result.stdout.split(" ", 2)
    assert int(count) > 40 and torch_loaded == "False" and kernels.strip() == "[]", result.stdout
