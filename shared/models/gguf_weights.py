"""A GGUF checkpoint's tensors under HF names: the linear layers' weights quantized as they ship
(QuantizedWeight), everything else as float32 tensors - the values transformers' GGUF conversion writes,
bit for bit (tests/integration/test_gguf_serving.py and test_gemma3_270m.py hold each against the converted
folder).

llama.cpp's converter stores a Llama's q and k projections with their rows permuted (its RoPE pairs
neighbouring features) and Gemma's norm weights plus one; both are undone here, as transformers does.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from epdserve.shared.models.gguf_file import GGUFFile, GGUFTensor
from epdserve.shared.models.gguf_quants import FORMATS, split_blocks, to_float32
from epdserve.shared.models.quantized_weight import QuantizedWeight

ARCHITECTURES = ("llama", "gemma3")

_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
          "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj"}
# The norm after attention, and the MLP's: a Llama has one (before the MLP), Gemma 3 three.
_LAYER_NORMS = {"llama": {"ffn_norm": "post_attention_layernorm"},
                "gemma3": {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                           "post_ffw_norm": "post_feedforward_layernorm"}}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
# Linear layers: the ones the quantized kernel runs.
_LINEAR = {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "output", "token_embd"}


def architecture(f: GGUFFile) -> str:
    arch = f.metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{f.path}: GGUF architecture {arch!r} is not served from the file "
                         f"({', '.join(ARCHITECTURES)} are)")
    return arch


def hf_name(arch: str, gguf_name: str) -> str | None:
    """The HF name of a GGUF tensor, None for one HF has no tensor for (rope_freqs: computed)."""
    stem, _, kind = gguf_name.rpartition(".")
    if stem in _GLOBAL:
        return f"{_GLOBAL[stem]}.{kind}"
    m = _BLOCK.match(gguf_name)
    if m is None:
        return None
    part = _LAYER.get(m[2]) or _LAYER_NORMS[arch].get(m[2])
    return None if part is None else f"model.layers.{m[1]}.{part}.{m[3]}"


def _unpermute_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order -> HF's (per head: the two halves of each rotary pair interleaved back)."""
    shape = rows.shape
    return rows.reshape(heads, shape[0] // heads // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _tensor(arch: str, t: GGUFTensor, heads: dict[str, int]) -> torch.Tensor | QuantizedWeight:
    m = _BLOCK.match(t.name)
    stem = m[2] if m else t.name.rpartition(".")[0]
    permute = heads.get(stem) if arch == "llama" else None
    if FORMATS[t.type].split is not None and stem in _LINEAR and len(t.shape) == 2:
        n, k = t.shape
        g = split_blocks(t.type, t.data, t.shape)
        q = g.q.reshape(n, k).astype(np.int8)
        scale = g.scale.reshape(n, -1)
        offset = None if g.offset is None else g.offset.reshape(n, -1)
        if permute:
            q, scale = _unpermute_rows(q, permute), _unpermute_rows(scale, permute)
            offset = None if offset is None else _unpermute_rows(offset, permute)
        return QuantizedWeight(torch.from_numpy(np.ascontiguousarray(q)), torch.from_numpy(np.ascontiguousarray(scale)),
                               None if offset is None else torch.from_numpy(np.ascontiguousarray(offset)))
    w = to_float32(t.type, t.data, t.shape)
    if permute:
        w = _unpermute_rows(w, permute)
    if arch == "gemma3" and t.name.endswith("norm.weight"):
        w = w - np.float32(1)
    return torch.from_numpy(np.ascontiguousarray(w))


def gguf_weights(path: str | Path) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """(HF name, tensor) for every tensor of the GGUF file that HF has; ValueError (at once, not when
    iterated) for an architecture not served from the file."""
    f = GGUFFile(path)
    arch = architecture(f)
    heads = {"attn_q": int(f.metadata[f"{arch}.attention.head_count"])}
    heads["attn_k"] = int(f.metadata.get(f"{arch}.attention.head_count_kv", heads["attn_q"]))
    return ((name, _tensor(arch, t, heads)) for t in f.tensors.values() if (name := hf_name(arch, t.name)))
