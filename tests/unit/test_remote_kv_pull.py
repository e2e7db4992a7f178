"""Decode's handoff from prefill as a state machine, on fakes: which path each failure takes, that prefill
is released exactly once on every path, and that a failure after the KV is in place is never recomputed."""
import asyncio
import collections
import time
from types import SimpleNamespace

import pytest

from epdserve.services.decode.remote_kv_pull import PullState, RemoteKVPull
from epdserve.services.request_spans import RequestSpans
from epdserve.transport.protocol import DecodeRequest, KVHandle, WireSamplingParams
from epdserve.shared.engine.scheduler import RemoteKVReservation
from epdserve.transport.kv_transfer import FetchResult, TransferError


class Counter:
    def __init__(self) -> None:
        self.value = 0
        self.observed = []

    def inc(self, amount=1) -> None:
        self.value += amount

    def observe(self, value) -> None:
        self.observed.append(value)


class FakeLLM:
    """generate_prefilled as AsyncLLM runs it: reserve (or time out), fill, then the decoded outputs."""

    def __init__(self, reserve_error=None, decode_error=None) -> None:
        self.reserve_error, self.decode_error = reserve_error, decode_error
        self.recomputed = []

    async def generate_prefilled(self, request, first_token, fill_kv, wait_timeout):
        if self.reserve_error:
            raise self.reserve_error
        await fill_kv(RemoteKVReservation(16, 1, [40, 41]))
        yield "decoded-1"
        if self.decode_error:
            raise self.decode_error
        yield "decoded-2"

    async def make_request(self, prompt, params, request_id, **kwargs):
        return SimpleNamespace(request_id=request_id, prompt=prompt)

    async def generate_recomputed(self, request, first_token):
        self.recomputed.append((request.prompt["prompt_token_ids"], first_token))
        yield "recomputed-1"


class FakeKVClient:
    def __init__(self, error=None) -> None:
        self.error = error
        self.fetched = []

    async def fetch_blocks(self, kv_addr, request_id, remote, local, timeout):
        self.fetched.append((remote, local))
        if self.error:
            raise self.error
        return FetchResult(num_bytes=100, seconds=0.01, connect_seconds=0.002)


def make_pull(llm, kv_client, control_addr="tcp://127.0.0.1:7"):
    metrics = collections.defaultdict(Counter)
    worker = SimpleNamespace(llm=llm, kv_client=kv_client, releases=[],
                             service=SimpleNamespace(transport=SimpleNamespace(transfer_timeout=5, rpc_timeout=5)))
    worker.metrics = SimpleNamespace(**{name: metrics[name] for name in (
        "local_kv_hit_blocks", "transfer_bytes", "transfer_seconds", "remote_kv_blocks", "remote_kv_requests",
        "transfer_failures", "local_prefills", "lease_renewals", "request_transfer_bytes",
        "request_transfer_seconds")})
    worker.release_soon = lambda addr, rid: worker.releases.append((addr, rid))
    # The lease is far from its end: no renewal is due while these tests run.
    handle = KVHandle("prefill-0", "tcp://127.0.0.1:8", (3, 4, 5), 40, lease_deadline=1e12,
                      control_addr=control_addr)
    message = DecodeRequest("r1", tuple(range(40)), 9, handle, WireSamplingParams(), reply_to="tcp://127.0.0.1:9")
    request = SimpleNamespace(request_id="r1", sampling_params=None, mm_placeholders=(), mm_embeddings=None,
                              arrival_time=time.monotonic())
    return RemoteKVPull(worker, message, request, RequestSpans("decode-0")), worker


def run(pull):
    async def main():
        outs = [out async for out in pull.outputs()]
        await asyncio.sleep(0)  # the cancelled renewal finishes
        return outs, pull._renewal

    return asyncio.run(main())


def test_a_pull_fetches_only_what_is_missing_then_releases_and_decodes():
    kv = FakeKVClient()
    pull, worker = make_pull(FakeLLM(), kv)
    outs, renewal = run(pull)
    assert outs == ["decoded-1", "decoded-2"] and pull.state is PullState.CLOSED
    assert kv.fetched == [([4, 5], [40, 41])]  # block 0 was a local prefix hit
    assert worker.releases == [("tcp://127.0.0.1:7", "r1")] and renewal.cancelled()
    m = worker.metrics
    assert (m.local_kv_hit_blocks.value, m.remote_kv_blocks.value, m.remote_kv_requests.value) == (1, 2, 1)
    assert m.local_prefills.value == 0
    assert m.request_transfer_bytes.observed == [100] and m.request_transfer_seconds.observed == [0.01]
    spans = pull.spans.take()
    assert [s.name for s in spans] == ["decode.queue", "kv.handshake", "kv.transfer", "decode.first_step"]
    handshake, transfer = spans[1], spans[2]
    assert (transfer.num_bytes, transfer.num_blocks, transfer.engine_id) == (100, 2, "decode-0")
    assert handshake.start == transfer.start and handshake.end - handshake.start == pytest.approx(0.002, abs=1e-5)
    stages = [span for span in spans if span is not handshake]  # the handshake is part of the transfer
    assert all(a.end <= b.start + 1e-3 and a.start <= a.end for a, b in zip(stages, stages[1:]))


@pytest.mark.parametrize("llm, kv, failed_while", [
    (FakeLLM(reserve_error=TimeoutError("no room")), FakeKVClient(), PullState.RESERVING),
    (FakeLLM(), FakeKVClient(error=TransferError("prefill gone")), PullState.FETCHING),
])
def test_a_failed_pull_releases_prefill_once_and_recomputes(llm, kv, failed_while, caplog):
    pull, worker = make_pull(llm, kv)
    outs, renewal = run(pull)
    assert outs == ["recomputed-1"] and llm.recomputed == [(list(range(40)), [9])]
    assert worker.releases == [("tcp://127.0.0.1:7", "r1")] and renewal.cancelled()
    assert worker.metrics.local_prefills.value == 1 and worker.metrics.remote_kv_requests.value == 0
    assert worker.metrics.transfer_failures.value == (failed_while is PullState.FETCHING)
    assert f"failed while {failed_while.value}" in caplog.text
    names = [s.name for s in pull.spans.take()]
    if failed_while is PullState.FETCHING:
        assert names == ["decode.queue", "kv.transfer:failed", "kv.recompute:transfer"]
    else:
        assert names == ["decode.queue", "kv.recompute:no_room"]
    assert not worker.metrics.request_transfer_bytes.observed  # only pulls that brought KV are observed


def test_a_failure_once_the_kv_is_in_place_is_the_requests_not_a_recompute():
    llm = FakeLLM(decode_error=TimeoutError("something else"))
    pull, worker = make_pull(llm, FakeKVClient())

    async def main():
        outs = []
        with pytest.raises(TimeoutError):
            async for out in pull.outputs():
                outs.append(out)
        return outs

    assert asyncio.run(main()) == ["decoded-1"]
    assert not llm.recomputed and pull.state is PullState.CLOSED and len(worker.releases) == 1


def test_an_abandoned_stream_releases_prefill():
    pull, worker = make_pull(FakeLLM(reserve_error=asyncio.CancelledError()), FakeKVClient())
    with pytest.raises(asyncio.CancelledError):
        run(pull)
    assert worker.releases == [("tcp://127.0.0.1:7", "r1")] and pull.state is PullState.CLOSED


def test_without_a_control_address_only_the_lease_frees_the_blocks():
    pull, worker = make_pull(FakeLLM(), FakeKVClient(), control_addr="")
    outs, renewal = run(pull)
    assert outs == ["decoded-1", "decoded-2"] and renewal is None and not worker.releases
