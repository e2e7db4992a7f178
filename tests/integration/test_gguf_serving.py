"""SmolLM2 served from its GGUF file as it ships (Q4_1 linear layers, a Q8_0 embedding): every tensor is the
converted folder's bit for bit, and the engine's output is the float32 engine's on that folder, logprobs
included - on a CPU with the quantized kernel by construction, elsewhere by dequantizing at load."""
import gc
import os
import shutil

import pytest
import torch

from epdserve import LLM, SamplingParams
from epdserve.shared.engine.model_runner import return_freed_memory
from epdserve.shared.models.gguf_weights import gguf_weights
from epdserve.shared.models.layers.linear import Linear
from epdserve.shared.models.quantized_weight import QuantizedWeight
from epdserve.shared.models.weights import GGUF_WEIGHTS, iterate_weights

pytestmark = pytest.mark.slow  # two SmolLM2 engines

KERNEL = Linear.runs_quantized(torch.empty(0))  # float32 on this CPU: the quantized kernel runs


def resident_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "List three colors:"]


@pytest.fixture(scope="module")
def float_folder(default_model_path, tmp_path_factory):
    """The converted folder without its GGUF file: the engine serves the dequantized float32 weights."""
    folder = tmp_path_factory.mktemp("float") / "smollm2"
    folder.mkdir()
    for f in default_model_path.iterdir():
        if f.name != GGUF_WEIGHTS:
            (folder / f.name).symlink_to(f)
    return folder


def test_every_tensor_is_the_converted_folders_bit_for_bit(default_model_path):
    reference = dict(iterate_weights(default_model_path))
    kinds = {}
    for name, tensor in gguf_weights(default_model_path / GGUF_WEIGHTS):
        kinds[type(tensor).__name__] = kinds.get(type(tensor).__name__, 0) + 1
        values = tensor.dequantize() if isinstance(tensor, QuantizedWeight) else tensor
        assert torch.equal(values.view(torch.int32), reference.pop(name).view(torch.int32)), name
    assert not reference, f"not in the GGUF file: {sorted(reference)}"
    assert kinds["QuantizedWeight"] == 30 * 7 + 1  # every projection, and the (tied) embedding


def test_the_gguf_engine_answers_as_the_float32_one(default_model_path, float_folder):
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=2)
    answers = {}
    for name, folder in (("gguf", default_model_path), ("float32", float_folder)):
        llm = LLM(model=str(folder), num_kv_blocks=64)
        # The load gave back what it freed: the tensors it read, then packed or dropped, hold no resident memory.
        resident = resident_mb()
        return_freed_memory()
        assert resident - resident_mb() < 64, f"{resident - resident_mb():.0f} MB freed but resident after the load"
        quantized = [m for m in llm.engine.runner.model.modules() if isinstance(m, Linear) and m.quantized is not None]
        assert len(quantized) == (30 * 5 + 1 if name == "gguf" and KERNEL else 0)  # qkv, o, gate, up, down; lm_head
        if quantized:  # the Q4_1 layers two weights to a byte (unsigned nibbles), the Q8_0 lm_head a byte each
            assert sorted(m.quantized.zero for m in quantized) == [-1] + [0] * 150
            model = llm.engine.runner.model  # the tied embedding's lookups read the lm_head's panels: held once
            assert model.model.embed_tokens.packed is model.lm_head.quantized and model.model.embed_tokens.q is None
        answers[name] = [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in step.items()}
                                                   for step in o.outputs[0].logprobs])
                         for o in llm.generate(PROMPTS, params)]
        del llm
        gc.collect()  # the engine's cycles: freed before the next one is built, not during its load
    assert answers["gguf"] == answers["float32"]


def test_a_gguf_file_given_as_the_model_is_prepared_into_a_folder(tmp_path, monkeypatch):
    from epdserve.shared.checkpoints.default_model import SMOLLM2
    from epdserve.shared.checkpoints.model_folder import check_model_folder
    from epdserve.shared.checkpoints.packaged_gguf import gguf_file

    monkeypatch.setenv("EPDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    given = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    shutil.copyfile(gguf_file(SMOLLM2, tmp_path), given)
    folder = check_model_folder(given)
    assert folder.parent == tmp_path / "cache" / "models" and folder.name.startswith("SmolLM2-135M-Instruct.Q4_1-")
    assert os.path.realpath(folder / GGUF_WEIGHTS) == str(given)
    assert check_model_folder(given) == folder  # converted once
    assert "{% for message in messages %}" in (folder / "chat_template.jinja").read_text()  # from the file
