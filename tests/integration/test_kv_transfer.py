"""KV blocks and embeddings over the ZMQ transport, on real sockets: exactness, bounds, handshakes, dead peers.

Blocks move over the server's block connections (block_stream) unless it offers none (`block_port=None`,
as with CURVE or a device cache): then as ZMQ frames. Tests of what both paths do run on both."""
import asyncio
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import zmq.auth

from epdserve.transport.channel import protocol as p
from epdserve.transport.kv import transfer as kv_transfer
from epdserve.transport.kv.transfer import (
    BlockRangeError, BlocksNotFoundError, EmbeddingNotFoundError, IncompatiblePeerError, PeerUnreachableError,
    TransferError, TransferTimeout,
)
from epdserve.transport.channel.common import ErrorReply
from epdserve.transport.channel.request_client import RequestClient
from epdserve.transport.channel.security import CurveConfig
from epdserve.transport import transports
from epdserve.transport.block_stream.path import BlockStreamServerPath
from epdserve.transport.kv.client import KVTransferClient
from epdserve.transport.kv.server import KVTransferServer
from epdserve.services.cli.launcher import free_port



def zmq_server(engine_id, **kwargs) -> KVTransferServer:
    return transports.create_server("zmq", engine_id, **kwargs)


def zmq_client(engine_id, **kwargs) -> KVTransferClient:
    return transports.create_client("zmq", engine_id, **kwargs)


def stream_path(server: KVTransferServer) -> BlockStreamServerPath:
    (path,) = [path for path in server.paths if isinstance(path, BlockStreamServerPath)]
    return path


NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE = 3, 48, 4, 2, 8


