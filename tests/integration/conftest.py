"""What the engine-level disaggregation tests share: a prefill run in-process, which keeps its blocks through a
KV connector, and a KV connector that copies those blocks into another engine's cache; and a KV transfer
server path that corrupts what it sends after taking its checksums."""
import dataclasses
import threading
import time
import weakref

import pytest
import torch

from epdserve.shared.engine.kv_connector import KVConnector, KVLoad, LoadResult
from epdserve.shared.engine.llm_engine import LLMEngine
from epdserve.shared.engine.sampling_params import SamplingParams
from epdserve.transport.zmq_frames.path import FrameServerPath


KEEP = "keep"  # the kv_transfer_params of a request whose blocks a KeepConnector keeps once it finishes


class KeepConnector(KVConnector):
    """Keeps the blocks of a finished request marked KEEP until released, as a prefill does for its decode."""

    def request_finished(self, request) -> bool:
        return request.kv_transfer_params == KEEP


class CopyConnector(KeepConnector):
    """Feeds a request whose `kv_transfer_params` is `(source cache, held block ids, num tokens)` by copying
    those blocks into `cache`, after `delay` seconds, on a thread; with `fail`, its loads fail instead."""

    def __init__(self, cache: torch.Tensor, fail: bool = False, delay: float = 0.0) -> None:
        self.cache, self.fail, self.delay = cache, fail, delay
        self.loads: list[KVLoad] = []
        self.ended: list[str] = []

    def num_loadable_tokens(self, request, num_local_tokens: int) -> int:
        if request.kv_transfer_params in (KEEP, None):
            return 0
        _, _, num_tokens = request.kv_transfer_params
        return max(num_tokens - num_local_tokens, 0)

    def start_load(self, request, load: KVLoad) -> None:
        self.loads.append(load)
        source, held, _ = request.kv_transfer_params
        remote = held[load.first_block:load.first_block + len(load.block_ids)]

        def copy() -> None:
            time.sleep(self.delay)
            if not self.fail:
                self.cache[:, :, load.block_ids] = source[:, :, remote]
            self.finish(LoadResult(load.request_id, not self.fail, "peer_gone" if self.fail else ""))

        threading.Thread(target=copy, daemon=True).start()

    def request_ended(self, request) -> None:
        self.ended.append(request.request_id)


_keeping: weakref.WeakSet = weakref.WeakSet()  # the engines prefill() gave a KeepConnector


def prefill(engine: LLMEngine, rid: str, prompt: list[int], params: SamplingParams):
    """Run the prompt to each sequence's first token and keep the blocks (what a prefill service does)."""
    if engine not in _keeping:
        engine.add_connector(KeepConnector(), engine.finish_load, engine.release_kv)
        _keeping.add(engine)
    request = engine.make_request(rid, {"prompt_token_ids": prompt}, params, max_output_tokens=1,
                                  kv_transfer_params=KEEP)
    engine.add_request(rid, request)
    firsts, held = {}, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            for completion in out.outputs:
                if completion.token_ids:
                    firsts[completion.index] = completion.token_ids[0]
            held = out.kv_block_ids or held
    return [firsts[i] for i in sorted(firsts)], held


@pytest.fixture(scope="session")
def keep():
    """The kv_transfer_params that have a CopyConnector keep a finished request's blocks until released."""
    return KEEP


@pytest.fixture(scope="session")
def copy_connector():
    """The CopyConnector class."""
    return CopyConnector


@pytest.fixture(scope="session")
def prefill_held():
    """prefill(engine, request id, prompt token ids, params) -> (each sequence's first token, held block ids)."""
    return prefill


def flipped(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of `tensor` with one bit of its last byte flipped."""
    copy = tensor.clone()
    copy.reshape(-1).view(torch.uint8)[-1] ^= 0x10
    return copy


class CorruptingFrames(FrameServerPath):
    """ZMQ frames whose last segment (or embedding tensor) has a bit flipped after the server took its checksums,
    in the first `faults` replies of each request (embeddings: of each mm_hash): what a reply read while its
    blocks were being overwritten would carry. The cache itself stays intact."""

    def __init__(self, faults: int) -> None:
        super().__init__()
        self.faults = faults
        self.replies: dict[str, int] = {}  # request id or mm_hash -> replies so far

    def _corrupts(self, key: str) -> bool:
        self.replies[key] = self.replies.get(key, 0) + 1
        return self.replies[key] <= self.faults

    async def reply_blocks(self, message, peer):
        reply, num_bytes = await super().reply_blocks(message, peer)
        if reply.segments and self._corrupts(message.request_id):
            reply = dataclasses.replace(reply, segments=(*reply.segments[:-1], flipped(reply.segments[-1])))
        return reply, num_bytes

    async def reply_embeddings(self, message, peer, tensor):
        reply = await super().reply_embeddings(message, peer, tensor)
        if self._corrupts(message.mm_hash):
            reply = dataclasses.replace(reply, data=flipped(reply.data))
        return reply


@pytest.fixture(scope="session")
def corrupting_frames():
    """The CorruptingFrames class: CorruptingFrames(faults) is a server path."""
    return CorruptingFrames
