"""The encoder service: images in, embeddings kept for prefill (and decode) to pull.

An EncodeRequest carries each image's bytes and the mm_hash the proxy computed. The encoder decodes
the bytes itself and recomputes the hash: a peer cannot plant embeddings under another image's hash.
Results live in a bounded LRU cache keyed by mm_hash, which the KV transfer server reads from; an image
already cached costs nothing.

EncodeDone carries the request's stages here: `encode` (the whole request, with the embeddings' bytes)
and, for each image not cached, `encode.queue` (waiting for the model) and `encode.compute`.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch

from epdserve.services.runtime.network import advertised, peer_auth, server_curve
from epdserve.services.host.request_spans import RequestSpans
from epdserve.services.host.service_metrics import ServiceMetrics
from epdserve.shared.compute_threads import set_this_thread
from epdserve.shared.config import ServiceConfig
from epdserve.shared.models.cpu_kernels import load_cpu_kernels
from epdserve.shared.models.image_encoder import ImageEncoder
from epdserve.shared.processing.multimodal import mm_hash
from epdserve.transport.channel.protocol import (EncodeDone, EncodedItem, EncodeRequest, Error, ErrorCode, Handshake,
                                                 Health, Message, Role, Status)
from epdserve.transport.kv.server import KVTransferServer
from epdserve.transport.transports import create_server
from epdserve.transport.channel.security import WILDCARD_HOSTS

logger = logging.getLogger(__name__)


class EncoderCache:
    """mm_hash -> embeddings [num_tokens, hidden_size], least recently used evicted past `capacity` items."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.hits = self.misses = 0

    def get(self, key: str) -> torch.Tensor | None:
        tensor = self._items.get(key)
        if tensor is not None:
            self._items.move_to_end(key)
        return tensor

    def put(self, key: str, tensor: torch.Tensor) -> None:
        self._items[key] = tensor
        self._items.move_to_end(key)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)


async def build_encoder_worker(service: ServiceConfig, model_path: str, dtype: torch.dtype, device: str,
                               control_rejected: Callable[[], int]) -> EncoderWorker:
    """An encoder worker for `model_path`'s vision tower in `dtype` on `device`, its data server serving."""
    def load() -> ImageEncoder:
        if torch.device(device).type == "cpu":
            # A vision tower's are its linear layers (and Qwen2.5-VL's RMSNorms).
            load_cpu_kernels(dtype, layer_ops=True, attention=False)
        logger.info("loading the vision tower of %s (a few seconds)", Path(model_path).name)
        return ImageEncoder.from_pretrained(model_path, dtype, device)

    encoder = await asyncio.to_thread(load)
    cache = EncoderCache(service.encoder_cache_items)
    transport = service.transport
    kv_server = create_server(transport.kv_transport, service.engine_id, encoder_cache=cache, host=service.host,
                              port=service.data_port, allow_wildcard=service.host in WILDCARD_HOSTS,
                              curve=server_curve(transport), auth=peer_auth(transport), **transport.transfer_options())
    data_addr = advertised(await kv_server.start(), service.host, service.advertise_host)
    return EncoderWorker(service, service.served_model_name or Path(model_path).name, encoder, cache,
                         kv_server, data_addr, lambda: control_rejected() + kv_server.num_rejected)


class EncoderWorker:
    """Owns the model, its cache and `kv_server`, which serves the cache at `data_addr`."""

    role = Role.ENCODER

    def __init__(self, service: ServiceConfig, model_name: str, encoder: ImageEncoder, cache: EncoderCache,
                 kv_server: KVTransferServer, data_addr: str, rejected_frames: Callable[[], int]) -> None:
        self.service = service
        self.processor = encoder.processor
        self.encoder = encoder
        self.cache = cache
        self.kv_server = kv_server
        self.data_addr = data_addr
        self.metrics = ServiceMetrics(service.role, service.engine_id, model_name,
                                      mm_cache=lambda: (self.cache.hits + self.cache.misses, self.cache.hits),
                                      rejected_frames=rejected_frames,
                                      requests=lambda: (int(self.busy), self._waiting))
        # One image at a time through the model, on the one thread with the service's compute threads; the
        # event loop stays free meanwhile.
        self._lock = asyncio.Lock()
        self._waiting = 0  # images waiting for it
        self._executor = ThreadPoolExecutor(1, "epdserve-encoder", initializer=set_this_thread, initargs=(service.threads,))

    def status(self, health: Health) -> Status:
        return Status(self.service.engine_id, self.role, health, 0, 0, 0, 0, data_addr=self.data_addr)

    @property
    def busy(self) -> bool:
        return self._lock.locked()

    async def handle(self, message: Message, peer: Handshake) -> Message | None:
        if isinstance(message, EncodeRequest):
            return await self._encode(message)
        return Error(ErrorCode.BAD_REQUEST, f"an encoder does not take {type(message).__name__}",
                     getattr(message, "request_id", None))

    async def _encode(self, request: EncodeRequest) -> Message:
        started = time.monotonic()
        spans = RequestSpans(self.service.engine_id)
        done, num_bytes = [], 0
        for item in request.items:
            cached = self.cache.get(item.mm_hash)
            if cached is None:
                self.cache.misses += 1
                try:
                    cached = await self._compute(item.mm_hash, item.data, spans)
                except ValueError as exc:
                    return Error(ErrorCode.BAD_REQUEST, str(exc), request.request_id)
            else:
                self.cache.hits += 1
            done.append(EncodedItem(item.mm_hash, cached.shape[0]))
            num_bytes += cached.nbytes
        spans.add("encode", started, time.monotonic(), num_bytes)
        return EncodeDone(request.request_id, tuple(done), trace=spans.take())

    async def _compute(self, item_hash: str, data: bytes, spans: RequestSpans) -> torch.Tensor:
        def run() -> torch.Tensor:
            rgb = self.processor.load(data)
            if mm_hash(rgb, self.processor.config) != item_hash:
                raise ValueError("mm_hash does not match the image")
            # Kept on the host: the transfer server sends host bytes.
            return self.encoder.embed(rgb).cpu().contiguous()

        queued = time.monotonic()
        self._waiting += 1
        try:
            await self._lock.acquire()
        finally:
            self._waiting -= 1
        try:
            computing = time.monotonic()
            embeddings = await asyncio.get_running_loop().run_in_executor(self._executor, run)
        finally:
            self._lock.release()
        spans.add("encode.queue", queued, computing)
        spans.add("encode.compute", computing, time.monotonic(), embeddings.nbytes)
        self.cache.put(item_hash, embeddings)
        return embeddings

    async def close(self) -> None:
        await self.kv_server.close()
        self._executor.shutdown(wait=False, cancel_futures=True)
