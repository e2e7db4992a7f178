"""Attention over the paged KV cache, through whichever backend the engine selected."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass(slots=True)
class AttentionMetadata:
    """Describes one step's varlen batch; built once per step by the model runner, shared by all layers."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] int32: length including this step's tokens
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    # The backend's per-step plan for each sliding window the layers use (None: the whole context), if it
    # makes plans.
    plans: dict[int | None, object] = field(default_factory=dict)


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_size: int, sliding_window: int | None,
                 scale: float | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, head_size
        self.scale = head_size ** -0.5 if scale is None else scale
        self.sliding_window = sliding_window
        # Bound by the model runner after the cache is allocated: [num_blocks, block_size, num_kv_heads, head_size].
        self.key_cache: torch.Tensor | None = None
        self.value_cache: torch.Tensor | None = None
        self.backend = None

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        # query: [num_tokens, num_heads, head_size]; key/value: [num_tokens, num_kv_heads, head_size]
        self.backend.write_kv(key, value, self.key_cache, self.value_cache, meta.slot_mapping)
        plan = meta.plans.get(self.sliding_window)
        extra = {} if plan is None else {"plan": plan}
        return self.backend.attend(query, self.key_cache, self.value_cache, meta.block_tables, meta.seq_lens,
                                   meta.query_start_loc, self.scale, self.sliding_window, **extra)
