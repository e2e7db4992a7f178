import os

import pytest
import torch

# Triton kernels run on CPU tensors through the interpreter when there is no GPU. The variable must be
# set before triton is first imported, hence here rather than in a fixture.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
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
def default_model_path():
    """SmolLM2-135M-Instruct as an HF folder, converted from the packaged GGUF on first use."""
    from epdserve.shared.default_model import prepare_default_model

    return prepare_default_model()


@pytest.fixture(scope="session")
def tiny_model_paths(tmp_path_factory, default_model_path):
    """Random tiny Llama and Qwen2 checkpoints built by the project's own script (fixed seed)."""
    from epdserve.shared.tiny_models import TINY_CONFIGS, build_tiny_model

    root = tmp_path_factory.mktemp("tiny-models")
    return {arch: str(build_tiny_model(arch, root / arch, default_model_path)) for arch in TINY_CONFIGS}


@pytest.fixture(scope="session")
def llava_demo_path(tmp_path_factory, default_model_path):
    """The demo LLaVA checkpoint (SmolLM2 + a small untrained CLIP tower), built by the project's own builder."""
    from epdserve.shared.llava_demo import build_llava_demo

    return str(build_llava_demo(tmp_path_factory.mktemp("llava") / "llava-demo", default_model_path))
