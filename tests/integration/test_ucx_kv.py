"""The UCX transport between two processes on one host (UCX over shared memory); skipped without ucxx."""
import asyncio
import itertools
import json
import os
import subprocess
import sys

import pytest
import torch

from epdserve.transport.kv.transfer import (
    BlockRangeError, BlocksNotFoundError, EmbeddingNotFoundError, IncompatiblePeerError, IntegrityError,
    StaleHandleError, TransferError, TransferTimeout,
)

from epdserve.transport import transports

try:
    from epdserve.transport.ucx import path as ucx_path

    ucx_path.import_ucxx()
except ImportError:
    pytest.skip("ucxx is not installed (the 'ucx' extra)", allow_module_level=True)

SHAPE = (3, 2, 48, 4, 2, 8)  # [layers, 2, blocks, block_size, kv_heads, head_size]

SERVER = """
import asyncio, json, sys, torch
from epdserve.transport.kv.server import KVTransferServer
from epdserve.transport.ucx.path import UcxServerPath

class StallingPath(UcxServerPath):
    # For the dead-peer tests: answers the first message of request "stall", then never again; answers
    # every message of request "hold" but never sends its data. For the integrity tests: flips a byte of
    # what it sends of request "corrupt" and of embeddings "ee..." after their checksums were taken.
    stalled = 0
    corrupt_next = False
    async def reply_blocks(self, message, peer):
        if message.request_id == "stall":
            StallingPath.stalled += 1
            if StallingPath.stalled > 1:
                await asyncio.sleep(3600)
        return await super().reply_blocks(message, peer)

    async def reply_embeddings(self, message, peer, tensor):
        self.corrupt_next = message.mm_hash == "ee" * 32
        return await super().reply_embeddings(message, peer, tensor)

    async def _send_later(self, peer, buffers, tag, request_id):
        if request_id == "hold":
            print("held", flush=True)
            return
        if request_id == "corrupt" or (request_id is None and self.corrupt_next):
            buffers = [b.copy() for b in buffers]  # the cache itself stays intact
            buffers[-1][-1] ^= 0x10
        await super()._send_later(peer, buffers, tag, request_id)

async def main():
    shape, dtype = json.loads(sys.argv[1]), getattr(torch, sys.argv[2])
    cache = torch.randn(shape, generator=torch.Generator().manual_seed(7)).to(dtype)
    embeddings = {h: torch.randn(9, 16, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
                  for h in ("ab" * 32, "ee" * 32)}
    server = KVTransferServer("prefill-ucx", [StallingPath()], kv_cache=cache, model_id="m", encoder_cache=embeddings)
    address = await server.start()
    generations = {rid: server.expose(rid, range(shape[2])) for rid in ("r1", "stall", "hold", "corrupt", "old")}
    server.withdraw("old")
    server.expose("old", range(shape[2]))  # a new generation: handles to the first are stale
    print(json.dumps([address, generations]), flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""
GENERATIONS: dict[str, dict[str, int]] = {}  # server address -> request id -> generation it exposes


def start_server(dtype: str, env=None):
    proc = subprocess.Popen([sys.executable, "-c", SERVER, json.dumps(SHAPE), dtype],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    address, GENERATIONS[address] = json.loads(proc.stdout.readline())
    return proc, address


def fetch(c, address: str, request_id: str, remote_ids, local_ids, **kwargs):
    """c.fetch_blocks with the generation the server gave the request's blocks (0 if it exposes none)."""
    generation = GENERATIONS.get(address, {}).get(request_id, 0)
    return c.fetch_blocks(address, request_id, remote_ids, local_ids, generation=generation, **kwargs)


@pytest.fixture(scope="module")
def server():
    proc, address = start_server("bfloat16")
    yield address
    proc.kill()
    proc.wait()


def expected_cache(dtype=torch.bfloat16) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(7)).to(dtype)


def client(local_cache, **kwargs):
    return transports.create_client("ucx", "decode-ucx", kv_cache=local_cache, model_id=kwargs.pop("model_id", "m"),
                                    timeout=kwargs.pop("timeout", 10), **kwargs)


def test_blocks_over_ucx_land_bit_exact_in_shuffled_blocks(server):
    local_cache = torch.zeros(SHAPE, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(3)
    remote_ids = torch.randperm(SHAPE[2], generator=gen)[:30].tolist()
    local_ids = torch.randperm(SHAPE[2], generator=gen)[:30].tolist()

    async def main():
        async with client(local_cache, max_message_bytes=2048, min_message_bytes=1) as c:  # several messages
            result = await fetch(c, server, "r1", remote_ids, local_ids)
            assert result.num_bytes == local_cache[:, :, local_ids].nbytes and c.stats.num_failures == 0

    asyncio.run(main())
    want = expected_cache()[:, :, remote_ids]
    assert torch.equal(local_cache[:, :, local_ids].view(torch.int16), want.view(torch.int16))


def test_embeddings_over_ucx(server):
    async def main():
        async with client(torch.zeros(SHAPE, dtype=torch.bfloat16)) as c:
            got = await c.fetch_embeddings(server, "ab" * 32)
            want = torch.randn(9, 16, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16))
            with pytest.raises(EmbeddingNotFoundError):
                await c.fetch_embeddings(server, "00" * 32)

    asyncio.run(main())


