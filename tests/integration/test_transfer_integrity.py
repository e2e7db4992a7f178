"""What a transfer guarantees about the bytes it delivers, over the ZMQ transport on real sockets: a byte changed
after the sender took its checksum is caught where it lands (block connections, ZMQ frames, embeddings), and a
KV handle whose blocks were released since is refused rather than read; the services' connector fetches
corrupted embeddings once more, then fails the load. (UCX: test_ucx_kv.py; the decode that fetches KV again
and then recomputes: test_disaggregated_engine.py.)"""
import asyncio
import socket
import threading

import pytest
import torch

from epdserve.transport.channel import protocol as p
from epdserve.transport import transports
from epdserve.transport.block_stream.path import BlockStreamServerPath
from epdserve.transport.channel.common import ErrorReply
from epdserve.transport.kv.server import KVTransferServer
from epdserve.transport.kv.transfer import BlocksNotFoundError, IntegrityError, StaleHandleError
from epdserve.transport.channel.request_client import RequestClient

NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE = 3, 48, 4, 2, 8


def make_cache(seed=0, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((NUM_LAYERS, 2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE), generator=gen).to(dtype)


class FlippingProxy:
    """A TCP relay in front of a server's block port that flips one bit of the first byte the server sends after
    each request, `faults` times: nothing precedes the blocks on a block connection, so that byte is the
    first of the reply's first segment, changed in flight after the server took its checksum."""

    def __init__(self, upstream_port: int, faults: int) -> None:
        self.upstream_port, self.faults = upstream_port, faults
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.flipped = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                downstream, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            pending = [False]  # a request went up: flip the next byte that comes down
            threading.Thread(target=self._relay, args=(downstream, upstream, pending, False), daemon=True).start()
            threading.Thread(target=self._relay, args=(upstream, downstream, pending, True), daemon=True).start()

    def _relay(self, source: socket.socket, sink: socket.socket, pending: list[bool], down: bool) -> None:
        try:
            while data := bytearray(source.recv(1 << 20)):
                with self._lock:
                    if not down:
                        pending[0] = True  # before the request reaches the server
                    elif pending[0]:
                        pending[0] = False
                        if self.flipped < self.faults:
                            data[0] ^= 0x10
                            self.flipped += 1
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for conn in (source, sink):
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.listener.close()


def block_path(server: KVTransferServer) -> BlockStreamServerPath:
    (path,) = [path for path in server.paths if isinstance(path, BlockStreamServerPath)]
    return path


@pytest.mark.parametrize("min_segment_bytes", [1, 1 << 20], ids=["as_runs", "gathered"])
def test_a_byte_flipped_on_a_block_connection_is_caught_where_it_lands(min_segment_bytes):
    remote, local = make_cache(seed=1), torch.zeros(make_cache().shape)

    async def main():
        async with transports.create_server("zmq", "prefill-0", kv_cache=remote, model_id="m") as server:
            gen = server.expose("r1", range(8, 24))
            proxy = FlippingProxy(block_path(server).stream.port, faults=1)
            block_path(server).stream.port = proxy.port  # announced to peers: they connect through the proxy
            try:
                async with transports.create_client("zmq", "decode-0", kv_cache=local, model_id="m",
                                                    min_segment_bytes=min_segment_bytes) as client:
                    with pytest.raises(IntegrityError, match="landed corrupted"):
                        await client.fetch_blocks(server.address, "r1", list(range(8, 24)), list(range(16)),
                                                  generation=gen)
                    assert proxy.flipped == 1 and client.stats.num_failures == 1
                    # Fetched again (over the same connection: it stayed in step), the blocks land intact.
                    await client.fetch_blocks(server.address, "r1", list(range(8, 24)), list(range(16)),
                                              generation=gen)
            finally:
                proxy.close()

    asyncio.run(main())
    assert torch.equal(local[:, :, :16], remote[:, :, 8:24])


@pytest.mark.parametrize("min_segment_bytes", [1, 1 << 20], ids=["as_runs", "gathered"])
def test_a_byte_flipped_in_a_zmq_frame_is_caught_where_it_lands(corrupting_frames, min_segment_bytes):
    remote, local = make_cache(seed=2, dtype=torch.bfloat16), torch.zeros(make_cache().shape, dtype=torch.bfloat16)

    async def main():
        async with KVTransferServer("prefill-0", [corrupting_frames(faults=1)], kv_cache=remote,
                                    model_id="m") as server:
            gen = server.expose("r1", [3, 4, 5, 30, 31])
            async with transports.create_client("zmq", "decode-0", kv_cache=local, model_id="m",
                                                min_segment_bytes=min_segment_bytes) as client:
                with pytest.raises(IntegrityError, match="landed corrupted"):
                    await client.fetch_blocks(server.address, "r1", [3, 4, 5, 30, 31], [0, 1, 2, 9, 10],
                                              generation=gen)
                await client.fetch_blocks(server.address, "r1", [3, 4, 5, 30, 31], [0, 1, 2, 9, 10], generation=gen)

    asyncio.run(main())
    assert torch.equal(local[:, :, [0, 1, 2, 9, 10]].view(torch.int16),
                       remote[:, :, [3, 4, 5, 30, 31]].view(torch.int16))


def test_an_embedding_flipped_after_its_checksum_is_caught(corrupting_frames):
    embeddings = {"ab" * 32: torch.randn(576, 64).to(torch.bfloat16)}

    async def main():
        async with KVTransferServer("encoder-0", [corrupting_frames(faults=1)], encoder_cache=embeddings) as server:
            async with transports.create_client("zmq", "prefill-0", kv_cache=make_cache(), model_id="m") as client:
                with pytest.raises(IntegrityError, match="embeddings abab"):
                    await client.fetch_embeddings(server.address, "ab" * 32)
                got = await client.fetch_embeddings(server.address, "ab" * 32)
                assert torch.equal(got.view(torch.int16), embeddings["ab" * 32].view(torch.int16))
                assert client.stats.num_failures == 1 and client.stats.num_transfers == 1

    asyncio.run(main())


@pytest.mark.parametrize("block_port", [0, None], ids=["block_connection", "zmq_frames"])
def test_a_handle_to_released_blocks_is_refused_even_when_the_request_id_is_exposed_again(block_port):
    """Prefill released the blocks (decode's Release, an abort, the lease) and exposes the same request id
    again over other blocks: a fetch with the old handle's generation is refused, never served from blocks
    that may hold another request's KV by now."""
    remote, local = make_cache(seed=3), torch.zeros(make_cache().shape)

    async def main():
        async with transports.create_server("zmq", "prefill-0", kv_cache=remote, model_id="m",
                                            block_port=block_port) as server:
            old = server.expose("r1", [1, 2, 3])
            server.withdraw("r1")
            assert server.generation("r1") is None
            new = server.expose("r1", [1, 2, 3, 4])
            assert new != old and server.generation("r1") == new
            async with transports.create_client("zmq", "decode-0", kv_cache=local, model_id="m") as client:
                with pytest.raises(StaleHandleError, match="released"):
                    await client.fetch_blocks(server.address, "r1", [1, 2, 3], [1, 2, 3], generation=old)
                assert isinstance(StaleHandleError(), BlocksNotFoundError)  # callers that recompute on either
                await client.fetch_blocks(server.address, "r1", [1, 2, 3], [5, 6, 7], generation=new)
            async with RequestClient(server.address, engine_id="decode-1", role=p.Role.DECODE,
                                     kv_layout=server.layout) as raw:
                with pytest.raises(ErrorReply) as refused:
                    await raw.request(p.FetchBlocks("r1", old, (1,), (1,)))
                assert refused.value.error.code is p.ErrorCode.STALE

    asyncio.run(main())
    assert not local[:, :, [1, 2, 3]].any()
    assert torch.equal(local[:, :, [5, 6, 7]], remote[:, :, [1, 2, 3]])


def test_every_exposure_has_a_generation_of_its_own():
    async def main():
        async with transports.create_server("zmq", "prefill-0", kv_cache=make_cache(), model_id="m") as one, \
                transports.create_server("zmq", "prefill-1", kv_cache=make_cache(), model_id="m") as other:
            generations = [one.expose(f"r{i}", [i]) for i in range(5)] + [other.expose("r0", [0])]
            assert len(set(generations)) == 6 and all(0 < g < 2**63 for g in generations)

    asyncio.run(main())


@pytest.mark.parametrize("faults", [1, 2], ids=["fetched-again", "load-fails"])
def test_embeddings_that_land_corrupted_are_fetched_again_then_the_load_fails(corrupting_frames, faults):
    """The services' connector, loading an image's embeddings from an encoder whose first `faults` answers
    are corrupted after their checksums: it counts each, fetches once more, and either hands the engine the
    intact embeddings or fails the load (the request then ends with an error): never corrupt ones."""
    from epdserve.services.host.peer_kv_connector import PeerKVConnector, PeerSources
    from epdserve.services.host.request_spans import RequestSpans
    from epdserve.services.host.service_metrics import ServiceMetrics
    from epdserve.shared.engine import KVLoad

    mm_hash = "ab" * 32
    embeddings = {mm_hash: torch.randn(576, 64).to(torch.bfloat16)}
    metrics = ServiceMetrics("prefill", "prefill-0", "m")

    async def main():
        async with KVTransferServer("encoder-0", [corrupting_frames(faults)], encoder_cache=embeddings) as server, \
                transports.create_client("zmq", "prefill-0") as client:
            connector = PeerKVConnector(client, metrics, asyncio.get_running_loop(), 10.0, torch.bfloat16,
                                        {"timeout": 5.0})
            results = []
            connector.bind(results.append, lambda request_id: None)
            sources = PeerSources(RequestSpans("prefill-0"), encoder_addrs={mm_hash: server.address})
            await connector._load_embeddings("r1", sources, KVLoad("r1", [], 0, 0, (mm_hash,)))
            await connector.close()
            return results

    (result,) = asyncio.run(main())
    count = metrics.registry.get_sample_value
    assert count("epdserve:transfer_integrity_failures_total", {**metrics.labels, "kind": "embeddings"}) == faults
    assert count("epdserve:transfer_integrity_failures_total", {**metrics.labels, "kind": "kv"}) == 0
    if faults == 1:
        assert result.ok and torch.equal(result.mm_embeddings[mm_hash].view(torch.int16),
                                         embeddings[mm_hash].view(torch.int16))
    else:
        assert not result.ok and result.reason == "integrity" and not result.mm_embeddings
