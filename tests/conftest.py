import dataclasses
import importlib.util
import os
from pathlib import Path

import pytest
import torch

# Triton kernels run on CPU tensors through the interpreter when there is no GPU. The variable must be
# set before triton is first imported, hence here rather than in a fixture.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # The interpreter checks every 32-bit integer add, sub and mul of a kernel for overflow, in Python: about
    # a third of its time (the LoRA kernels in a model: 38 -> 27 s without it). Compiled GPU code checks
    # nothing of the kind outside debug builds, and no offset in these tests' shapes comes near 2**31.
    from triton.runtime import interpreter as _interpreter

    _interpreter.interpreter_builder.options = dataclasses.replace(_interpreter.interpreter_builder.options,
                                                                   sanitize_overflow=False)


def pytest_addoption(parser):
    parser.addoption("--suite-profile", metavar="FILE",
                     help="write each test's seconds and what each folder starts to FILE (tests/suite_profile.py)")


def pytest_configure(config):
    if config.getoption("--suite-profile"):
        # Loaded by path: no folder of the tests goes onto sys.path.
        spec = importlib.util.spec_from_file_location("epdserve_suite_profile",
                                                      Path(__file__).with_name("suite_profile.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        worker = getattr(config, "workerinput", {}).get("workerid")
        config.pluginmanager.register(module.SuiteProfile(config.getoption("--suite-profile"), worker),
                                      "suite-profile")


# The folders in the order their tests run: whole stacks first, then in-process engines, then the quick
# ones. With pytest-xdist (`make test`: three workers, a file whole on one worker) the long files start first and
# the many short ones fill the end, so no worker sits idle while another finishes a long file.
FOLDER_ORDER = ("e2e", "integration", "deploy", "kernels", "unit")


def _folder_rank(item) -> int:
    parts = item.nodeid.split("/")
    return FOLDER_ORDER.index(parts[1]) if len(parts) > 2 and parts[1] in FOLDER_ORDER else len(FOLDER_ORDER)


def pytest_collection_modifyitems(config, items):
    items.sort(key=_folder_rank)  # stable: the order within a folder is kept
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


# Tests share two cores with other processes; more intra-op threads than free cores makes torch's OpenMP
# workers spin against each other. One thread is also what makes runs reproducible.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def hf_causal_lm():
    """load(path) -> HF transformers' float32 causal LM of that folder, in eval mode, loaded once per test
    process: the references of many modules are the same model. Callers only read it (generate, forward);
    a test that changes a model (PEFT) loads its own."""
    from transformers import AutoModelForCausalLM

    models = {}

    def load(path):
        if str(path) not in models:
            models[str(path)] = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        return models[str(path)]

    return load


@pytest.fixture(scope="session")
def default_model_path():
    """SmolLM2-135M-Instruct as an HF folder, converted from the packaged GGUF on first use."""
    from epdserve.shared.checkpoints.default_model import prepare_default_model

    return prepare_default_model()


@pytest.fixture(scope="session")
def gemma3_270m_path():
    """Gemma 3 270M (pretrained) as an HF folder, converted from the packaged GGUF on first use."""
    from epdserve.shared.checkpoints.gemma3_270m import prepare_gemma3_270m

    return prepare_gemma3_270m()


@pytest.fixture(scope="session")
def build_once(tmp_path_factory, worker_id):
    """build(relative path, builder) -> a test checkpoint folder, built by builder(folder) the first time any worker
    of this run asks for it: pytest-xdist gives each worker a temp folder of its own, and these checkpoints (fixed
    seeds) are the same for all of them, so they are built once, under a lock, in the folder the workers share."""
    from epdserve.shared.checkpoints import model_folder

    base = tmp_path_factory.getbasetemp()
    root = (base.parent if worker_id != "master" else base) / "checkpoints"
    return lambda name, builder: str(model_folder.build_once(root / name, builder))


@pytest.fixture(scope="session")
def tiny_model_paths(build_once, default_model_path):
    """Random tiny checkpoints of every supported text family (tiny_models.TINY_CONFIGS: llama, qwen2, qwen3,
    qwen3-moe, mixtral, gemma3), built by the project's own script (fixed seed)."""
    from epdserve.shared.checkpoints.tiny_models import TINY_CONFIGS, build_tiny_model

    # Each folder is named after its family: the name a stack serves it under by default.
    return {arch: build_once(f"tiny-models/{arch}",
                             lambda out, arch=arch: build_tiny_model(arch, out, default_model_path))
            for arch in TINY_CONFIGS}


@pytest.fixture(scope="session")
def llava_demo_path(build_once, default_model_path):
    """The demo LLaVA checkpoint (SmolLM2 + a small untrained CLIP tower), built by the project's own builder."""
    from epdserve.shared.checkpoints.llava_demo import build_llava_demo

    return build_once("llava-demo", lambda out: build_llava_demo(out, default_model_path))


TIE_GAP = 1e-4  # absolute float32 logit difference under which a greedy choice counts as a near-tie


def _first_mismatch_is_near_tie(name, ours, ref_tokens, ref_logits) -> int:
    """0 if `ours` equals HF's greedy tokens; 1 if it first differs where HF's top-2 logits are within
    TIE_GAP (and ours is HF's runner-up there); otherwise an assertion error."""
    k = next((j for j, (a, b) in enumerate(zip(ours, ref_tokens)) if a != b), None)
    if k is None:
        assert len(ours) == len(ref_tokens), f"{name}: length {len(ours)} != HF {len(ref_tokens)}"
        return 0
    top2 = ref_logits[k].topk(2).values
    gap = float(top2[0] - top2[1])
    assert gap < TIE_GAP, (f"{name}: token {k} differs ({ours[k]} vs HF {ref_tokens[k]}) and HF's top-2 logit gap "
                           f"there is {gap:.2e}, not a near-tie (< {TIE_GAP})")
    assert ref_logits[k][ours[k]] >= top2[1], f"{name}: our token {ours[k]} is not HF's top-2 at step {k}"
    return 1


@pytest.fixture(scope="session")
def near_tie_check():
    """check(name, our tokens, HF tokens, HF per-step logits) -> 1 at an accepted near-tie, else 0."""
    return _first_mismatch_is_near_tie


def _hf_greedy(model, input_ids: list[int], max_new_tokens: int, **inputs):
    """HF `generate`, greedy, on one prompt: (new tokens, per-step logits)."""
    ids = torch.tensor([input_ids])
    eos = model.generation_config.eos_token_id  # one id, or a list (Gemma 3: <eos> and <end_of_turn>)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         output_logits=True, return_dict_in_generate=True,
                         pad_token_id=eos[0] if isinstance(eos, list) else eos, **inputs)
    return out.sequences[0, len(input_ids):].tolist(), [step[0] for step in out.logits]


@pytest.fixture(scope="session")
def hf_greedy():
    return _hf_greedy


@pytest.fixture(scope="session")
def qwen2_5_vl_path(build_once, default_model_path):
    """The tiny Qwen2.5-VL checkpoint (random vision tower and Qwen2 decoder with M-RoPE, fixed seed), built
    by the project's own builder."""
    from epdserve.shared.checkpoints.tiny_qwen2_5_vl import build_tiny_qwen2_5_vl

    return build_once("tiny-qwen2.5-vl", lambda out: build_tiny_qwen2_5_vl(out, default_model_path))


@pytest.fixture(scope="session")
def tiny_qwen3_thinking_path(build_once, default_model_path):
    """The tiny Qwen3 with Qwen3's <think> tokens and thinking chat template (random weights, fixed seed)."""
    from epdserve.shared.checkpoints.tiny_qwen3_thinking import build_tiny_qwen3_thinking

    return build_once("tiny-qwen3-thinking", lambda out: build_tiny_qwen3_thinking(out, default_model_path))
