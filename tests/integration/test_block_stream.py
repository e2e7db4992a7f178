"""The ZMQ transport's block connections (transport/block_stream/stream.py) on real sockets: who gets a port, what a
stranger or garbage gets, refusals, and that no byte lands in a block after its fetch has ended."""
import asyncio
import socket
import time

import pytest
import torch

from epdserve.transport.channel import codec
from epdserve.transport.channel import protocol as p
from epdserve.transport.block_stream.stream import (TOKEN_BYTES, BlockStreamClient, BlockStreamServer, _frame,
                                                    _recv_bytes, _recv_message)
from epdserve.transport.block_stream.path import BlockStreamServerPath
from epdserve.transport.kv.transfer import BlocksNotFoundError, TransferError, TransferTimeout
from epdserve.transport.channel.request_client import RequestClient
from epdserve.transport import transports
from epdserve.transport.kv.server import KVTransferServer

NUM_LAYERS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE = 4, 16, 4, 64


def make_cache(num_blocks=64, seed=0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((NUM_LAYERS, 2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE), generator=gen)


def zmq_server(engine_id, **kwargs) -> KVTransferServer:
    return transports.create_server("zmq", engine_id, **kwargs)


def zmq_client(engine_id, **kwargs):
    return transports.create_client("zmq", engine_id, **kwargs)


def block_stream(server: KVTransferServer) -> BlockStreamServer:
    (path,) = [path for path in server.paths if isinstance(path, BlockStreamServerPath)]
    return path.stream


def raw_connection(server: KVTransferServer) -> socket.socket:
    return socket.create_connection(("127.0.0.1", block_stream(server).port), timeout=5)


def closed_without_a_byte(conn: socket.socket) -> bool:
    try:
        return conn.recv(1 << 20) == b""
    except ConnectionResetError:  # closed with our bytes unread
        return True


def test_only_peers_that_may_fetch_blocks_of_our_layout_learn_the_port():
    async def main():
        async with zmq_server("prefill-0", kv_cache=make_cache(), model_id="m") as server:
            layout = server.layout
            for role, kv_layout, offered in ((p.Role.DECODE, layout, True), (p.Role.DECODE, None, False),
                                             (p.Role.PROXY, layout, False), (p.Role.PREFILL, layout, False)):
                async with RequestClient(server.address, engine_id="x", role=role, kv_layout=kv_layout) as client:
                    ack = await client.connect()
                    assert (ack.data_port == block_stream(server).port and len(ack.data_token) == TOKEN_BYTES) is offered
                    assert offered or (ack.data_port is None and ack.data_token is None)
        async with zmq_server("prefill-1", kv_cache=make_cache(), model_id="m", block_port=None) as server:
            async with RequestClient(server.address, engine_id="x", role=p.Role.DECODE, kv_layout=server.layout) as client:
                assert (await client.connect()).data_port is None

    asyncio.run(main())


def test_a_stranger_and_garbage_are_dropped_and_counted_while_others_are_served():
    remote, local = make_cache(seed=1), torch.zeros(make_cache().shape)

    async def main():
        async with zmq_server("prefill-0", kv_cache=remote, model_id="m") as server:
            gen = server.expose("r1", range(8))
            request = _frame(p.FetchBlocks("r1", gen, tuple(range(8)), (8,)))
            for opening in (bytes(TOKEN_BYTES) + request,  # a wrong token
                            block_stream(server).token + (5).to_bytes(4, "little") + b"\xc1junk",  # not msgpack
                            block_stream(server).token + (1 << 31).to_bytes(4, "little"),  # oversized
                            block_stream(server).token + _frame(p.StatusRequest())):  # not a fetch
                with raw_connection(server) as conn:
                    conn.sendall(opening)
                    assert closed_without_a_byte(conn)
            assert server.num_rejected == 4
            async with zmq_client("decode-0", kv_cache=local, model_id="m") as client:
                await client.fetch_blocks(server.address, "r1", list(range(8)), list(range(8, 16)), generation=gen)

    asyncio.run(main())
    assert torch.equal(local[:, :, 8:16], remote[:, :, :8])


def test_a_refusal_arrives_as_the_servers_error_and_the_next_fetch_goes_through():
    remote, local = make_cache(seed=2), torch.zeros(make_cache().shape)

    async def main():
        async with zmq_server("prefill-0", kv_cache=remote, model_id="m") as server:
            gen = server.expose("r1", range(4))
            async with zmq_client("decode-0", kv_cache=local, model_id="m") as client:
                with pytest.raises(BlocksNotFoundError, match="holds no blocks for request 'r2'"):
                    await client.fetch_blocks(server.address, "r2", [0, 1], [0, 1], generation=0)
                assert not local.any()
                await client.fetch_blocks(server.address, "r1", [0, 1, 2, 3], [4, 5, 6, 7], generation=gen)
                assert client.stats.num_failures == 1

    asyncio.run(main())
    assert torch.equal(local[:, :, 4:8], remote[:, :, :4])


def test_a_server_that_never_answers_times_the_fetch_out():
    listener = socket.create_server(("127.0.0.1", 0))
    accepted = []

    async def main():
        client = BlockStreamClient("decode-0")
        loop = asyncio.get_running_loop()
        loop.run_in_executor(None, lambda: accepted.append(listener.accept()[0]))
        started = time.monotonic()
        with pytest.raises(TransferTimeout):
            await client.fetch("127.0.0.1", listener.getsockname()[1], bytes(TOKEN_BYTES),
                               p.FetchBlocks("r", 1, (1,), (1,)), [bytearray(1024)], timeout=0.5)
        assert time.monotonic() - started < 5
        await client.close()

    asyncio.run(main())
    listener.close()
    for conn in accepted:
        conn.close()


def test_a_server_closing_mid_blocks_fails_the_fetch_without_misreading_them():
    listener = socket.create_server(("127.0.0.1", 0))

    def serve():
        conn, _ = listener.accept()
        _recv_bytes(conn, TOKEN_BYTES)
        _recv_message(conn, codec.DEFAULT_LIMITS)  # read whole: closing on unread bytes would reset
        conn.sendall(bytes(5000))  # part of what was asked for, then gone
        conn.close()

    async def main():
        client = BlockStreamClient("decode-0")
        asyncio.get_running_loop().run_in_executor(None, serve)
        with pytest.raises(TransferError, match="closed after 5000 bytes"):
            await client.fetch("127.0.0.1", listener.getsockname()[1], bytes(TOKEN_BYTES),
                               p.FetchBlocks("r", 1, (1,), (1,)), [bytearray(4096), bytearray(4096)], timeout=5)
        await client.close()

    asyncio.run(main())
    listener.close()


def test_no_byte_lands_in_the_cache_after_a_cancelled_fetch_returns():
    remote = make_cache(num_blocks=1024, seed=3)  # 256 MiB: a fetch of it takes a while
    local = torch.zeros(remote.shape)

    async def main():
        async with zmq_server("prefill-0", kv_cache=remote, model_id="m") as server:
            gen = server.expose("r1", range(1024))
            async with zmq_client("decode-0", kv_cache=local, model_id="m", min_message_bytes=1 << 40) as client:
                await client.fetch_blocks(server.address, "r1", [0], [0], generation=gen)  # connected, handshaken
                fetch = asyncio.create_task(client.fetch_blocks(server.address, "r1", list(range(1024)),
                                                                list(range(1024)), generation=gen))
                while not local[0, 0, 1].any():  # the fetch is writing into the cache
                    await asyncio.sleep(0.001)
                fetch.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await fetch
                snapshot = local.clone()
                await asyncio.sleep(0.3)
                assert torch.equal(local, snapshot), "a cancelled fetch went on writing"
                assert not torch.equal(local[-1, 1], remote[-1, 1]), "the fetch was not cut short"
                # The connection it used is gone; the next fetch opens another.
                await client.fetch_blocks(server.address, "r1", [5, 6], [5, 6], generation=gen)
            assert torch.equal(local[:, :, 5:7], remote[:, :, 5:7])

    asyncio.run(main())


def test_blocks_withdrawn_while_a_peer_stopped_reading_are_cut_off_from_it():
    """wait_sent waits while a block connection still sends the request's blocks; when the peer never
    reads them, it cuts the connection after its timeout and returns once the send stopped, so the
    blocks can be freed without a send still reading them."""
    remote = make_cache(num_blocks=512, seed=4)  # 128 MiB: more than the sockets' buffers hold

    async def main():
        async with zmq_server("prefill-0", kv_cache=remote, model_id="m") as server:
            gen = server.expose("r1", range(512))
            conn = raw_connection(server)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
            conn.sendall(block_stream(server).token + _frame(p.FetchBlocks("r1", gen, tuple(range(512)), (512,))))
            while not block_stream(server).sending("r1"):
                await asyncio.sleep(0.01)
            server.withdraw("r1")
            assert not await server.wait_sent("r1", timeout=0.3)
            assert not block_stream(server).sending("r1")
            conn.close()

    asyncio.run(main())


def test_a_closed_client_cuts_its_fetches_short():
    remote = make_cache(num_blocks=1024, seed=5)
    local = torch.zeros(remote.shape)

    async def main():
        async with zmq_server("prefill-0", kv_cache=remote, model_id="m") as server:
            gen = server.expose("r1", range(1024))
            client = zmq_client("decode-0", kv_cache=local, model_id="m", min_message_bytes=1 << 40)
            await client.fetch_blocks(server.address, "r1", [0], [0], generation=gen)
            fetch = asyncio.create_task(client.fetch_blocks(server.address, "r1", list(range(1024)), list(range(1024)),
                                                            generation=gen))
            while not local[0, 0, 1].any():
                await asyncio.sleep(0.001)
            await client.close()
            with pytest.raises(TransferError):
                await asyncio.wait_for(fetch, 5)

    asyncio.run(main())


def test_error_frames_decode_with_the_codec():
    error = p.Error(p.ErrorCode.NOT_FOUND, "gone", "r1")
    frame = _frame(error)
    assert codec.decode([frame[4:]]) == error and int.from_bytes(frame[:4], "little") == len(frame) - 4


@pytest.mark.parametrize("slow", ["reader", "writer"])
def test_segments_hashed_while_the_socket_waits_are_hashed_whole_and_in_order(slow):
    """Both ends hash a segment in pieces, out of step with the socket (while it would wait, or once a backlog
    builds): each side's checksum still equals XXH3 of the whole segment, the bytes land exact, and a byte
    changed anywhere - not only in the first piece - changes the checksum. A slow reader makes the sender
    wait for room; a slow writer, the receiver for data."""
    from epdserve.transport.kv import checksum
    from epdserve.transport.block_stream.stream import _recv_into, _send_hashed

    gen = torch.Generator().manual_seed(5)
    segment = torch.randint(0, 256, ((3 << 20) + 12345,), dtype=torch.uint8, generator=gen).numpy()
    landed = torch.zeros(segment.nbytes, dtype=torch.uint8).numpy()
    a, b = socket.socketpair()
    for conn in (a, b):
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)

    def send() -> int:
        if slow != "writer":
            return _send_hashed(a, segment)
        for start in range(0, segment.nbytes, 300 << 10):  # in bursts, with pauses between
            a.sendall(segment[start:start + (300 << 10)])
            time.sleep(0.01)
        return checksum.checksum(segment)

    def receive() -> int:
        digest = checksum.running()
        if slow == "reader":
            got = 0
            while got < landed.nbytes:
                time.sleep(0.002)
                got += b.recv_into(memoryview(landed)[got:got + (200 << 10)])
            digest.update(landed)
        else:
            _recv_into(b, memoryview(landed), time.monotonic() + 30, digest)
        return digest.intdigest()

    async def both():
        return await asyncio.gather(asyncio.to_thread(send), asyncio.to_thread(receive))

    try:
        sent, received = asyncio.run(both())
    finally:
        a.close()
        b.close()
    assert (landed == segment).all()
    assert sent == received == checksum.checksum(segment)
    landed[(2 << 20) + 7] ^= 0x10
    assert checksum.checksum(landed) != sent
    assert checksum.copy_hashed(landed, segment) == sent and (landed == segment).all()
