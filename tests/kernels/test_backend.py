"""Attention backend selection: names, devices, and Triton being optional where it is not used."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from epdserve.kernels import paged_attention as triton_attention
from epdserve.kernels import cpu_attention, torch_attention
from epdserve.kernels.backend import AttentionBackend, select_attention_backend
from epdserve.kernels.kv_cache_write import kv_cache_write


def test_auto_on_cpu_is_the_kernel_or_torch():
    backend = select_attention_backend("auto", torch.device("cpu"))
    if cpu_attention.available():
        assert backend == AttentionBackend("cpu", cpu_attention.kv_cache_write, cpu_attention.paged_attention,
                                           cpu_attention.plan_attention)
    else:
        assert backend == AttentionBackend("torch", torch_attention.kv_cache_write, torch_attention.paged_attention,
                                           torch_attention.plan_attention)


def test_auto_is_torch_where_the_kernel_cannot_be_built(monkeypatch):
    monkeypatch.setattr(cpu_attention, "available", lambda: False)
    assert select_attention_backend("auto", torch.device("cpu")).name == "torch"


def test_auto_is_triton_on_cuda():
    # Selection only names functions; it touches no device, so it can be checked without a GPU.
    backend = select_attention_backend("auto", torch.device("cuda", 0))
    assert backend == AttentionBackend("triton", kv_cache_write, triton_attention.paged_attention)


def test_torch_on_cuda_and_string_devices():
    assert select_attention_backend("torch", "cuda").name == "torch"
    assert select_attention_backend("torch", "cpu").name == "torch"


def test_unknown_name():
    with pytest.raises(ValueError, match="flash"):
        select_attention_backend("flash", torch.device("cpu"))


def test_backend_is_immutable():
    backend = select_attention_backend("torch", torch.device("cpu"))
    with pytest.raises(AttributeError):
        backend.name = "triton"


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setattr(triton_attention, "INTERPRETED", False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        select_attention_backend("triton", torch.device("cpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is on only without CUDA")
def test_triton_on_cpu_under_interpreter_matches_torch():
    triton_backend = select_attention_backend("triton", torch.device("cpu"))
    torch_backend = select_attention_backend("torch", torch.device("cpu"))
    assert triton_backend.name == "triton"
    gen = torch.Generator().manual_seed(0)
    q_lens, seq_lens = [5, 1, 1], [5, 12, 20]
    key = torch.randn(sum(q_lens), 2, 64, generator=gen)
    value = torch.randn(sum(q_lens), 2, 64, generator=gen)
    query = torch.randn(sum(q_lens), 4, 64, generator=gen)
    block_tables = torch.tensor([[3, 0, 0], [1, 4, 0], [5, 2, 6]], dtype=torch.int32)
    # Positions of the new tokens: the last q_len of each sequence.
    slots = torch.cat([
        block_tables[s, torch.arange(n - q, n) // 8].long() * 8 + torch.arange(n - q, n) % 8
        for s, (q, n) in enumerate(zip(q_lens, seq_lens))
    ])
    outs = []
    for backend in (triton_backend, torch_backend):
        cache_gen = torch.Generator().manual_seed(1)
        key_cache = torch.randn(7, 8, 2, 64, generator=cache_gen)
        value_cache = torch.randn(7, 8, 2, 64, generator=cache_gen)
        backend.write_kv(key, value, key_cache, value_cache, slots)
        outs.append(backend.attend(
            query, key_cache, value_cache, block_tables, torch.tensor(seq_lens, dtype=torch.int32),
            torch.tensor([0, 5, 6, 7], dtype=torch.int32), 0.125,
        ))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)


def _run_without_triton(body: str) -> subprocess.CompletedProcess:
    """Run `body` in a fresh interpreter where importing triton fails."""
    script = textwrap.dedent("""
        import importlib.abc, sys

        class NoTriton(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "triton" or name.startswith("triton."):
                    raise ImportError("No module named 'triton'")
                return None

        sys.meta_path.insert(0, NoTriton())
    """) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)


def test_imports_and_selects_without_triton():
    result = _run_without_triton("""
        import sys
        import torch
        from epdserve.kernels.backend import select_attention_backend
        assert select_attention_backend("auto", torch.device("cpu")).name in ("cpu", "torch")
        assert "triton" not in sys.modules
        try:
            select_attention_backend("triton", torch.device("cuda"))
        except RuntimeError as exc:
            assert "needs the triton package" in str(exc), exc
        else:
            raise AssertionError("selected triton without triton")
    """)
    assert result.returncode == 0, result.stderr
