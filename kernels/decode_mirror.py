"""Contiguous K/V of the decode batch, kept from one step to the next (CPU path only).

On CPU, decode attention is bound by memory traffic. Reading each sequence's K/V straight from its
blocks is what a GPU kernel does; in PyTorch it takes a gather first, which reads and writes the whole
context of every sequence, in every layer, at every step - twice the traffic of the attention itself.
While the decode batch stays the same from one step to the next (the same sequences, in the same order,
each one token longer), the mirror keeps the gathered K/V and appends only each sequence's newest
token, read back from the paged cache after the layer wrote it. Any other change rebuilds it with one
gather, which is what every step would otherwise cost. The paged cache stays the one source of truth.
"""
from __future__ import annotations

import torch

from epdserve.kernels.int8_rows import head_size_of, widened

_MARGIN = 64  # tokens of room past the longest sequence, so that appends rarely force a rebuild


class DecodeMirror:
    """Per-layer buffers [num_seqs * num_kv_heads, capacity, head_size] (float32), owned by one engine."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._batch: tuple | None = None  # sequence ids of the last step's decodes, in order
        self._lens: list[int] = []
        self.capacity = 0
        self._layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # cache data_ptr -> (K, V)
        self.appending = False  # this step extends last step's buffers
        self.num_rebuilds = 0

    def reset(self) -> None:
        """Forget the buffers: the next step rebuilds them (after a step that failed part-way)."""
        self._batch, self._lens, self.capacity = None, [], 0
        self._layers.clear()

    def begin_step(self, seq_ids: tuple, lens: list[int], num_kv_heads: int, head_size: int,
                   num_layers: int, block_size: int) -> bool:
        """Decide how this step uses the mirror; False if the batch is too big to mirror (gather instead)."""
        self.appending = (seq_ids == self._batch and len(lens) == len(self._lens)
                          and all(n == old + 1 for n, old in zip(lens, self._lens)) and max(lens) <= self.capacity)
        self._batch, self._lens = seq_ids, lens
        if self.appending:
            return True
        self._layers.clear()
        gathered = -(-max(lens) // block_size) * block_size
        capacity = gathered + _MARGIN
        if 2 * num_layers * len(lens) * num_kv_heads * capacity * head_size * 4 > self.max_bytes:
            self._batch, self.capacity = None, 0
            return False
        self.capacity = capacity
        self.num_rebuilds += 1
        return True

    def kv(self, key_cache: torch.Tensor, value_cache: torch.Tensor, plan, gather) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's K and V for the step's decodes, [num_seqs * num_kv_heads, max_len, head_size] views.

        `gather(cache)` returns [num_seqs, num_kv_heads, ctx, head_size] (a full gather, for rebuilds).
        """
        num_seqs, num_kv_heads = plan.decode_table.shape[0], plan.num_kv_heads
        head_size = head_size_of(key_cache)
        max_len = plan.decode_bias.shape[-1]
        layer = self._layers.get(key_cache.data_ptr())
        if layer is not None and self.appending:
            blocks, offsets, positions = plan.decode_newest
            seqs = torch.arange(num_seqs, device=key_cache.device)
            for buf, cache in zip(layer, (key_cache, value_cache)):
                # The newest token of each sequence: [num_seqs, num_kv_heads, head_size] from its slot.
                newest = widened(cache[blocks, offsets])
                buf.view(num_seqs, num_kv_heads, self.capacity, head_size)[seqs, :, positions] = newest
        else:
            layer = []
            for cache in (key_cache, value_cache):
                full = gather(cache)  # [num_seqs, num_kv_heads, ctx, head_size]
                # Zeros past each sequence: they get zero weight, and 0 * garbage could be NaN.
                buf = torch.zeros(num_seqs * num_kv_heads, self.capacity, head_size, device=cache.device)
                buf.view(num_seqs, num_kv_heads, self.capacity, head_size)[:, :, :full.shape[2]] = full
                layer.append(buf)
            layer = tuple(layer)
            self._layers[key_cache.data_ptr()] = layer
        return layer[0][:, :max_len], layer[1][:, :max_len]
