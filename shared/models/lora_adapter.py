"""Reads a PEFT LoRA adapter folder (`adapter_config.json` + `adapter_model.safetensors`) into plain tensors.

No PEFT at run time: the format is small. A LoRA on module W of layer i adds `scaling * B(A x)` to W x,
A [r, in_features], B [out_features, r], scaling = lora_alpha / r (lora_alpha / sqrt(r) with rsLoRA).
Every check that can fail does so here, at load, with a message naming the adapter and what is wrong: a
rank above the engine's limit, a tensor whose shape is not this base model's (an adapter trained on
another base), a module we do not adapt, a PEFT feature we do not implement, an unreadable file, a file
above the size limit, weights that are not finite numbers (NaN or infinity would poison every logit).
The weights file's size is checked before anything is read (--max-lora-bytes), then safetensors reads its
header and each tensor from a memory map - no copy of the whole file in memory besides the tensors; with
`roots` (a service's --lora-root folders) the folder and its files must lie inside them (lora_roots.py).
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from epdserve.shared.config import DTYPE_BYTES, LoRAConfig, ModelConfig
from epdserve.shared.models.lora_roots import LoRARoots

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_MAX_BYTES = 1 << 20  # an adapter_config.json is a few hundred bytes
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
logger = logging.getLogger(__name__)
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served on this base model (the message says why)."""


@dataclass(frozen=True, slots=True)
class LoRAAdapter:
    name: str
    path: str
    rank: int
    # Stable across processes for the same files: keys the adapter's KV in the prefix cache, so an adapter
    # reloaded under the same name with other weights never meets the old one's blocks.
    digest: str
    # (layer, module) -> (A [r, in], B [out, r] times the scaling), in float32.
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each adaptable module's (in_features, out_features) on this base model."""
    h, q, kv, inter = config.hidden_size, config.num_heads * config.head_size, \
        config.num_kv_heads * config.head_size, config.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}


def slot_bytes(config: ModelConfig, lora: LoRAConfig) -> int:
    """Memory the model's adapter slots take (layers/lora.py: per adapted layer A [max_loras, parts * rank, in]
    and B [max_loras, out, parts * rank]; q/k/v are one layer of three parts, the experts none)."""
    shapes, r = module_shapes(config), lora.max_lora_rank
    h = config.hidden_size
    qkv_out = sum(shapes[m][1] for m in ("q_proj", "k_proj", "v_proj"))
    per_layer = 3 * r * (h + qkv_out) + r * sum(shapes["o_proj"])
    num_dense = config.num_layers - (len(config.moe.sparse_layers) if config.moe is not None else 0)
    mlp = r * sum(sum(shapes[m]) for m in ("gate_proj", "up_proj", "down_proj"))
    return lora.max_loras * (config.num_layers * per_layer + num_dense * mlp) * DTYPE_BYTES[config.dtype_name]


def load_lora_adapter(name: str, path: str | Path, config: ModelConfig, max_rank: int,
                      max_bytes: int | None = None, roots: LoRARoots | None = None) -> LoRAAdapter:
    """Read and check the adapter at `path` for the base model `config`; raises LoRAAdapterError.
    `max_bytes`: the largest weights file read (None: any); `roots`: the folders it must lie inside (None:
    anywhere, for adapters the operator names)."""
    folder = Path(path)
    if roots is not None:
        try:
            folder = roots.folder(str(path))
        except ValueError as exc:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: {exc}") from None
    settings = _read_config(name, folder, roots)
    rank = settings.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:  # JSON's true is no rank
        raise LoRAAdapterError(f"LoRA adapter {name!r}: 'r' in {CONFIG_FILE} must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoRAAdapterError(f"LoRA adapter {name!r} has rank {rank}, above this server's max_lora_rank {max_rank}")
    alpha = settings.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise LoRAAdapterError(f"LoRA adapter {name!r}: 'lora_alpha' must be a number, got {alpha!r}")
    scaling = alpha / math.sqrt(rank) if settings.get("use_rslora") else alpha / rank
    weights, digest = _read_weights(name, folder, roots, max_bytes,
                                    lambda tensors: _pair_up(name, tensors, config, settings, rank, scaling))
    _note_base_name(name, settings.get("base_model_name_or_path"), config)
    return LoRAAdapter(name, str(Path(path)), rank, digest, weights)


def _note_base_name(name: str, base: object, config: ModelConfig) -> None:
    """A base named otherwise is only warned about: names are paths or hub ids that differ for one model (a
    copy, a mirror), and an adapter of another base with this one's shapes is the user's call. Shapes that
    differ are refused (_pair_up)."""
    if not isinstance(base, str) or not base:
        return
    ours = {Path(config.path).name, Path(config.model_id).name, config.model_id}
    if Path(base).name not in ours and base not in ours:
        logger.warning("LoRA adapter %s was trained on %r; this model is %r (shapes match: serving it)", name, base,
                       config.model_id)


def _file(name: str, folder: Path, file_name: str, roots: LoRARoots | None, max_bytes: int | None) -> Path:
    """`folder`'s file `file_name`, a regular file (inside `roots`, links resolved) of at most `max_bytes`."""
    file = folder / file_name
    if not file.is_file() or (roots is not None and not roots.contains(file)):
        raise LoRAAdapterError(f"LoRA adapter {name!r}: no {file_name} in {str(folder)!r}")
    size = os.stat(file).st_size
    if max_bytes is not None and size > max_bytes:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {file_name} is {size} bytes, above the {max_bytes} this "
                               f"server reads (--max-lora-bytes)")
    return file


