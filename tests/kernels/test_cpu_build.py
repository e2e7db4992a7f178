"""Building the C++ kernels survives a builder killed mid-build, as replicas sharing one cache volume see
when a container is stopped or OOM-killed while it starts."""
import os
import signal
import subprocess
import sys
import time

import pytest

from epdserve.kernels import cpu_layer_ops

pytestmark = pytest.mark.skipif(not cpu_layer_ops.available(), reason="the C++ ops cannot be built here")

BUILD = ("from epdserve.kernels import cpu_build; "
         "print('built' if cpu_build.build('cpu_layer_ops') is not None else 'none')")


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
