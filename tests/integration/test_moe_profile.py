"""Where a mixture-of-experts step's time goes: an engine built with profile_moe times its sparse MLPs by part
(routing, dispatch, experts, combine) beside the step's other phases, and computes the same tokens as one
that does not."""
import time

import pytest

from epdserve import LLM, SamplingParams
from epdserve.shared.engine.step_timer import MOE_PHASES
from epdserve.shared.models.layers.sparse_moe import SparseMoE

# Prompts of several lengths: steps that prefill many tokens and steps that decode a few.
PROMPTS = [list(range(300, 300 + n)) for n in (3, 29, 70)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module", params=["qwen3-moe", "mixtral"])
def path(request, tmp_path_factory, default_model_path):
    from epdserve.shared.checkpoints.tiny_models import build_tiny_model

    return str(build_tiny_model(request.param, tmp_path_factory.mktemp(request.param), default_model_path))


def sparse_layers(llm: LLM) -> list[SparseMoE]:
    return [m for m in llm.engine.runner.model.modules() if isinstance(m, SparseMoE)]


def test_the_moe_phases_sum_within_the_step(path):
    llm = LLM(model=path, num_kv_blocks=64, profile_moe=True)
    assert sparse_layers(llm) and all(layer.seconds is not None for layer in sparse_layers(llm))
    before = llm.engine.stats().step_seconds
    started = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    elapsed = time.perf_counter() - started
    after = llm.engine.stats().step_seconds
    spent = {phase: after[phase] - before[phase] for phase in after}
    assert set(MOE_PHASES) <= set(spent)
    assert all(seconds >= 0 for seconds in spent.values()), spent
    for phase in MOE_PHASES + ("forward", "attention", "sampler"):
        assert spent[phase] > 0, f"{phase} was not timed: {spent}"
    # The phases split the step without overlap: together within the wall time of the steps that ran.
    assert sum(spent.values()) <= elapsed
    unprofiled = LLM(model=path, num_kv_blocks=64)
    assert [o.outputs[0].token_ids for o in outputs] == \
        [o.outputs[0].token_ids for o in unprofiled.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)]
    # Unprofiled, the sparse MLPs hold no clock and the step timer has no MoE phases.
    assert all(layer.seconds is None for layer in sparse_layers(unprofiled))
    assert not set(MOE_PHASES) & set(unprofiled.engine.stats().step_seconds)


def test_a_dense_model_has_no_moe_phases(default_model_path, tmp_path):
    from epdserve.shared.checkpoints.tiny_models import build_tiny_model

    llm = LLM(model=str(build_tiny_model("llama", tmp_path / "llama", default_model_path)), num_kv_blocks=16,
              profile_moe=True)
    llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY)
    assert not set(MOE_PHASES) & set(llm.engine.stats().step_seconds)


def test_a_service_exports_the_moe_phases(path):
    """What `--profile-moe` gives a service: the parts as phases of its epdserve:engine_step_seconds."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from epdserve.services.host.service_metrics import ServiceMetrics

    llm = LLM(model=path, num_kv_blocks=64, profile_moe=True)
    llm.generate([{"prompt_token_ids": PROMPTS[1]}], GREEDY)
    metrics = ServiceMetrics("unified", "unified-0", "tiny-moe", llm.engine.stats)
    text = generate_latest(metrics.registry).decode()
    seconds = {s.labels["phase"]: s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == "epdserve:engine_step_seconds_total"}
    assert set(MOE_PHASES) <= set(seconds) and all(seconds[p] > 0 for p in MOE_PHASES)
