"""Continuous batching: which requests compute how many tokens in the next step.

Each step has a token budget (`max_num_batched_tokens`), spent by its policy (step_budget.py): running
requests go first, in arrival order, then waiting ones; under "shared" (the default, vLLM V1's) decodes and
prefill chunks share it; under "prompts" the budget bounds prompt tokens, each running request's next token
coming on top, and prompts are packed whole. When the pool runs out of blocks,
the most recently started running request is preempted: its blocks are freed (its full blocks stay in
the prefix cache, so the recompute is mostly hits) and it goes back to the front of the queue.

A request with n > 1 is a group of sequences (parallel_sampling.py): the first is scheduled, the others
wait on it and fork from it - sharing its blocks - in the step that completes its prompt.

Seats (`max_num_seqs`) are shared fairly: while other requests wait for one, no request's sequences hold
more than half of them. A group's sequences beyond that are parked - their KV kept, their next token not
computed - and take turns as the group's running ones finish; once nobody waits, parked sequences take
the free seats again. So one request with n = 128 on a 128-seat engine does not keep every other request
out until it ends: the next request is seated in the next step.
"""
from __future__ import annotations

import collections
import time
from collections import deque
from typing import Callable, Iterable, NamedTuple, Sequence

from epdserve.shared.engine.block_manager import BlockManager
from epdserve.shared.config import SchedulerConfig
from epdserve.shared.engine.kv_connector import KVLoad, LoadResult
from epdserve.shared.engine.kv_loads import Admission, KVLoads
from epdserve.shared.engine.parallel_sampling import group_members, ungroup
from epdserve.shared.engine.prompt_stats import PromptStats
from epdserve.shared.engine.request import Request, RequestFailure, RequestStatus
from epdserve.shared.engine.draft_policy import DraftPolicy
from epdserve.shared.engine.speculative import SpecDecodeStats
from epdserve.shared.engine.step_budget import StepBudget


class ScheduledRequest(NamedTuple):
    request: Request
    num_new_tokens: int


class SchedulerOutput(NamedTuple):
    scheduled: list[ScheduledRequest]
    num_batched_tokens: int
    preempted: list[Request]
    new_block_ids: list[int]  # blocks allocated fresh this step (to be zeroed before use)
    block_copies: Sequence[tuple[int, int]] = ()  # (source, destination): copy-on-write, before the forward pass
    # Left the queue: they must compute positions whose encoder outputs no connector can supply (the engine
    # fails them).
    unservable: Sequence[Request] = ()


