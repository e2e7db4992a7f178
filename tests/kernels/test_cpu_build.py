"""Which C++ kernels a process loads: the install's prebuilt ones for its CPU's level, loaded as they are,
or a build of its own, which says why; and a build that survives a builder killed mid-build, as replicas
sharing one cache volume see when a container is stopped or OOM-killed while it starts."""
import json
import logging
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from epdserve.kernels import cpu_build, cpu_levels

HERE_LEVEL = cpu_levels.level_for(cpu_levels.cpu_flags(), platform.machine())
HERE_LEVELS = [lv for lv in cpu_levels.LEVELS if lv.machine == platform.machine()]
TOP = cpu_levels.LEVELS[0]
needs_a_level = pytest.mark.skipif(HERE_LEVEL is None, reason="this CPU has none of the prebuilt levels")

LOAD_ALL = ("import json, logging; logging.basicConfig(level=logging.INFO); "
            "from epdserve.kernels import cpu_build, cpu_levels; "
            "print(json.dumps({s: cpu_build.load(s).__file__ for s in cpu_levels.SOURCES}))")


@needs_a_level
def test_the_install_brings_every_level_and_loads_this_cpus_without_compiling(tmp_path):
    built = {p.name.partition(".")[0] for p in cpu_levels.PREBUILT.glob("*.so")}
    wanted = {cpu_levels.module_name(s, lv) for lv in HERE_LEVELS for s in cpu_levels.SOURCES}
    assert wanted <= built, f"missing from {cpu_levels.PREBUILT}: {sorted(wanted - built)} (make install builds them)"

    builds = tmp_path / "torch_extensions"
    done = subprocess.run([sys.executable, "-c", LOAD_ALL], env={**os.environ, "TORCH_EXTENSIONS_DIR": str(builds)},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    for source, file in json.loads(done.stdout).items():
        assert Path(file).parent == cpu_levels.PREBUILT
        assert Path(file).name.partition(".")[0] == cpu_levels.module_name(source, HERE_LEVEL)
    assert not builds.exists(), "a kernel was compiled"
    assert done.stderr.count("C++ CPU kernels: prebuilt for") == 1, done.stderr


@pytest.mark.parametrize("level", HERE_LEVELS, ids=lambda lv: lv.name)
def test_every_level_this_cpu_runs_computes_what_pytorch_does(level):
    if not level.cpu_flags <= cpu_levels.cpu_flags():
        pytest.skip(f"this CPU lacks {level.description}")
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, head_size, block_size, length = 6, 2, 64, 16, 40
    key_cache, value_cache = torch.randn(2, 5, kv_heads, block_size, head_size, generator=gen)  # head-major
    table, query = torch.tensor([[3, 0, 4]]), torch.randn(1, heads, head_size, generator=gen)
    out = torch.empty_like(query)
    cpu_build.load_prebuilt("cpu_paged_attention", level).paged_attention(
        out, query, key_cache, value_cache, table, torch.tensor([0]), torch.tensor([length]), head_size ** -0.5, -1)
    keys, values = (c[table[0]].transpose(0, 1).reshape(kv_heads, -1, head_size)[:, :length]
                    .repeat_interleave(heads // kv_heads, 0) for c in (key_cache, value_cache))
    weights = torch.softmax((keys @ query[0].unsqueeze(-1)).squeeze(-1) * head_size ** -0.5, -1)
    torch.testing.assert_close(out[0], (weights.unsqueeze(1) @ values).squeeze(1), rtol=2e-5, atol=2e-5)

    x, weight = torch.randn(7, 576, generator=gen), torch.randn(576, generator=gen)
    normed = torch.empty_like(x)
    cpu_build.load_prebuilt("cpu_layer_ops", level).rms_norm(normed, x, weight, 1e-5)
    torch.testing.assert_close(normed, weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))

    linear = cpu_build.load_prebuilt("cpu_linear", level)
    assert linear.dtypes() == {"avx512_bf16": ["float32", "bfloat16"], "avx2": ["float32"]}[level.name]
    if linear.dtypes():
        w = torch.randn(100, 64, generator=gen)
        torch.testing.assert_close(linear.linear(x[:, :64].contiguous(), linear.pack(w), 100, None),
                                   F.linear(x[:, :64], w), rtol=1e-4, atol=1e-3)


def manifest(folder: Path, **fields) -> Path:
    (folder / cpu_levels.MANIFEST).write_text(json.dumps({"torch": torch.__version__,
                                                          "sources": cpu_levels.sources_digest(), **fields}))
    return folder


@pytest.mark.parametrize("flags, folder, why", [
    ("fpu sse sse2 avx", None, "this CPU has none of the prebuilt levels"),
    (TOP.cpu_flags, lambda tmp: tmp, "this install has no prebuilt kernels"),
    (TOP.cpu_flags, lambda tmp: manifest(tmp, torch="2.0.0+cpu"), "were built against torch 2.0.0+cpu, this is torch"),
    (TOP.cpu_flags, lambda tmp: manifest(tmp, sources="0"), "changed since the prebuilt kernels were built"),
    (TOP.cpu_flags, lambda tmp: manifest(tmp), f"the prebuilt {TOP.name} kernels cpu_paged_attention, cpu_linear,"),
], ids=["cpu", "no-manifest", "other-torch", "sources-changed", "modules-missing"])
def test_without_usable_prebuilt_kernels_the_fallback_build_says_why(flags, folder, why, tmp_path, caplog):
    flags = frozenset(flags.split() if isinstance(flags, str) else flags)
    with caplog.at_level(logging.INFO, logger=cpu_build.__name__):
        level = cpu_build.choose(flags, "x86_64", *([folder(tmp_path)] if folder else []))
    assert level is None
    ((record),) = caplog.records
    assert record.levelno == logging.WARNING
    assert record.getMessage().startswith("C++ CPU kernels: built here for this CPU (-march=native) because ")
    assert why in record.getMessage() and "about half a minute per kernel" in record.getMessage()


@needs_a_level
def test_prebuilt_kernels_of_the_level_are_chosen_and_said_so(caplog):
    with caplog.at_level(logging.INFO, logger=cpu_build.__name__):
        assert cpu_build.choose(HERE_LEVEL.cpu_flags, HERE_LEVEL.machine) == HERE_LEVEL
    assert [r.getMessage() for r in caplog.records] == [
        f"C++ CPU kernels: prebuilt for {HERE_LEVEL.name} ({HERE_LEVEL.description})"]


BUILD = ("from epdserve.kernels import cpu_build; "
         "print('built' if cpu_build.build('cpu_layer_ops') is not None else 'none')")


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler here")
def test_a_builder_killed_mid_build_does_not_block_the_next(tmp_path):
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    # Its own process group: the kill takes g++ and ninja with it, as stopping a container does.
    first = subprocess.Popen([sys.executable, "-c", BUILD], env=env, start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob("*/lock")):  # torch's own lock: the build has begun
            assert first.poll() is None, "the first builder ended before it began building"
            assert time.monotonic() < deadline, "the first builder never began building"
            time.sleep(0.05)
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    assert list(tmp_path.glob("*/lock")), "the killed builder left no lock: nothing is tested"

    # torch alone waits on the stale lock forever; the timeout turns that into a failure.
    second = subprocess.run([sys.executable, "-c", BUILD], env=env, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr
    assert second.stdout.strip() == "built", second.stderr
    assert not list(tmp_path.glob("*/lock"))
    assert "building the C++ kernel cpu_layer_ops.cpp for this CPU" in second.stderr
