"""LoRA on the decoder's linear layers: every resident adapter's weights stacked per layer, applied to a
batch that mixes adapters and none.

Each adaptable Linear gets a `LoRAStack`: A [max_loras, parts * max_rank, in], B [max_loras, out, parts *
max_rank], one slot per resident adapter, zero where an adapter has no weights. A fused projection (QKV)
has one part per HF module; its B is block-diagonal, so one shrink and one expand cover q, k and v. An
adapter of rank r < max_rank fills the first r rows of its part (the rest stay zero and add nothing).

Per step the model runner sets `LoRAState.batch`: the rows of the flat batch that use an adapter, grouped
by adapter slot (torch_lora.py). Each stack then adds scaling * B(A x) to those rows of its layer's output,
after the base matmul, as PEFT does. Steps without adapter tokens cost nothing.

On CPU a token's adapter arithmetic is batch-invariant, as the base layers' is (kernels/cpu_linear.py): a
matmul library's result for a row depends on how many rows it is given and where they sit, so the same
request computed beside other requests would get other bits in its logits - and a seeded request, sampling
from them, other tokens. So the CPU multiplies each adapter's rows by that adapter's A and B with the packed
linear kernel (each output one chain of multiply-adds over its inputs, in order, whatever the batch), in
float32, and adds the result to the base output once: a token's bits are the same alone and in any batch.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from epdserve.kernels import cpu_linear, torch_lora


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
        # The CPU's batch-invariant path (see above), where the packed linear kernel runs.
        self.invariant = not triton and cpu_linear.supports(torch.float32)
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
        self.invariant = state.invariant and self.a.device.type == "cpu"
        # slot -> its A and B packed (float32) for the batch-invariant path, packed on first use after set_slot.
        self._panels: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def set_slot(self, slot: int, parts: Sequence[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Write an adapter's (A [r, in], B [out_part, r] scaled) for each part (None: not adapted)."""
        self._panels.pop(slot, None)
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
        if self.invariant:
            self._add_invariant(x2, y2, batch)
            return
        if batch.padded is not None:
            index, valid, lo, _ = batch.padded
            torch_lora.lora_padded(x2, self.a, self.b, index, valid, lo, y2)
            return
        h = self.state.shrink(x2, self.a, batch.token_indices, batch.seg_starts, batch.seg_slots)
        self.state.expand(h, self.b, batch.token_indices, batch.seg_starts, batch.seg_slots, y2)

    def _add_invariant(self, x: torch.Tensor, y: torch.Tensor, batch: LoRABatch) -> None:
        """add_to on CPU, each row's delta the same bits whatever the batch: gathered (exact), through the
        packed kernel per adapter, added once."""
        whole = len(batch.seg_slots) == 1 and batch.token_indices.numel() == x.shape[0]
        for s, slot in enumerate(batch.seg_slots):
            lo, hi = batch.seg_starts[s], batch.seg_starts[s + 1]
            panels = self._panels.get(slot)
            if panels is None:
                panels = self._panels[slot] = (cpu_linear.pack(self.a[slot].float()),
                                               cpu_linear.pack(self.b[slot].float()))
            rows = x if whole else x.index_select(0, batch.token_indices[lo:hi])
            h = cpu_linear.linear(rows.float(), panels[0], self.a.shape[1], None)
            delta = cpu_linear.linear(h, panels[1], self.b.shape[1], None).to(y.dtype)
            if whole:
                y.add_(delta)
            else:
                y.index_add_(0, batch.token_indices[lo:hi], delta)
