"""Upper bounds on what a peer may make a receiver allocate: the codec checks them on every message, both
ways, and whoever takes requests from users keeps within them (it imports no torch, as the proxy's OpenAI
layer does not)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Limits:
    """Upper bounds on what a peer may make us allocate; checked before allocating."""

    max_message_bytes: int = 64 << 20  # control frame (frame 0); images ride in EncodeRequest
    max_tensor_bytes: int = 4 << 30  # one tensor frame
    max_str_len: int = 1 << 20
    max_bin_len: int = 64 << 20
    max_list_len: int = 1 << 22  # prompt token ids, block ids
    max_map_len: int = 64  # a struct's fields; protocol structs have far fewer
    max_tensor_dims: int = 8


DEFAULT_LIMITS = Limits()