def test_ucx_bounds_and_layout_checks(server):
    async def main():
        async with client(torch.zeros(SHAPE, dtype=torch.bfloat16)) as c:
            with pytest.raises(BlockRangeError):
                await fetch(c, server, "r1", [SHAPE[2]], [0])
            with pytest.raises(BlocksNotFoundError):
                await fetch(c, server, "nope", [1], [0])
        async with client(torch.zeros(SHAPE, dtype=torch.float32)) as c:
            with pytest.raises(IncompatiblePeerError, match="dtype"):
                await fetch(c, server, "r1", [1], [0])
        async with client(torch.zeros(SHAPE, dtype=torch.bfloat16), model_id="other") as c:
            with pytest.raises(IncompatiblePeerError, match="model_id"):
                await fetch(c, server, "r1", [1], [0])

    asyncio.run(main())


def test_ucx_refuses_a_zmq_peer_with_a_clear_error(server):
    async def main():
        async with transports.create_client("zmq", "decode-zmq", kv_cache=torch.zeros(SHAPE, dtype=torch.bfloat16), model_id="m") as c:
            with pytest.raises(IncompatiblePeerError, match="over ucx, decode-zmq over zmq.*same --kv-transport"):
                await fetch(c, server, "r1", [1], [0])

    asyncio.run(main())


def test_contiguous_runs_land_bit_exact_over_ucx(server):
    local_cache = torch.zeros(SHAPE, dtype=torch.bfloat16)
    remote_ids, local_ids = list(range(4, 40)), list(range(10, 46))

    async def main():
        async with client(local_cache, max_message_bytes=5 * local_cache[:, :, 0].nbytes, min_message_bytes=1,
                          min_segment_bytes=1) as c:
            await fetch(c, server, "r1", remote_ids, local_ids)

    asyncio.run(main())
    want = expected_cache()[:, :, remote_ids]
    assert torch.equal(local_cache[:, :, local_ids].view(torch.int16), want.view(torch.int16))
    assert not local_cache[:, :, :10].any() and not local_cache[:, :, 46:].any()


def test_a_client_lets_go_of_a_server_it_no_longer_fetches_from(server):
    # Servers come and go: the control connection and the UCX endpoint to one unused for a while close.
    local_cache = torch.zeros(SHAPE, dtype=torch.bfloat16)

    async def main():
        async with client(local_cache, peer_idle_seconds=0.3) as c:
            await fetch(c, server, "r1", [1, 2], [3, 4])
            assert len(c._controls) == 1 and len(c.paths[0]._endpoints) == 1
            await asyncio.sleep(0.8)
            assert len(c._controls) == 0 and len(c.paths[0]._endpoints) == 0
            await fetch(c, server, "r1", [5, 6], [7, 8])  # a new connection and endpoint
            assert c.stats.num_failures == 0

    asyncio.run(main())
    want = expected_cache()
    assert torch.equal(local_cache[:, :, [3, 4, 7, 8]].view(torch.int16), want[:, :, [1, 2, 5, 6]].view(torch.int16))


def test_ucx_peer_dying_mid_transfer_fails_the_fetch():
    proc, address = start_server("bfloat16")
    local_cache = torch.zeros(SHAPE, dtype=torch.bfloat16)
    try:
        async def main():
            async with client(local_cache, timeout=4, max_message_bytes=1, min_message_bytes=1,
                              max_inflight_messages=1) as c:
                pull = asyncio.create_task(fetch(c, address, "stall", list(range(8)), list(range(8))))
                for _ in range(200):
                    await asyncio.sleep(0.02)
                    if local_cache[:, :, 0].any():
                        break
                assert local_cache[:, :, 0].any() and not pull.done()
                proc.kill()
                # A timeout, or sooner the control connection's drop.
                with pytest.raises(TransferError):
                    await pull

        asyncio.run(main())
    finally:
        proc.kill()
        proc.wait()


