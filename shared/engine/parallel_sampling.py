"""Parallel sampling: n sequences from one prompt (`SamplingParams.n`), the prompt computed once.

vLLM v1 fans a request with n > 1 out into n independent child requests (`ParentRequest`) and lets the
prefix cache share the prompt between them: every child still computes at least its prompt's last
token (a cache hit never covers it, its logits are needed), and with prefix caching off each child
computes the whole prompt. Here the n sequences are a real fork instead, which computes the prompt once
whatever the cache settings:

- `make_group` builds the n sequences, ids `"{i}_{parent id}"`. Sequence 0 is scheduled like any
  request; the others wait on it (`forks`), admitted but in no queue.
- The step that completes sequence 0's prompt samples every waiting sequence's first token from the
  same logits row (each with its own seed stream), and the scheduler forks them: they take references
  on sequence 0's blocks (`BlockManager.fork`) and join the running batch. The shared partial last block
  is copied by whichever sequence writes into it first (copy-on-write); full blocks stay shared.
- From then on each sequence is an ordinary request: preempted, finished or aborted alone; a shared block
  returns to the pool when its last holder lets go. If sequence 0 ends before its prompt is computed
  (aborted, failed), the next waiting sequence takes its place.
- Disaggregated: prefill runs the group up to the first tokens (one prefill, n samples) and holds one set
  of prompt blocks; decode pulls them once into sequence 0's reservation and forks the others from it,
  each with the first token prefill sampled for it (handoff.py, `Scheduler.finish_load`).
- Sequence i samples from seed + i, so a seeded request is reproducible and its sequence 0 is the same
  request with n = 1.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

from epdserve.shared.engine.request import Request
from epdserve.shared.engine.sampling_params import SamplingParams, sequence_seed


def sequence_id(group_id: str, index: int) -> str:
    """The engine-internal id of sequence `index` of a group (vLLM's convention)."""
    return f"{index}_{group_id}"


def make_group(request_id: str, params: SamplingParams, make: Callable[[str, SamplingParams], Request]) -> Request:
    """The request to schedule for `params.n` sequences: `make(id, params)` itself when n == 1, else
    sequence 0 with the others in its `forks`."""
    if params.n == 1:
        return make(request_id, params)
    sequences = []
    for i in range(params.n):
        sequence = make(sequence_id(request_id, i), replace(params, n=1, seed=sequence_seed(params.seed, i)))
        sequence.group_id, sequence.index = request_id, i
        sequences.append(sequence)
    first = sequences[0]
    first.forks = sequences[1:]
    for sequence in first.forks:
        sequence.fork_of = first
    return first


def group_members(request: Request) -> list[Request]:
    """The request and the sequences still waiting to fork from it."""
    return [request, *request.forks]


def ungroup(request: Request) -> list[Request]:
    """Undo the waiting forks: every sequence becomes a request of its own (computes its own prompt)."""
    members = group_members(request)
    for sequence in members:
        sequence.forks, sequence.fork_of = [], None
    return members