def make_cache(dtype=torch.float32, seed=0, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    shape = (NUM_LAYERS, 2, num_blocks, block_size, NUM_KV_HEADS, HEAD_SIZE)
    return torch.randn(shape, generator=gen).to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


PATHS = pytest.mark.parametrize("block_port", [0, None], ids=["block_connection", "zmq_frames"])


@PATHS
# float8: a --kv-cache-dtype fp8 pool, its blocks moved as stored.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("message_bytes", [1, 1 << 20], ids=["one_block_per_message", "one_message"])
@pytest.mark.parametrize("min_segment_bytes", [1, 1 << 20], ids=["as_runs", "gathered"])
def test_blocks_land_bit_exact_in_shuffled_local_blocks(dtype, message_bytes, min_segment_bytes, block_port):
    remote_cache, local_cache = make_cache(dtype, seed=1), torch.zeros(make_cache(dtype).shape, dtype=dtype)
    gen = torch.Generator().manual_seed(2)
    remote_ids = torch.randperm(NUM_BLOCKS, generator=gen)[:20].tolist()
    local_ids = torch.randperm(NUM_BLOCKS, generator=gen)[:20].tolist()
    untouched = sorted(set(range(NUM_BLOCKS)) - set(local_ids))

    async def main():
        async with zmq_server("prefill-0", kv_cache=remote_cache, model_id="m", block_port=block_port) as server:
            gen = server.expose("r1", remote_ids)
            async with zmq_client("decode-0", kv_cache=local_cache, model_id="m",
                                   max_message_bytes=message_bytes, min_message_bytes=1,
                                   min_segment_bytes=min_segment_bytes) as client:
                result = await client.fetch_blocks(server.address, "r1", remote_ids, local_ids, generation=gen)
                assert result.num_bytes == remote_cache[:, :, remote_ids].nbytes
                assert client.stats.num_transfers == 1 and client.stats.num_bytes == result.num_bytes
                assert client.stats.num_failures == 0

    asyncio.run(main())
    assert torch.equal(bits(local_cache[:, :, local_ids]), bits(remote_cache[:, :, remote_ids]))
    assert not bits(local_cache[:, :, untouched]).any()  # nothing else written


def test_runs_move_over_the_block_connection_from_cache_to_cache():
    """Blocks consecutive on both sides go as one segment per layer and K/V (cut only at message size),
    sent from the server's cache memory and received into the client's destination blocks themselves;
    blocks in runs too short for that travel gathered. No ZMQ frame carries a block."""
    remote_cache, local_cache = make_cache(seed=4), torch.zeros(make_cache().shape)
    remote_ids, local_ids = list(range(10, 30)) + [2, 3], list(range(5, 25)) + [40, 45]
    block_bytes, segment_bytes = remote_cache[:, :, 0].nbytes, remote_cache[0, 0, 0].nbytes

    async def main():
        async with zmq_server("prefill-0", kv_cache=remote_cache, model_id="m") as server:
            gen = server.expose("r1", remote_ids)
            sent, received, frames = [], [], []
            stream = stream_path(server).stream
            prepare = stream._prepare
            stream._prepare = lambda message: sent.append(prepare(message)) or sent[-1]
            server.control._on_sent = lambda reply, tracker: frames.append(reply)
            async with zmq_client("decode-0", kv_cache=local_cache, model_id="m", min_segment_bytes=2 * segment_bytes,
                                   max_message_bytes=8 * block_bytes, min_message_bytes=8 * block_bytes) as client:
                await client.fetch_blocks(server.address, "r1", [], [], generation=gen)  # connects and handshakes
                (stream_client, _) = client.paths
                fetch = stream_client.stream.fetch
                stream_client.stream.fetch = lambda *args: received.append(args[4]) or fetch(*args)
                await client.fetch_blocks(server.address, "r1", remote_ids, local_ids, generation=gen)
            assert await server.wait_sent("r1")
        assert not frames
        # 10..29 -> 5..24 in messages of 8, 8 and 4 blocks; 2 -> 40 and 3 -> 45 gathered into one segment.
        # Two messages are in flight at once, on two connections: in no fixed order.
        runs_sent = sorted((b for b in sent if len(b) > 1), key=lambda b: b[0].ctypes.data)
        runs_received = sorted((b for b in received if len(b) > 1), key=lambda b: b[0].ctypes.data)
        assert [len(b) for b in runs_sent] == [len(b) for b in runs_received] == [2 * NUM_LAYERS] * 3
        assert [b[0].ctypes.data for b in runs_sent] == [remote_cache[0, 0, i].data_ptr() for i in (10, 18, 26)]
        assert [b[-1].nbytes for b in runs_sent] == [8 * segment_bytes, 8 * segment_bytes, 4 * segment_bytes]
        assert runs_sent[2][-1].ctypes.data == remote_cache[-1, 1, 26].data_ptr()
        # Received into the destination blocks themselves: no staging buffer.
        assert [b[0].ctypes.data for b in runs_received] == [local_cache[0, 0, i].data_ptr() for i in (5, 13, 21)]
        (gathered_sent,), (gathered_received,) = [b for b in sent if len(b) == 1], [b for b in received if len(b) == 1]
        assert gathered_sent[0].nbytes == gathered_received[0].nbytes == 2 * block_bytes

    asyncio.run(main())
    assert torch.equal(local_cache[:, :, local_ids], remote_cache[:, :, remote_ids])


def test_contiguous_runs_move_as_whole_zmq_frames_straight_from_the_cache():
    """Without block connections, blocks consecutive on both sides go as one frame per layer and K/V
    (cut only at message size), and the server's frames are its cache's own memory until ZMQ lets go
    of them; blocks in runs too short for that travel gathered into one frame."""
    remote_cache, local_cache = make_cache(seed=4), torch.zeros(make_cache().shape)
    remote_ids, local_ids = list(range(10, 30)) + [2, 3], list(range(5, 25)) + [40, 45]
    block_bytes, segment_bytes = remote_cache[:, :, 0].nbytes, remote_cache[0, 0, 0].nbytes

    async def main():
        async with zmq_server("prefill-0", kv_cache=remote_cache, model_id="m", block_port=None) as server:
            gen = server.expose("r1", remote_ids)
            sent: list[p.BlocksData] = []
            on_sent = server._on_sent
            server.control._on_sent = lambda reply, tracker: (sent.append(reply), on_sent(reply, tracker))
            async with zmq_client("decode-0", kv_cache=local_cache, model_id="m", min_segment_bytes=2 * segment_bytes,
                                   max_message_bytes=8 * block_bytes, min_message_bytes=8 * block_bytes) as client:
                await client.fetch_blocks(server.address, "r1", remote_ids, local_ids, generation=gen)
            assert await server.wait_sent("r1")
        # Runs (remote -> local): 10..29 -> 5..24 in messages of at most 8 blocks; 2 -> 40 and 3 -> 45 gathered.
        assert [reply.block_ids for reply in sent] == [tuple(range(10, 18)), tuple(range(18, 26)),
                                                       tuple(range(26, 30)), (2, 3)]
        assert [len(reply.segments) for reply in sent] == [2 * NUM_LAYERS] * 3 + [1]
        first = sent[0].segments[0]
        assert first.data_ptr() == remote_cache[0, 0, 10].data_ptr() and first.shape[0] == 8  # no gather
        assert sent[3].segments[0].shape == (NUM_LAYERS, 2, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)

    asyncio.run(main())
    assert torch.equal(local_cache[:, :, local_ids], remote_cache[:, :, remote_ids])


def test_runs_that_are_not_consecutive_are_refused():
    async def main():
        async with zmq_server("prefill-0", kv_cache=make_cache(), model_id="m") as server:
            gen = server.expose("r1", [1, 2, 3, 7])
            async with RequestClient(server.address, engine_id="decode", role=p.Role.DECODE,
                                     kv_layout=server.layout) as client:
                for ids, runs in (((1, 2, 7), (3,)), ((1, 2), (1,)), ((1, 2), (3, -1)), ((1,), (0, 1))):
                    with pytest.raises(ErrorReply, match="out_of_range|consecutive|run lengths"):
                        await client.request(p.FetchBlocks("r1", gen, ids, runs))

    asyncio.run(main())


def test_common_runs_pair_stretches_consecutive_on_both_sides():
    Run = kv_transfer.Run
    assert kv_transfer.common_runs([4, 5, 6, 9, 10], [0, 1, 7, 8, 9]) == [
        (Run(4, 2), Run(0, 2)), (Run(6, 1), Run(7, 1)), (Run(9, 2), Run(8, 2))]
    assert kv_transfer.common_runs([], []) == []


def test_a_transport_mismatch_is_refused_naming_the_option():
    async def main():
        async with zmq_server("prefill-0", kv_cache=make_cache(), model_id="m") as server:
            gen = server.expose("r1", [1])
            hello = dict(engine_id="decode-0", role=p.Role.DECODE, kv_layout=server.layout, kv_transport="ucx")
            async with RequestClient(server.address, **hello) as client:
                with pytest.raises(Exception, match="prefill-0 moves KV and embeddings over zmq, decode-0 over "
                                                    "ucx.*same --kv-transport"):
                    await client.request(p.FetchBlocks("r1", gen, (1,), (1,)))

    asyncio.run(main())


def test_fetch_of_a_subset_and_of_nothing():
    remote_cache, local_cache = make_cache(seed=3), torch.zeros(make_cache().shape)

    async def main():
        async with zmq_server("prefill-0", kv_cache=remote_cache, model_id="m") as server:
            gen = server.expose("r1", [5, 6, 7, 8])
            async with zmq_client("decode-0", kv_cache=local_cache, model_id="m") as client:
                # Decode pulls only the blocks its own prefix cache lacks.
                await client.fetch_blocks(server.address, "r1", [7, 8], [0, 1], generation=gen)
                assert (await client.fetch_blocks(server.address, "r1", [], [], generation=gen)).num_bytes == 0

    asyncio.run(main())
    assert torch.equal(local_cache[:, :, [0, 1]], remote_cache[:, :, [7, 8]])


def established_to(ports: set[int]) -> int:
    """Established TCP connections (in this network namespace) whose far end is one of `ports`."""
    count = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        remote, state = line.split()[2:4]
        count += state == "01" and int(remote.split(":")[1], 16) in ports
    return count


def test_a_client_closes_its_connections_to_a_server_it_no_longer_fetches_from():
    # Servers come and go (a restarted pod has a new address): what a client keeps for each must not grow.
    remote_cache, local_cache = make_cache(seed=3), torch.zeros(make_cache().shape)

    async def main():
        async with zmq_server("prefill-0", kv_cache=remote_cache, model_id="m") as server:
            gen = server.expose("r1", [5, 6, 7, 8])
            ports = {int(server.address.rsplit(":", 1)[1]), stream_path(server).stream.port}
            async with zmq_client("decode-0", kv_cache=local_cache, model_id="m", peer_idle_seconds=0.3) as client:
                await client.fetch_blocks(server.address, "r1", [5, 6], [0, 1], generation=gen)
                assert established_to(ports) == 2  # the control connection and one block connection
                await asyncio.sleep(0.8)
                assert established_to(ports) == 0
                await client.fetch_blocks(server.address, "r1", [7, 8], [2, 3], generation=gen)  # connects again
                assert established_to(ports) == 2

    asyncio.run(main())
    assert torch.equal(local_cache[:, :, [0, 1, 2, 3]], remote_cache[:, :, [5, 6, 7, 8]])


@PATHS
def test_block_ids_are_bounds_checked_on_both_sides(block_port):
    remote_cache, local_cache = make_cache(), torch.zeros(make_cache().shape)

    async def main():
        async with zmq_server("prefill-0", kv_cache=remote_cache, model_id="m", block_port=block_port) as server:
            gen = server.expose("r1", [1, 2, 3])
            with pytest.raises(BlockRangeError):
                server.expose("r2", [NUM_BLOCKS])
            async with zmq_client("decode-0", kv_cache=local_cache, model_id="m") as client:
                # Remote ids the server did not expose for the request, or that do not exist there.
                for remote in ([4], [NUM_BLOCKS + 5], [-1], [2**63 - 1]):
                    with pytest.raises(BlockRangeError):
                        await client.fetch_blocks(server.address, "r1", remote, [0], generation=gen)
                # Local ids outside our own cache, repeated, or not pairing up: refused before sending.
                for remote, local in (([1], [NUM_BLOCKS]), ([1], [-1]), ([1, 2], [0, 0]), ([1, 2], [0])):
                    with pytest.raises(BlockRangeError):
                        await client.fetch_blocks(server.address, "r1", remote, local, generation=gen)
                assert client.stats.num_failures == 4  # the server's refusals; local mistakes are not transfers
                with pytest.raises(BlocksNotFoundError):
                    await client.fetch_blocks(server.address, "unknown", [1], [0], generation=0)
                server.withdraw("r1")  # released: its blocks are no longer served
                with pytest.raises(BlocksNotFoundError):
                    await client.fetch_blocks(server.address, "r1", [1], [0], generation=gen)
            assert server.num_rejected == 0  # refusals are answers, not dropped frames

    asyncio.run(main())
    assert not local_cache.any()


@pytest.mark.parametrize("field, value", [
    ("model_id", "other-model"), ("dtype", torch.bfloat16), ("dtype", torch.float8_e4m3fn), ("block_size", 8),
    ("num_layers", 4),
])
def test_layout_mismatch_is_refused_before_any_block_moves(field, value):
    remote_cache = make_cache()
    if field == "dtype":
        local_cache, model_id = torch.zeros(remote_cache.shape, dtype=value), "m"
    elif field == "block_size":
        local_cache, model_id = torch.zeros(make_cache(block_size=value).shape), "m"
    elif field == "num_layers":
        local_cache, model_id = torch.zeros((value, *remote_cache.shape[1:])), "m"
    else:
        local_cache, model_id = torch.zeros(remote_cache.shape), value

    async def main():
        async with zmq_server("prefill-0", kv_cache=remote_cache, model_id="m") as server:
            gen = server.expose("r1", [1, 2])
            async with zmq_client("decode-0", kv_cache=local_cache, model_id=model_id) as client:
                with pytest.raises(IncompatiblePeerError, match=field):
                    await client.fetch_blocks(server.address, "r1", [1, 2], [1, 2], generation=gen)
                assert client.stats.num_failures == 1

    asyncio.run(main())
    assert not bits(local_cache).any()


def test_a_client_without_kv_layout_cannot_fetch_blocks():
    async def main():
        async with zmq_server("prefill-0", kv_cache=make_cache(), model_id="m") as server:
            gen = server.expose("r1", [1])
            async with RequestClient(server.address, engine_id="decode", role=p.Role.DECODE) as client:
                with pytest.raises(Exception, match="incompatible"):
                    await client.request(p.FetchBlocks("r1", gen, (1,), (1,)))

    asyncio.run(main())


def test_only_engines_that_pull_may_fetch():
    """A peer whose role never pulls KV (a proxy, an encoder) is refused, whatever its layout."""
    async def main():
        async with zmq_server("prefill-0", kv_cache=make_cache(), model_id="m") as server:
            layout = server.layout
            gen = server.expose("r1", [1])
            for role in (p.Role.PROXY, p.Role.ENCODER, p.Role.PREFILL):
                async with RequestClient(server.address, engine_id="x", role=role, kv_layout=layout) as client:
                    with pytest.raises(ErrorReply, match=f"{role.value} peers may not send FetchBlocks"):
                        await client.request(p.FetchBlocks("r1", gen, (1,), (1,)))
            assert server.num_rejected == 3

    asyncio.run(main())


def test_embeddings_by_mm_hash():
    embeddings = {"ab" * 32: torch.randn(576, 64).to(torch.bfloat16), "cd" * 32: torch.randn(3, 64)}

    async def main():
        async with zmq_server("encoder-0", encoder_cache=embeddings) as server:
            # A prefill engine's client: it has a KV cache, the encoder has none; embeddings still flow.
            async with zmq_client("prefill-0", kv_cache=make_cache(), model_id="m") as client:
                for mm_hash, tensor in embeddings.items():
                    got = await client.fetch_embeddings(server.address, mm_hash)
                    assert got.dtype == tensor.dtype and torch.equal(bits(got), bits(tensor))
                with pytest.raises(EmbeddingNotFoundError, match="ef" * 32):
                    await client.fetch_embeddings(server.address, "ef" * 32)
                with pytest.raises(IncompatiblePeerError):
                    await client.fetch_blocks(server.address, "r1", [1], [1], generation=0)  # an encoder holds no KV
                assert client.stats.num_transfers == 2 and client.stats.num_failures == 2

    asyncio.run(main())


def test_curve_protected_transfer(tmp_path):
    server_public, server_secret = zmq.auth.create_certificates(tmp_path, "server")
    client_public, client_secret = zmq.auth.create_certificates(tmp_path, "client")
    _, stranger_secret = zmq.auth.create_certificates(tmp_path, "stranger")
    remote_cache, local_cache = make_cache(seed=4), torch.zeros(make_cache().shape)

    async def main():
        curve = CurveConfig(server_secret, allowed_clients=(tmp_path,))  # a folder of allowed public keys
        async with zmq_server("prefill-0", kv_cache=remote_cache, model_id="m", curve=curve) as server:
            gen = server.expose("r1", [3, 4])
            good = CurveConfig(client_secret, server_public_key_file=server_public)
            async with zmq_client("decode-0", kv_cache=local_cache, model_id="m", curve=good) as client:
                await client.fetch_blocks(server.address, "r1", [3, 4], [9, 8], generation=gen)
            # The allow-list is the folder's *.key files: drop the stranger's so it is not on it.
            (tmp_path / "stranger.key").unlink()
            server2_curve = CurveConfig(server_secret, allowed_clients=(tmp_path,))
            async with zmq_server("prefill-1", kv_cache=remote_cache, model_id="m", curve=server2_curve) as server2:
                gen = server2.expose("r1", [3])
                bad = CurveConfig(stranger_secret, server_public_key_file=server_public)
                async with zmq_client("decode-1", kv_cache=local_cache, model_id="m", curve=bad, timeout=3) as client:
                    with pytest.raises((IncompatiblePeerError, TransferTimeout)):
                        await client.fetch_blocks(server2.address, "r1", [3], [0], generation=gen)
                assert server2.num_auth_denied >= 1

    asyncio.run(main())
    assert torch.equal(local_cache[:, :, [9, 8]], remote_cache[:, :, [3, 4]])


DYING_SERVER = """
import asyncio, sys, time, torch
from epdserve.transport.block_stream.path import BlockStreamServerPath
from epdserve.transport.zmq_frames.path import FrameServerPath
from epdserve.transport.kv.server import KVTransferServer

# Each path answers the first message of a fetch, then stalls: the test kills the process mid-transfer.
served = 0

class StallingFrames(FrameServerPath):
    async def reply_blocks(self, message, peer):
        global served
        served += 1
        if served > 1:
            await asyncio.sleep(3600)
        return await super().reply_blocks(message, peer)

class StallingStream(BlockStreamServerPath):
    def _prepare(self, message):  # on a block connection's thread
        global served
        served += 1
        if served > 1:
            time.sleep(3600)
        return super()._prepare(message)

async def main():
    cache = torch.randn(3, 2, 48, 4, 2, 8, generator=torch.Generator().manual_seed(1))
    paths = [StallingFrames()] + ([] if sys.argv[1] == "None" else [StallingStream("127.0.0.1")])
    server = KVTransferServer("prefill-doomed", paths, kv_cache=cache, model_id="m")
    print(await server.start(), flush=True)
    print(server.expose("r1", range(48)), flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


@PATHS
def test_peer_dying_mid_transfer_fails_the_fetch_at_once(block_port):
    proc = subprocess.Popen([sys.executable, "-c", DYING_SERVER, str(block_port)], stdout=subprocess.PIPE, text=True)
    local_cache = torch.zeros(make_cache().shape)
    try:
        address, gen = proc.stdout.readline().strip(), int(proc.stdout.readline())

        async def main():
            async with zmq_client("decode-0", kv_cache=local_cache, model_id="m", timeout=60,
                                   max_message_bytes=1, min_message_bytes=1, max_inflight_messages=1) as client:
                fetch = asyncio.create_task(client.fetch_blocks(address, "r1", list(range(10)), list(range(10)),
                                                                generation=gen))
                for _ in range(100):  # until the first block has landed: the transfer is under way
                    await asyncio.sleep(0.02)
                    if local_cache[:, :, 0].any():
                        break
                assert local_cache[:, :, 0].any() and not fetch.done()
                proc.kill()
                # The dropped connection fails it: no waiting out the 60 s timeout.
                with pytest.raises(TransferError, match="lost|closed|failed|refuse"):  # a reconnect is refused
                    await asyncio.wait_for(fetch, 10)
                assert client.stats.num_failures == 1

        asyncio.run(main())
    finally:
        proc.kill()
        proc.wait()


SLOW_SERVER = """
import asyncio, torch
from epdserve.transport.zmq_frames.path import FrameServerPath
from epdserve.transport.kv.server import KVTransferServer

class SlowFrames(FrameServerPath):  # a fetch of one block a message lasts long enough to freeze us midway
    async def reply_blocks(self, message, peer):
        await asyncio.sleep(0.2)
        return await super().reply_blocks(message, peer)

async def main():
    cache = torch.randn(3, 2, 48, 4, 2, 8, generator=torch.Generator().manual_seed(1))
    server = KVTransferServer("prefill-frozen", [SlowFrames()], kv_cache=cache, model_id="m")
    print(await server.start(), flush=True)
    print(server.expose("r1", range(48)), flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


def test_a_fetch_whose_peer_missed_heartbeats_is_made_again_once_reconnected():
    """The peer freezes mid-fetch (SIGSTOP: as one starved of CPU looks from here) past the heartbeat timeout, so
    the connection drops with the fetch in flight; it wakes still holding the blocks. The fetch is made once more
    over the new connection, and every block lands bit-exact - not a failure that makes the decode recompute."""
    proc = subprocess.Popen([sys.executable, "-c", SLOW_SERVER], stdout=subprocess.PIPE, text=True)
    remote = torch.randn(3, 2, 48, 4, 2, 8, generator=torch.Generator().manual_seed(1))
    local_cache = torch.zeros(remote.shape)
    try:
        address, gen = proc.stdout.readline().strip(), int(proc.stdout.readline())

        async def main():
            async with zmq_client("decode-0", kv_cache=local_cache, model_id="m", timeout=60,
                                   max_message_bytes=1, min_message_bytes=1, max_inflight_messages=1) as client:
                fetch = asyncio.create_task(client.fetch_blocks(address, "r1", list(range(10)), list(range(20, 30)),
                                                                generation=gen))
                while not local_cache[:, :, 20].any():  # the transfer is under way
                    assert not fetch.done(), fetch
                    await asyncio.sleep(0.02)
                proc.send_signal(signal.SIGSTOP)
                while not client.stats.num_retries:  # the connection dropped and the fetch began again
                    assert not fetch.done(), fetch
                    await asyncio.sleep(0.05)
                proc.send_signal(signal.SIGCONT)
                await asyncio.wait_for(fetch, 30)
                assert client.stats.num_failures == 0 and client.stats.num_retries == 1

        asyncio.run(main())
    finally:
        proc.kill()
        proc.wait()
    assert torch.equal(local_cache[:, :, 20:30], remote[:, :, :10])


def test_transport_factory():
    server = transports.create_server("zmq", "p", kv_cache=make_cache(), model_id="m")
    client = transports.create_client("zmq", "d", kv_cache=make_cache(), model_id="m")
    assert server.transport == "zmq" and len(server.paths) == 2  # ZMQ frames and block connections
    assert server.layout == client.layout == p.KVLayout("m", "float32", BLOCK_SIZE, NUM_LAYERS, NUM_KV_HEADS, HEAD_SIZE)
    # No block connections where they cannot serve: without a port, or with CURVE (it covers ZMQ only).
    assert len(transports.create_server("zmq", "p", kv_cache=make_cache(), model_id="m", block_port=None).paths) == 1
    with pytest.raises(ValueError, match="unknown KV transport 'carrier-pigeon'"):
        transports.create_client("carrier-pigeon", "d")
    with pytest.raises(ValueError, match="kv_cache must be"):
        zmq_server("p", kv_cache=torch.zeros(2, 3, 4))


@pytest.mark.gpu
@pytest.mark.parametrize("min_segment_bytes", [1, 1 << 30], ids=["as_runs", "gathered"])
def test_blocks_between_gpu_caches(min_segment_bytes):
    """Device caches: the server stages segments through pinned host memory, the client copies them
    into device blocks; bit-exact either way."""
    remote_cache = make_cache(torch.bfloat16, seed=5).cuda()
    local_cache = torch.zeros_like(remote_cache)
    remote_ids, local_ids = [*range(4, 20), 30, 2], [*range(10, 26), 1, 40]

    async def main():
        async with zmq_server("prefill-0", kv_cache=remote_cache, model_id="m") as server:
            gen = server.expose("r1", remote_ids)
            async with zmq_client("decode-0", kv_cache=local_cache, model_id="m",
                                   min_segment_bytes=min_segment_bytes) as client:
                await client.fetch_blocks(server.address, "r1", remote_ids, local_ids, generation=gen)
        torch.cuda.synchronize()

    asyncio.run(main())
    assert torch.equal(bits(local_cache[:, :, local_ids].cpu()), bits(remote_cache[:, :, remote_ids].cpu()))


def test_embeddings_of_an_encoder_that_is_gone_fail_at_once_not_at_the_transfer_timeout():
    """Nothing listens where the embeddings were (their encoder died after encoding them, or never was): the
    refused connection fails the fetch at once with PeerUnreachableError (a fetch racing the client's notice of
    the dropped connection fails with it, as lost), however long the fetch itself could take."""
    mm_hash = "ab" * 32

    async def main():
        async with zmq_client("prefill-0", timeout=60) as client:
            async with zmq_server("encoder-0", encoder_cache={mm_hash: torch.randn(3, 8)}) as server:
                await client.fetch_embeddings(server.address, mm_hash)  # connected: the pool keeps it
            for address, error in ((server.address, TransferError), (f"tcp://127.0.0.1:{free_port()}",
                                                                      PeerUnreachableError)):
                started = time.monotonic()
                with pytest.raises(error, match="refuse|lost"):
                    await client.fetch_embeddings(address, mm_hash)
                assert time.monotonic() - started < 3, address
            with pytest.raises(PeerUnreachableError, match="refuse"):  # its loss is known by now
                await client.fetch_embeddings(server.address, mm_hash)
            assert client.stats.num_failures == 3

    asyncio.run(main())


def test_a_peer_that_accepts_but_never_answers_fails_within_the_connect_timeout():
    """A host that takes the connection but never completes a handshake (frozen, or not our server): the fetch
    fails with PeerUnreachableError after the client's connect timeout, not its transfer timeout."""
    listener = socket.create_server(("127.0.0.1", 0))
    address = f"tcp://127.0.0.1:{listener.getsockname()[1]}"

    async def main():
        async with zmq_client("decode-0", kv_cache=make_cache(), model_id="m", timeout=60,
                              connect_timeout=1.0) as client:
            started = time.monotonic()
            with pytest.raises(PeerUnreachableError, match="within 1s"):
                await client.fetch_embeddings(address, "ab" * 32)
            assert 0.9 < time.monotonic() - started < 5
            with pytest.raises(PeerUnreachableError, match="within 1s"):
                await client.fetch_blocks(address, "r1", [1], [1], generation=0)

    try:
        asyncio.run(main())
    finally:
        listener.close()