def test_a_sender_dying_with_its_data_in_flight_fails_the_fetch_at_once():
    """The server answers the fetch, then dies before its data arrives. Over shared memory UCX never
    notices; the client's control connection does, long before the fetch's deadline."""
    proc, address = start_server("bfloat16")
    try:
        async def main():
            async with client(torch.zeros(SHAPE, dtype=torch.bfloat16), timeout=120) as c:
                pull = asyncio.create_task(fetch(c, address, "hold", list(range(8)), list(range(8))))
                held = await asyncio.get_running_loop().run_in_executor(None, proc.stdout.readline)
                assert held.strip() == "held"
                await asyncio.sleep(0.5)  # BlocksSent reaches the client; its receives wait
                assert not pull.done()
                proc.kill()
                with pytest.raises(TransferError, match="control connection dropped") as failed:
                    await pull
                assert not isinstance(failed.value, TransferTimeout)

        asyncio.run(main())
    finally:
        proc.kill()
        proc.wait()


def test_peers_on_one_host_move_blocks_through_shared_memory():
    """UCX's own protocol table (UCX_PROTO_INFO) shows which transport carries tagged messages
    between the two processes: posix shared memory, not TCP on loopback."""
    proc, address = start_server("bfloat16", env=dict(os.environ, UCX_PROTO_INFO="y"))  # UCX logs to stdout
    local_cache = torch.zeros(SHAPE, dtype=torch.bfloat16)
    try:
        async def main():
            async with client(local_cache) as c:
                await fetch(c, address, "r1", list(range(16)), list(range(16)))

        asyncio.run(main())
    finally:
        proc.kill()
        log, _ = proc.communicate()
    assert torch.equal(local_cache[:, :, :16].view(torch.int16), expected_cache()[:, :, :16].view(torch.int16))
    table = log.split("intra-node cfg#0 | tagged message by ucp_tag_send* from host memory", 1)
    assert len(table) == 2, log[-2000:]
    lines = table[1].splitlines()[2:]  # the rest of the header line, then the rule under it
    rows = "\n".join(itertools.takewhile(lambda line: "+--" not in line, lines))
    assert "posix/memory" in rows and "tcp" not in rows, rows


@pytest.mark.parametrize("min_segment_bytes", [1, 1 << 20], ids=["as_runs", "gathered"])
def test_a_byte_flipped_after_its_checksum_is_caught_over_ucx(server, min_segment_bytes):
    """The server flips a bit of what it sends of request "corrupt" and of embeddings "ee..." after taking their
    checksums (its cache stays intact): the client refuses what landed; the next fetch lands intact."""
    local_cache = torch.zeros(SHAPE, dtype=torch.bfloat16)

    async def main():
        async with client(local_cache, min_segment_bytes=min_segment_bytes) as c:
            with pytest.raises(IntegrityError, match="landed corrupted"):
                await fetch(c, server, "corrupt", list(range(4, 12)), list(range(4, 12)))
            with pytest.raises(IntegrityError, match="embeddings eeee"):
                await c.fetch_embeddings(server, "ee" * 32)
            assert c.stats.num_failures == 2
            await fetch(c, server, "r1", list(range(4, 12)), list(range(4, 12)))

    asyncio.run(main())
    want = expected_cache()[:, :, 4:12]
    assert torch.equal(local_cache[:, :, 4:12].view(torch.int16), want.view(torch.int16))


def test_a_stale_generation_is_refused_over_ucx(server):
    """"old" was exposed, withdrawn and exposed again: a handle to its first exposure is refused."""
    async def main():
        async with client(torch.zeros(SHAPE, dtype=torch.bfloat16)) as c:
            with pytest.raises(StaleHandleError, match="released"):
                await fetch(c, server, "old", [1], [0])

    asyncio.run(main())


def test_a_fetch_waiting_to_start_its_send_keeps_its_blocks_from_being_freed():
    """Between a fetch's check and the start of its send, a UCX path waits (for an endpoint, a send slot): the
    fetch counts as sending from its check on, so blocks withdrawn in that wait are not freed before the send
    that follows has read them."""
    from epdserve.transport.kv.server import KVTransferServer
    from epdserve.transport.channel.protocol import FetchBlocks

    async def main():
        gate, started = asyncio.Event(), []

        class SlowToStart(ucx_path.UcxServerPath):
            async def _send_later(self, peer, buffers, tag, request_id):
                await gate.wait()  # no send slot free yet
                started.append(request_id)  # the send reads the blocks from here on (done at once, here)

        path = SlowToStart()
        server = KVTransferServer("prefill-ucx", [path], kv_cache=expected_cache(), model_id="m")
        gen = server.expose("r1", range(4))
        reply = asyncio.create_task(path.reply_blocks(FetchBlocks("r1", gen, (0, 1, 2, 3), (4,), 1 << 24), None))
        await asyncio.sleep(0.05)
        assert path.sending("r1") and not reply.done()
        server.withdraw("r1")  # decode released it, or its lease ran out
        freed = asyncio.create_task(server.wait_sent("r1"))
        await asyncio.sleep(0.05)
        assert not freed.done(), "the blocks would be freed under the send about to start"
        gate.set()
        answer, _ = await reply
        assert await freed and started == ["r1"] and answer.num_segments == 2 * SHAPE[0]

    asyncio.run(main())
