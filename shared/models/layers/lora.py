"""LoRA on the decoder's linear layers: every resident adapter's weights stacked per layer, applied to a
batch that mixes adapters and none.

Each adaptable Linear gets a `LoRAStack`: A [max_loras, parts * max_rank, in], B [max_loras, out, parts *
max_rank], one slot per resident adapter, zero where an adapter has no weights. A fused projection (QKV)
has one part per HF module; its B is block-diagonal, so one shrink and one expand cover q, k and v. An
adapter of rank r < max_rank fills the first r rows of its part (the rest stay zero and add nothing).

Per step the model runner sets `LoRAState.batch`: the rows of the flat batch that use an adapter, grouped
by adapter slot (torch_lora.py). Each stack then adds scaling * B(A x) to those rows of its layer's output,
after the base matmul, as PEFT does. Steps without adapter tokens cost nothing.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from epdserve.kernels import torch_lora


class LoRABatch(NamedTuple):
    """One step's rows that use an adapter, grouped by slot: segment s is token_indices[seg_starts[s]:
    seg_starts[s + 1]], slot seg_slots[s]."""

    token_indices: torch.Tensor  # [M] int64, on the model's device
    seg_starts: list[int]
    seg_slots: list[int]
    # The CPU's batched layout of the segments (torch_lora.padded_layout), where its padding is cheap.
    padded: tuple[torch.Tensor, torch.Tensor, int, int] | None = None


# The padded layout computes (slots spanned) x (longest segment) rows: used while that is at most this many
# times the rows that use an adapter (decode steps, even mixes), else one matmul pair per adapter (a long
# prefill beside a few decodes of other adapters).
MAX_PADDING = 2


def group_by_slot(slot_per_token: torch.Tensor, padded: bool = False) -> LoRABatch | None:
    """[num_tokens] slots (-1: no adapter) -> the step's LoRABatch, None when no token uses an adapter;
    `padded`: with the batched layout when its padding is cheap."""
    order = torch.argsort(slot_per_token, stable=True)
    order = order[slot_per_token[order] >= 0]
    if not order.numel():
        return None
    slots, counts = torch.unique_consecutive(slot_per_token[order], return_counts=True)
    batch = LoRABatch(order, [0] + torch.cumsum(counts, 0).tolist(), slots.tolist())
    spanned = batch.seg_slots[-1] - batch.seg_slots[0] + 1
    if padded and len(batch.seg_slots) > 1 and spanned * int(counts.max()) <= MAX_PADDING * order.numel():
        batch = batch._replace(padded=torch_lora.padded_layout(order, batch.seg_starts, batch.seg_slots))
    return batch


class LoRAState:
    """Shared by every stack of one model; `batch` is written by the model runner before each forward."""

    def __init__(self, max_loras: int, max_rank: int, triton: bool) -> None:
        """`triton`: the Triton kernels (GPUs; on CPU only under the Triton interpreter, for tests), else
        PyTorch's matmuls per adapter."""
        self.max_loras, self.max_rank = max_loras, max_rank
        self.batch: LoRABatch | None = None
        self.triton = triton
        if triton:
            from epdserve.kernels import lora_shrink_expand as ops
        else:
            ops = torch_lora
        self.shrink, self.expand = ops.lora_shrink, ops.lora_expand


class LoRAStack:
    """The adapters' weights of one Linear whose output is `out_sizes` parts side by side."""

    def __init__(self, state: LoRAState, in_features: int, out_sizes: Sequence[int], dtype: torch.dtype,
                 device: torch.device) -> None:
        self.state = state
        self.out_sizes = tuple(out_sizes)
        width = len(out_sizes) * state.max_rank
        self.a = torch.zeros(state.max_loras, width, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(state.max_loras, sum(out_sizes), width, dtype=dtype, device=device)

    def set_slot(self, slot: int, parts: Sequence[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Write an adapter's (A [r, in], B [out_part, r] scaled) for each part (None: not adapted)."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        rank_step, offset = self.state.max_rank, 0
        for p, (size, pair) in enumerate(zip(self.out_sizes, parts)):
            if pair is not None:
                a, b = pair
                r = a.shape[0]
                self.a[slot, p * rank_step:p * rank_step + r] = a
                self.b[slot, offset:offset + size, p * rank_step:p * rank_step + r] = b
            offset += size

    def add_to(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """y [T, out] += the step's adapters applied to x [T, in], on the rows that use one."""
        batch = self.state.batch
        if batch is None:
            return
        x2, y2 = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
        if batch.padded is not None:
            index, valid, lo, _ = batch.padded
            torch_lora.lora_padded(x2, self.a, self.b, index, valid, lo, y2)
            return
        h = self.state.shrink(x2, self.a, batch.token_indices, batch.seg_starts, batch.seg_slots)
        self.state.expand(h, self.b, batch.token_indices, batch.seg_starts, batch.seg_slots, y2)