class Scheduler:
    """Owns the waiting queue, the running list, and requests whose KV is held or being fetched."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Sequences of a group that hold their KV but no seat, in the order they left their seat.
        self.parked: deque[Request] = deque()
        self.requests: dict[str, Request] = {}
        # Group id -> its sequences' ids, for requests with n > 1 (aborts and releases name the group).
        self.groups: dict[str, list[str]] = {}
        # Finished requests whose blocks a KV connector keeps, until `release_kv`.
        self.held: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_finished: dict[str, int] = {"stop": 0, "length": 0, "abort": 0, "error": 0}  # by finish reason
        self.loads = KVLoads(block_manager)  # the KV connectors, and the requests they are loading
        self.spec_stats = SpecDecodeStats()  # draft tokens verified and accepted (speculative decoding)
        self.draft_policy = DraftPolicy()  # which drafts are worth a step's rows
        self.prompt_stats = PromptStats()  # where the prompts came from: pool, tiers, computed (once per request)

    def add_request(self, request: Request) -> None:
        self._admit(request)
        self.waiting.append(request)

    def _admit(self, request: Request) -> None:
        members = group_members(request)
        if any(r.request_id in self.requests or r.request_id in self.held for r in members) or \
                (request.index == 0 and request.group_id in self.groups):
            raise ValueError(f"request id {request.group_id!r} is already in use")
        if len(members) > self.config.max_num_seqs:
            raise ValueError(f"n ({len(members)}) must not exceed the engine's max_num_seqs "
                             f"({self.config.max_num_seqs})")
        # A request that could not fit even alone would be preempted forever.
        needed = self.block_manager.num_blocks_for(request.num_prompt_tokens + request.max_output_tokens)
        if needed > self.block_manager.num_blocks:
            raise ValueError(
                f"request needs {needed} KV blocks (prompt {request.num_prompt_tokens} + up to "
                f"{request.max_output_tokens} new tokens) but the cache has {self.block_manager.num_blocks}")
        for member in members:
            self.requests[member.request_id] = member
            if member.group_id != member.request_id:  # (sequences that recompute alone are added one by one)
                self.groups.setdefault(member.group_id, []).append(member.request_id)

    def member_ids(self, request_id: str) -> list[str]:
        """The engine ids a caller's request id stands for: a group's sequences, or the id itself."""
        return self.groups.get(request_id, [request_id])

    def _forget_group(self, request: Request, loading: bool = False) -> None:
        """Drop the group of `request` once none of its sequences is left; then (or for a request of its
        own) the connectors forget it too - unless its load still runs (finish_load tells them then)."""
        ids = self.groups.get(request.group_id)
        if ids is not None and not any(i in self.requests or i in self.held for i in ids):
            del self.groups[request.group_id]
        if request.group_id not in self.groups and not loading:
            self.loads.ended(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    @property
    def has_work(self) -> bool:
        """Whether a step would compute anything (requests waiting for their KV are in no queue)."""
        return bool(self.waiting or self.running or self.parked)

    @property
    def num_queued_prompt_tokens(self) -> int:
        """Prompt tokens still to compute before a request arriving now would start: those of the waiting
        requests and of running ones part-way through their prompt."""
        return sum(r.num_tokens - r.num_computed_tokens for r in self.waiting) + \
            sum(r.num_prompt_tokens - r.num_computed_tokens for r in self.running
                if r.num_computed_tokens < r.num_prompt_tokens)

    @property
    def num_running(self) -> int:
        """Sequences started and not finished: seated or parked."""
        return len(self.running) + len(self.parked)

    def schedule(self) -> SchedulerOutput:
        budget = StepBudget(self.config)
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        bm = self.block_manager
        self._share_seats()

        i = 0
        while i < len(self.running) and budget.serves_running:
            request = self.running[i]
            remaining = request.num_tokens - request.num_computed_tokens
            num_own = budget.own_tokens(remaining)
            if not num_own:  # a prefill chunk with no budget left; the decodes after it still run
                i += 1
                continue
            # Draft tokens ride along where the budget has room for all the request's own tokens.
            request.spec_token_ids = request.spec_token_ids[:budget.draft_room(num_own, remaining)]
            num_new = num_own + len(request.spec_token_ids)
            while not bm.can_allocate(request, num_new):
                if request.spec_token_ids:  # drafts give way before anybody is preempted
                    num_new -= len(request.spec_token_ids)
                    request.spec_token_ids = []
                    continue
                # Parked sequences compute nothing now: their blocks go first.
                victim = self.parked.pop() if self.parked else self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            else:
                bm.allocate(request, num_new)
                scheduled.append(ScheduledRequest(request, num_new))
                budget.take_running(num_own, remaining, len(request.spec_token_ids))
                i += 1
                continue
            break

        # New requests join only in a step that preempted nobody: the pool is tight otherwise. A group needs
        # one seat to compute its prompt; its other sequences are seated (or parked) when they fork. A
        # request a KV connector can feed leaves the queue for its load instead, seatless.
        unservable: list[Request] = []
        while self.waiting and budget.left > 0 and not preempted and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            computed_blocks, num_cached = bm.get_computed_blocks(request)
            admission = self.loads.try_start(request, computed_blocks, num_cached)
            if admission is Admission.NO_ROOM:
                break
            if admission is not Admission.NONE:
                self.waiting.popleft()
                if admission is Admission.STARTED:
                    request.status = RequestStatus.WAITING_FOR_KV
                else:
                    unservable.append(request)
                continue
            num_new = budget.prompt_chunk(request.num_tokens - num_cached)
            if not num_new or not bm.can_allocate(request, num_new, computed_blocks):
                break
            bm.allocate(request, num_new, computed_blocks)
            self.waiting.popleft()
            request.num_computed_tokens = num_cached
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
            self.prompt_stats.count(request, num_cached, 0, self.loads.has_tier)
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(ScheduledRequest(request, num_new))
            budget.take_prompt(num_new)

        return SchedulerOutput(scheduled, sum(item.num_new_tokens for item in scheduled), preempted,
                               bm.take_new_block_ids(), bm.take_block_copies(), unservable)

    def _share_seats(self) -> None:
        """Park the sequences a group holds beyond its share while others wait for a seat; seat parked
        sequences again where their group is within its share and a seat is free (one kept for the
        queue's head while it waits)."""
        waiting = bool(self.waiting)
        seats = self.config.max_num_seqs
        share = max(1, seats // 2) if waiting else seats
        held = collections.Counter(r.group_id for r in self.running if r.group_id != r.request_id)
        if waiting and len(self.running) >= seats:
            for request in reversed(self.running[:]):
                if held[request.group_id] > share and request.group_id != request.request_id:
                    self.running.remove(request)
                    self.parked.append(request)
                    held[request.group_id] -= 1
        free = seats - len(self.running) - waiting
        for request in list(self.parked):
            if free <= 0:
                break
            if held[request.group_id] < share:
                self.parked.remove(request)
                self.running.append(request)
                held[request.group_id] += 1
                free -= 1

    def _preempt(self, request: Request) -> None:
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def update_from_output(self, output: SchedulerOutput, sampled_token_ids: dict[str, list[int]],
                           on_token: Callable[[Request, int], None] | None = None) -> list[Request]:
        """Advance counters after a step; append the sampled tokens; return the requests that got tokens.

        A request whose step verified draft tokens (speculative.py) gets the drafts that were accepted and the
        token sampled after them, one at a time, each checked for the stops as if it had been a step of its own;
        `on_token(request, i)` follows each one (i: its index among the step's tokens of the request) and may end
        the request (a stop string), which then gets no more of them."""
        with_new_token: list[Request] = []
        for request, num_new in output.scheduled:
            if request.is_finished:  # aborted while the step ran
                continue
            # Draft tokens are what the step computed past the request's own tokens (as the model runner reads it).
            num_drafts = max(request.num_computed_tokens + num_new - request.num_tokens, 0)
            drafts, request.spec_token_ids = request.spec_token_ids[:num_drafts], []
            request.num_computed_tokens += num_new - num_drafts
            self.block_manager.cache_full_blocks(request)
            if request.num_computed_tokens < request.num_tokens:
                continue  # a prefill chunk that did not reach the end yet
            # The waiting sequences of its group were sampled from the same logits (the model runner).
            for sequence in [request, *self._fork(request)]:
                token_ids = sampled_token_ids[sequence.request_id]
                if drafts and sequence is request:
                    self._accept_drafts(request, drafts, token_ids)
                self._append(sequence, token_ids, on_token)
                with_new_token.append(sequence)
        return with_new_token

    def _accept_drafts(self, request: Request, drafts: list[int], token_ids: list[int]) -> None:
        """The drafts that match the sampled tokens were computed with the right tokens: their KV is the
        request's. The others' slots are written over later; blocks that hold nothing else go back now."""
        num_accepted = 0
        while num_accepted < min(len(drafts), len(token_ids)) and drafts[num_accepted] == token_ids[num_accepted]:
            num_accepted += 1
        # Never past the last token's position: a run cut short of its bonus token computes it again.
        request.num_computed_tokens = min(request.num_computed_tokens + num_accepted,
                                          request.num_tokens + len(token_ids) - 1)
        self.block_manager.trim(request)
        self.spec_stats.observe(len(drafts), num_accepted)
        self.draft_policy.observe_verification(request, len(drafts), num_accepted)

    def _append(self, sequence: Request, token_ids: list[int], on_token) -> None:
        for i, token_id in enumerate(token_ids):
            sequence.append_output_token(token_id)
            self.block_manager.cache_full_blocks(sequence)
            if sequence.check_stop():
                self._remove(sequence)
            if on_token is not None:
                on_token(sequence, i)
            if sequence.is_finished:
                return

    def _fork(self, request: Request) -> list[Request]:
        """The sequences waiting on `request`, which has just computed its prompt, now share its blocks and
        run - those without a free seat parked until `_share_seats` seats them; returned in index order."""
        forked, request.forks = request.forks, []
        for sequence in forked:
            self.block_manager.fork(request, sequence)
            sequence.fork_of = None
            sequence.num_computed_tokens = request.num_computed_tokens
            sequence.num_cached_tokens = request.num_cached_tokens
            sequence.first_scheduled_time = request.first_scheduled_time
            sequence.status = RequestStatus.RUNNING
            seated = len(self.running) < self.config.max_num_seqs
            (self.running if seated else self.parked).append(sequence)
        return forked

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """End requests from outside (abort, stop string); frees everything they hold."""
        finished = []
        for request_id in [i for rid in request_ids for i in self.member_ids(rid)]:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            request.status = status
            self._remove(request)
            finished.append(request)
        return finished

    def _remove(self, request: Request) -> None:
        assert request.is_finished
        if request.request_id in self.loads.loading:  # its blocks are being written: freed when the load ends
            del self.requests[request.request_id]
            self.num_finished[request.status.finish_reason] += 1
            self._forget_group(request, loading=True)
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        elif request in self.parked:
            self.parked.remove(request)
        if request.fork_of is not None:  # ended while waiting to fork
            request.fork_of.forks.remove(request)
            request.fork_of = None
        if request.forks:  # ended before computing the prompt: the next sequence computes it instead
            heir, *rest = request.forks
            heir.fork_of, heir.forks, request.forks = None, rest, []
            for sequence in rest:
                sequence.fork_of = heir
            self.waiting.appendleft(heir)
        del self.requests[request.request_id]
        self.num_finished[request.status.finish_reason] += 1
        # Only a request that ran to its end may keep its KV (for a peer, a tier); an aborted or failed one frees it.
        if request.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH) \
                and self.loads.keeps(request):
            request.kv_held = True
            self.held[request.request_id] = request
        else:
            self.block_manager.free(request)
        self._forget_group(request)

    def finish_at_peer_token(self, request: Request) -> None:
        """A sequence just added ended at the first token a peer sampled for it (check_stop said so)."""
        self._remove(request)

    def release_kv(self, request_id: str) -> bool:
        """Free a finished request's held blocks (a group's: all its sequences'); False if it holds none
        (already released, or unknown)."""
        released = False
        for member_id in self.member_ids(request_id):
            request = self.held.pop(member_id, None)
            if request is not None:
                self.block_manager.free(request)
                self._forget_group(request)
                released = True
        return released

    # -- the end of a load (kv_connector.py) ---------------------------------------------------------
    def finish_load(self, result: LoadResult, hidden_size: int) -> list[Request]:
        """A connector's load ended. KV: on success the request (and the sequences of its group, forked from
        its blocks) runs from the loaded tokens on - seated, or parked for a seat; on failure it frees the
        blocks and computes the tokens itself (a group's sequences each on their own). Encoder outputs: the
        request goes back to the head of the queue with them. Returns the requests this ended (a failed
        encoder output load, malformed ones)."""
        loading = self.loads.take(result.request_id)
        if loading is None:
            return []
        request, load = loading.request, loading.load
        if request.is_finished:  # aborted while loading: its blocks were kept until now
            self.block_manager.free(request)
            if request.group_id not in self.groups:
                self.loads.ended(request)
            return []
        if not load.block_ids and not load.mm_hashes:
            raise AssertionError("a load of nothing")
        if load.mm_hashes:
            return self._embeddings_loaded(request, load, result, hidden_size)
        if result.ok:
            request.num_computed_tokens = load.num_tokens
            # Its prompt's tokens not computed here: its prefix-cache hits and what the load brought.
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = load.num_tokens
            local_hits = load.first_block * self.block_manager.block_size
            self.prompt_stats.count(request, local_hits, load.num_tokens - local_hits, self.loads.has_tier)
            self.block_manager.cache_full_blocks(request)
            self._start_running(request)
            return []
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        members = ungroup(request)
        for sequence in members[1:]:  # each computes its prompt now: the request is counted once, by the first
            sequence.prompt_counted = True
        for member in reversed(members):
            self.waiting.appendleft(member)
        return []

    def _embeddings_loaded(self, request: Request, load: KVLoad, result: LoadResult, hidden_size: int) -> list[Request]:
        wanted = {ph.mm_hash: ph.length for ph in request.mm_placeholders if ph.mm_hash in load.mm_hashes}
        got = result.mm_embeddings
        if not result.ok or any(tuple(getattr(got.get(h), "shape", ())) != (n, hidden_size) for h, n in wanted.items()):
            request.status = RequestStatus.FINISHED_ERROR
            request.failure = RequestFailure(f"the request's image embeddings could not be had: {result.reason or 'wrong shapes'}",
                                             inputs_unavailable=not result.ok)
            self._remove(request)
            return [request]
        request.mm_embeddings.update({h: got[h] for h in wanted})
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        return []

    def _start_running(self, request: Request) -> None:
        """A request whose prompt KV was loaded: it, and the sequences of its group (each with its own
        first token, sampled where the prompt was computed), run from the end of the prompt on."""
        request.status = RequestStatus.RUNNING
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
        (self.running if len(self.running) < self.config.max_num_seqs else self.parked).append(request)
        self._fork(request)
