"""Copies HF-named checkpoint tensors into a model's parameters: the one place every model here (the language
models, the vision towers and their projectors) loads its weights through. One of our parameters may be
filled by several HF tensors: q/k/v fused into one projection, per-expert MLP weights stacked into one tensor
per layer."""
from __future__ import annotations

import re
from typing import Callable, Iterable

import torch
from torch import nn

from epdserve.shared.models.quantized_weight import QuantizedWeight

# Mixtral's checkpoints name its sparse MLP and its experts' projections otherwise than Qwen3-MoE's (and
# than transformers 5, whose names we use): block_sparse_moe -> mlp; w1, w3, w2 -> gate, up, down.
_MIXTRAL_MOE = re.compile(r"\.block_sparse_moe\.")
_MIXTRAL_EXPERT = re.compile(r"(\.experts\.\d+\.)w([123])\.weight$")
_MIXTRAL_PROJECTIONS = {"1": "gate_proj", "2": "down_proj", "3": "up_proj"}


def our_name(hf_name: str) -> str:
    """The name a language model's checkpoint tensor goes by here."""
    name = _MIXTRAL_MOE.sub(".mlp.", hf_name)
    return _MIXTRAL_EXPERT.sub(lambda m: f"{m[1]}{_MIXTRAL_PROJECTIONS[m[2]]}.weight", name)


def _language_model_name(hf_name: str) -> str | None:
    """our_name; None for the rotary tables some checkpoints save (computed here, never loaded)."""
    name = our_name(hf_name)
    return None if "rotary_emb.inv_freq" in name else name


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]],
                 pieces: dict[str, tuple[str, tuple]] | None = None, skip: set[str] | frozenset[str] = frozenset(),
                 quantizable: frozenset[str] = frozenset(), *,
                 rename: Callable[[str], str | None] = _language_model_name,
                 what: str = "weight") -> dict[str, list[tuple[int, QuantizedWeight]]]:
    """Copy `weights` into `model`'s parameters; every parameter not in `skip` must be written exactly once,
    whole or by its pieces, and every tensor must land in one.

    rename: the name a checkpoint tensor goes by in `model`, or None for one to leave out (by default a
    language model's: our_name). skip: parameters no tensor writes (a tensor of that name is left out).
    pieces: our name of an HF tensor -> (our parameter, the index of that tensor's part in it).
    A QuantizedWeight whose parameter is in `quantizable` is not copied: it is returned, with its pieces' first
    rows, for the layer to pack ({parameter: [(first row, piece), ...]}); any other is written dequantized.
    what: the tensors' kind in error messages ("vision tower weight")."""
    pieces = pieces or {}
    params = dict(model.named_parameters(remove_duplicate=False))
    pending = {name: param.numel() for name, param in params.items() if name not in skip}
    seen: set[str] = set()
    quantized: dict[str, list[tuple[int, QuantizedWeight]]] = {}
    for hf_name, tensor in weights:
        name = rename(hf_name)
        if name is None or name in skip:
            continue
        if name in seen:
            raise ValueError(f"{what} {hf_name!r} appears twice in the checkpoint")
        seen.add(name)
        if name in pieces:
            target, index = pieces[name]
            part = params[target].data[index]
        elif name in params:
            target, index, part = name, (), params[name].data
        else:
            raise ValueError(f"unexpected {what} {hf_name!r} in checkpoint")
        if tuple(tensor.shape) != tuple(part.shape):
            raise ValueError(f"{what} {hf_name} has shape {tuple(tensor.shape)}, does not fit {target} "
                             f"(expected {tuple(part.shape)})")
        if isinstance(tensor, QuantizedWeight) and target in quantizable:
            first = index[0].start if index and isinstance(index[0], slice) else 0
            quantized.setdefault(target, []).append((first or 0, tensor))
        else:
            part.copy_(tensor.dequantize() if isinstance(tensor, QuantizedWeight) else tensor)
        pending[target] -= part.numel()
        if pending[target] == 0:
            del pending[target]
    if pending:
        raise ValueError(f"checkpoint lacks {what}s: {sorted(pending)[:8]}")
    return quantized
