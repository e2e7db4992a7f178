"""The prefix cache's block identity: a chained hash over full blocks of tokens.

A block's hash covers its parent's hash, its token ids and its extra keys (the hashes of images whose
placeholder tokens overlap it; the request's `cache_salt` and LoRA adapter on the first block), so equal
hashes mean equal prefixes computed by the same weights. The hash is stable across processes (unlike
`hash()` of strings): engines report the hashes of the blocks they hold, and the proxy's router hashes a
prompt the same way to find where it is cached. A deployment with a secret keys the hash with a key derived
from it (`deployment_key`): what its engines, tiers and KV store hold is then named by hashes nobody without
the secret can compute from a guessed prompt, so a block can neither be looked up nor planted by its tokens.
Imports neither torch nor the engine, so the proxy can use it.
"""
from __future__ import annotations

import hashlib
import hmac
from array import array
from typing import Protocol, Sequence


class ImageSpan(Protocol):
    """Prompt positions [offset, offset + length) hold image `mm_hash`'s embeddings: the engine's
    MultiModalPlaceholder and the wire's MMPlaceholder both are one."""
    offset: int
    length: int
    mm_hash: str


def deployment_key(secret: bytes | None) -> bytes | None:
    """The block-hash key of a deployment whose services share `secret` (None: hashes are unkeyed)."""
    return hmac.new(secret, b"epdserve block hash key", hashlib.sha256).digest() if secret else None


def hash_block(parent_hash: bytes | None, token_ids: Sequence[int], extra_keys: tuple[str, ...] = (),
               key: bytes | None = None) -> bytes:
    h = hashlib.blake2b(digest_size=16, key=key or b"")
    h.update(parent_hash or b"\0" * 16)
    h.update(array("q", token_ids).tobytes())
    for extra_key in extra_keys:
        h.update(b"\x1f" + extra_key.encode())
    return h.digest()


def block_extra_keys(block_index: int, block_size: int, images: Sequence[ImageSpan],
                     cache_salt: str | None, lora_key: str | None = None) -> tuple[str, ...]:
    """The keys besides its tokens that a block's hash covers. The adapter's key on the first block makes
    every block of the chain its own: the same prompt through two adapters (or one and the base) shares
    no KV."""
    start, end = block_index * block_size, (block_index + 1) * block_size
    keys = [p.mm_hash for p in images if p.offset < end and p.offset + p.length > start]
    if block_index == 0 and cache_salt:
        keys.insert(0, "salt:" + cache_salt)
    if block_index == 0 and lora_key:
        keys.insert(0, "lora:" + lora_key)
    return tuple(keys)


def extend_block_hashes(hashes: list[bytes], token_ids: Sequence[int], block_size: int,
                        images: Sequence[ImageSpan] = (), cache_salt: str | None = None,
                        lora_key: str | None = None, key: bytes | None = None) -> list[bytes]:
    """Appends to `hashes` the hashes of the full blocks of `token_ids` it lacks; returns it. `key`: the
    deployment's (deployment_key), which every engine and router of a deployment must hash with alike."""
    start, end = len(hashes), len(token_ids) // block_size
    if start >= end:
        return hashes
    # One conversion for every new block (what hash_block does per block), then one hash call per block.
    raw = array("q", token_ids[start * block_size:end * block_size]).tobytes()
    step = block_size * 8
    parent = hashes[-1] if hashes else b"\0" * 16
    extra = bool(images or cache_salt or lora_key)
    for i, offset in enumerate(range(0, len(raw), step), start):
        h = hashlib.blake2b(parent + raw[offset:offset + step], digest_size=16, key=key or b"")
        for extra_key in block_extra_keys(i, block_size, images, cache_salt, lora_key) if extra else ():
            h.update(b"\x1f" + extra_key.encode())
        parent = h.digest()
        hashes.append(parent)
    return hashes