def _read_config(name: str, folder: Path, roots: LoRARoots | None) -> dict:
    file = _file(name, folder, CONFIG_FILE, roots, CONFIG_MAX_BYTES)
    try:
        settings = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {CONFIG_FILE} is not readable JSON ({exc})") from None
    if not isinstance(settings, dict):
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {CONFIG_FILE} must hold a JSON object")
    if settings.get("peft_type", "LORA") != "LORA":
        raise LoRAAdapterError(f"LoRA adapter {name!r}: peft_type {settings['peft_type']!r} is not LORA")
    # PEFT features that change the arithmetic: refused rather than served wrongly.
    unsupported = {
        "use_dora": bool(settings.get("use_dora")), "modules_to_save": bool(settings.get("modules_to_save")),
        "bias": settings.get("bias", "none") != "none", "fan_in_fan_out": bool(settings.get("fan_in_fan_out")),
        **{key: bool(settings.get(key)) for key in ("rank_pattern", "alpha_pattern", "lora_bias", "target_parameters",
                                                     "trainable_token_indices", "use_qalora", "use_bdlora")}}
    if any(unsupported.values()):
        names = ", ".join(k for k, v in unsupported.items() if v)
        raise LoRAAdapterError(f"LoRA adapter {name!r} uses {names}, which this server does not support")
    return settings


def _read_weights(name: str, folder: Path, roots: LoRARoots | None, max_bytes: int | None, pair_up):
    """(`pair_up` of the file's tensors, the adapter's digest). safetensors reads the header, then each tensor
    from a memory map of the file; the digest hashes the file in chunks."""
    from safetensors import SafetensorError, safe_open

    file = _file(name, folder, WEIGHTS_FILE, roots, max_bytes)
    try:
        with safe_open(file, framework="pt", device="cpu") as f:
            tensors = {key: f.get_tensor(key) for key in f.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} is corrupt ({exc})") from None
    weights = pair_up(tensors)
    del tensors
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    digest.update((folder / CONFIG_FILE).read_bytes())
    return weights, digest.hexdigest()[:32]


def _pair_up(name: str, tensors: dict[str, torch.Tensor], config: ModelConfig, settings: dict, rank: int,
             scaling: float) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    shapes = module_shapes(config)
    targets = settings.get("target_modules")
    listed = set(targets) if isinstance(targets, list) else None
    sparse = set(config.moe.sparse_layers) if config.moe is not None else set()
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA weight of a decoder "
                                   f"layer's {'/'.join(TARGET_MODULES)}")
        layer, module, half = int(match[1]), match[2], match[3]
        if module not in shapes or (listed is not None and module not in listed):
            raise LoRAAdapterError(f"LoRA adapter {name!r}: module {module!r} is not one it targets among "
                                   f"{'/'.join(TARGET_MODULES)}")
        if not 0 <= layer < config.num_layers:
            raise LoRAAdapterError(f"LoRA adapter {name!r} adapts layer {layer}; the base model has "
                                   f"{config.num_layers} layers (an adapter for another base model?)")
        if layer in sparse and module in ("gate_proj", "up_proj", "down_proj"):
            raise LoRAAdapterError(f"LoRA adapter {name!r} adapts {module} of layer {layer}, a mixture-of-experts "
                                   f"layer: not supported")
        halves.setdefault((layer, module), {})[half] = tensor
    if not halves:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    weights = {}
    for (layer, module), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: layer {layer} {module} lacks lora_{'AB'[('A' in pair)]}")
        in_features, out_features = shapes[module]
        a, b = pair["A"], pair["B"]
        if tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (out_features, rank):
            raise LoRAAdapterError(
                f"LoRA adapter {name!r}: layer {layer} {module} has A {tuple(a.shape)} and B {tuple(b.shape)}; this "
                f"base model needs A ({rank}, {in_features}) and B ({out_features}, {rank}) (an adapter for "
                f"another base model?)")
        a, b = a.float(), b.float() * scaling
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise LoRAAdapterError(f"LoRA adapter {name!r}: layer {layer} {module} holds weights that are not "
                                   f"finite numbers (NaN or infinity)")
        weights[layer, module] = (a, b)
    return weights
