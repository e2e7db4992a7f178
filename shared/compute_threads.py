"""Which threads of a process compute with several cores: the engine's thread only.

libgomp (torch's OpenMP) stops spinning between parallel regions - every region then waits on a futex -
once a process holds more OpenMP worker threads than CPUs, and a thread that has ever run a parallel op
keeps its team of workers for life. A service whose event loop, model loading or transfers touched
torch with the default thread count therefore slowed its engine's every op: an engine step ran ~1.4x
slower in a service than in the main thread of a script (measured on 2 cores). So a service makes
every thread single-threaded from the start (`compute_in_one_thread_by_default`) and gives its engine
thread, and nothing else, the cores (`set_this_thread`).

OpenMP thread counts are per thread; torch's own setting is process-wide, which is why the engine
thread sets its count through the OpenMP runtime torch loaded.
"""
from __future__ import annotations

import ctypes
import functools
import logging

import torch

logger = logging.getLogger(__name__)


@functools.cache
def _openmp():
    """torch's OpenMP runtime (already loaded: asked by its soname), or None when torch has none."""
    if "OpenMP" not in torch.__config__.parallel_info():
        return None
    try:
        return ctypes.CDLL("libgomp.so.1")
    except OSError:
        return None


def compute_in_one_thread_by_default() -> None:
    """Every thread of this process computes single-threaded unless it says otherwise (before any op)."""
    torch.set_num_threads(1)


def set_this_thread(num_threads: int) -> None:
    """This thread's ops use `num_threads` threads, whatever the process-wide setting."""
    torch.get_num_threads()  # torch sets a thread's count from its process-wide one on first use: do it now
    omp = _openmp()
    if omp is None:
        torch.set_num_threads(num_threads)
        return
    omp.omp_set_num_threads(num_threads)
