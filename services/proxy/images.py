"""Images in chat messages: fetched (data: URLs, or http(s) within size and time limits), hashed by
content, and their placeholder tokens expanded in the prompt."""
from __future__ import annotations

import asyncio
import base64
import binascii
import re

import httpx

from epdserve.services.proxy.generation import ImageInput
from epdserve.services.proxy.serving import BadRequest
from epdserve.shared.image_processor import ImageProcessor
from epdserve.shared.multimodal import ImagePromptSpec, expand_image_tokens, mm_hash
from epdserve.shared.tokenizer import Tokenizer

_DATA_URL = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<b64>;base64)?,(?P<data>.*)$", re.S)


class ImageFetcher:
    def __init__(self, max_bytes: int = 20 << 20, timeout: float = 10.0, max_images: int = 8) -> None:
        self.max_bytes, self.timeout, self.max_images = max_bytes, timeout, max_images

    async def fetch(self, url: str) -> bytes:
        if url.startswith("data:"):
            return self._decode_data_url(url)
        if url.startswith(("http://", "https://")):
            return await self._download(url)
        raise BadRequest("image_url must be a data: URL or an http(s) URL", param="image_url")

    def _decode_data_url(self, url: str) -> bytes:
        match = _DATA_URL.match(url)
        if match is None or not match["b64"]:
            raise BadRequest("image data: URLs must be base64 encoded", param="image_url")
        if len(match["data"]) > self.max_bytes * 4 // 3 + 4:
            raise BadRequest(f"image larger than {self.max_bytes} bytes", param="image_url")
        try:
            return base64.b64decode(match["data"], validate=True)
        except (binascii.Error, ValueError):
            raise BadRequest("image data: URL is not valid base64", param="image_url") from None

    async def _download(self, url: str) -> bytes:
        try:
            async with httpx.AsyncClient(timeout=self.timeout, follow_redirects=True, max_redirects=3) as client:
                async with asyncio.timeout(self.timeout):
                    async with client.stream("GET", url) as response:
                        if response.status_code != 200:
                            raise BadRequest(f"image URL answered HTTP {response.status_code}", param="image_url")
                        data = bytearray()
                        async for piece in response.aiter_bytes():
                            data += piece
                            if len(data) > self.max_bytes:
                                raise BadRequest(f"image larger than {self.max_bytes} bytes", param="image_url")
                        return bytes(data)
        except (httpx.HTTPError, TimeoutError) as exc:
            raise BadRequest(f"could not fetch the image: {exc or type(exc).__name__}", param="image_url") from None


class MultimodalChatEncoder:
    """Chat messages (with image_url parts) -> prompt token ids with expanded image tokens + images."""

    def __init__(self, tokenizer: Tokenizer, model_path: str, fetcher: ImageFetcher) -> None:
        self.tokenizer = tokenizer
        self.processor = ImageProcessor.from_pretrained(model_path)
        self.spec = ImagePromptSpec.from_pretrained(model_path)
        self.fetcher = fetcher

    async def __call__(self, messages: list[dict], add_generation_prompt: bool, kwargs: dict):
        urls = [part["image_url"]["url"] for m in messages if isinstance(m.get("content"), list)
                for part in m["content"] if part.get("type") == "image_url" and part.get("image_url")]
        if len(urls) > self.fetcher.max_images:
            raise BadRequest(f"at most {self.fetcher.max_images} images per request")
        blobs = await asyncio.gather(*(self.fetcher.fetch(u) for u in urls))
        hashes = await asyncio.gather(*(asyncio.to_thread(self._hash, b) for b in blobs))
        try:
            ids = self.tokenizer.encode_chat(messages, add_generation_prompt, **kwargs)
        except Exception as exc:
            raise BadRequest(f"could not apply the chat template: {exc}") from None
        try:
            expanded = expand_image_tokens(ids, self.spec, hashes)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        images = [ImageInput(ph.mm_hash, blob, ph.offset, ph.length)
                  for ph, blob in zip(expanded.mm_placeholders, blobs)]
        return expanded.token_ids, images

    def _hash(self, data: bytes) -> str:
        try:
            return mm_hash(self.processor.load(data), self.processor.config)
        except ValueError as exc:
            raise BadRequest(f"invalid image: {exc}", param="image_url") from None
