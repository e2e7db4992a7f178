"""Images in chat messages: fetched (data: URLs, or http(s) within size and time limits), hashed by
content, and their placeholder tokens expanded in the prompt."""
from __future__ import annotations

import asyncio
import base64
import binascii
import ipaddress
import re
import socket

import httpx

from epdserve.services.proxy.generation import ImageInput
from epdserve.services.proxy.serving import BadRequest
from epdserve.shared.processing.multimodal import ImagePromptSpec, expand_image_tokens, load_image_processor, mm_hash
from epdserve.shared.processing.tokenizer import Tokenizer

_DATA_URL = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<b64>;base64)?,(?P<data>.*)$", re.S)


class ImageFetcher:
    """Turns an image_url into bytes: data: URLs decoded, http(s) URLs downloaded within limits.

    Downloads are the proxy reaching out on a client's behalf, so by default they go only to public
    addresses (no loopback, private, link-local or cloud-metadata hosts), optionally only to listed
    domains, and every redirect hop is checked again. The connection goes to the address that was
    checked (the Host header and TLS server name keep the URL's name), so a DNS answer that changes
    between check and connect cannot redirect it.
    """

    def __init__(self, max_bytes: int = 20 << 20, timeout: float = 10.0, max_images: int = 8, *,
                 allowed_domains: tuple[str, ...] = (), allow_private: bool = False, max_redirects: int = 3) -> None:
        self.max_bytes, self.timeout, self.max_images = max_bytes, timeout, max_images
        self.allowed_domains = tuple(d.lower().strip(".") for d in allowed_domains)
        self.allow_private = allow_private
        self.max_redirects = max_redirects

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
            async with asyncio.timeout(self.timeout):
                async with httpx.AsyncClient(timeout=self.timeout, follow_redirects=False) as client:
                    for _ in range(self.max_redirects + 1):
                        request = await self._pinned_request(client, httpx.URL(url))
                        response = await client.send(request, stream=True)
                        try:
                            if response.is_redirect and "location" in response.headers:
                                url = str(httpx.URL(url).join(response.headers["location"]))  # checked again
                                continue
                            return await self._read(response)
                        finally:
                            await response.aclose()
                    raise BadRequest(f"image URL redirected more than {self.max_redirects} times", param="image_url")
        except (httpx.HTTPError, httpx.InvalidURL, TimeoutError) as exc:
            raise BadRequest(f"could not fetch the image: {exc or type(exc).__name__}", param="image_url") from None

    async def _pinned_request(self, client: httpx.AsyncClient, url: httpx.URL) -> httpx.Request:
        """A GET for `url` that connects to the checked address of its host."""
        if url.scheme not in ("http", "https") or not url.host:
            raise BadRequest("image_url must be a data: URL or an http(s) URL", param="image_url")
        host = url.host.lower().strip(".")
        if self.allowed_domains and not any(host == d or host.endswith("." + d) for d in self.allowed_domains):
            raise BadRequest(f"image host {host} is not an allowed image domain", param="image_url")
        address = await self._resolve(host, url.port or (443 if url.scheme == "https" else 80))
        return client.build_request(
            "GET", url.copy_with(host=address), headers={"Host": url.netloc.decode("ascii")},
            extensions={"sni_hostname": host} if url.scheme == "https" else {},
        )

    async def _resolve(self, host: str, port: int) -> str:
        """The address to connect to; every address the name has must be public unless allowed."""
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError):
            raise BadRequest(f"image host {host} does not resolve", param="image_url") from None
        addresses = [ipaddress.ip_address(info[4][0].split("%", 1)[0]) for info in infos]
        if not self.allow_private:
            for address in addresses:
                if not is_public(address):
                    raise BadRequest(f"image host {host} is a non-public address ({address}); the proxy fetches "
                                     "images from public addresses only unless started with "
                                     "--allow-private-image-urls", param="image_url")
        return str(min(addresses, key=lambda a: a.version))  # IPv4 first: what 127.0.0.1-bound servers expect

    async def _read(self, response: httpx.Response) -> bytes:
        if response.status_code != 200:
            raise BadRequest(f"image URL answered HTTP {response.status_code}", param="image_url")
        data = bytearray()
        async for piece in response.aiter_bytes():
            data += piece
            if len(data) > self.max_bytes:
                raise BadRequest(f"image larger than {self.max_bytes} bytes", param="image_url")
        return bytes(data)


def is_public(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Globally routable: not loopback, private, link-local (cloud metadata), shared, reserved or multicast."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_global and not address.is_multicast


class MultimodalChatEncoder:
    """Chat messages (with image_url parts) -> prompt token ids with expanded image tokens + images."""

    def __init__(self, tokenizer: Tokenizer, model_path: str, fetcher: ImageFetcher) -> None:
        self.tokenizer = tokenizer
        self.processor = load_image_processor(model_path)
        self.spec = ImagePromptSpec.from_pretrained(model_path)
        self.fetcher = fetcher

    async def __call__(self, messages: list[dict], add_generation_prompt: bool, kwargs: dict):
        urls = [part["image_url"]["url"] for m in messages if isinstance(m.get("content"), list)
                for part in m["content"] if part.get("type") == "image_url" and part.get("image_url")]
        if len(urls) > self.fetcher.max_images:
            raise BadRequest(f"at most {self.fetcher.max_images} images per request")
        blobs = await asyncio.gather(*(self.fetcher.fetch(u) for u in urls))
        hashed = await asyncio.gather(*(asyncio.to_thread(self._hash, b) for b in blobs))
        hashes = [h for h, _ in hashed]
        # Dynamic resolution (Qwen2.5-VL): each image's tokens and grid follow from its size.
        grids = [self._grid(*size) for _, size in hashed] if self.spec.num_image_tokens is None else None
        try:
            ids = await asyncio.to_thread(self.tokenizer.encode_chat, messages, add_generation_prompt, **kwargs)
        except Exception as exc:
            raise BadRequest(f"could not apply the chat template: {exc}") from None
        try:
            expanded = expand_image_tokens(ids, self.spec, hashes,
                                           None if grids is None else [t * h * w for t, h, w in grids])
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        images = [ImageInput(ph.mm_hash, blob, ph.offset, ph.length, None if grids is None else grids[i])
                  for i, (ph, blob) in enumerate(zip(expanded.mm_placeholders, blobs))]
        return expanded.token_ids, images

    def _hash(self, data: bytes) -> tuple[str, tuple[int, int]]:
        """The image's mm_hash and its (height, width)."""
        try:
            rgb = self.processor.load(data)
            return mm_hash(rgb, self.processor.config), rgb.shape[:2]
        except ValueError as exc:
            raise BadRequest(f"invalid image: {exc}", param="image_url") from None

    def _grid(self, height: int, width: int) -> tuple[int, int, int]:
        """(t, h, w) of the merged tokens an image of this size becomes."""
        config = self.processor.config
        t, h, w = config.grid(height, width)
        return t, h // config.merge_size, w // config.merge_size
