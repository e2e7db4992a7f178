"""Reads HF checkpoints: `config.json` plus `*.safetensors`, one file or sharded with an index; or, where the
folder holds the GGUF file it was converted from (GGUF_WEIGHTS), the weights as that file ships them."""
from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from safetensors import safe_open

if TYPE_CHECKING:
    import torch

    from epdserve.shared.models.quantized_weight import QuantizedWeight

logger = logging.getLogger(__name__)

SHARD_INDEX = "model.safetensors.index.json"
# A folder converted from a GGUF file keeps the file under this name: the engine serves its weights as they
# ship (quantized), HF reads the dequantized model.safetensors beside it - the same values.
GGUF_WEIGHTS = "model.gguf"


def safetensors_files(folder: str | Path) -> list[Path]:
    folder = Path(folder)
    index = folder / SHARD_INDEX
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / n for n in names]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {str(folder)!r}")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"checkpoint shards missing: {missing}")
    return files


def iterate_weights(folder: str | Path, prefixes: tuple[str, ...] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor of the checkpoint (only names starting with one of `prefixes`,
    if given: the others are never read), one shard open at a time."""
    for path in safetensors_files(folder):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if prefixes is None or name.startswith(prefixes):
                    yield name, f.get_tensor(name)


def checkpoint_weights(folder: str | Path) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """The language model's weights under causal-LM names: from the folder's GGUF file where it has one
    (quantized linear layers as QuantizedWeight), else from its safetensors."""
    gguf = Path(folder) / GGUF_WEIGHTS
    if gguf.is_file():
        from epdserve.shared.models.gguf_weights import gguf_weights

        try:
            return _fitted_to_folder(gguf_weights(gguf), folder)
        except ValueError as exc:
            logger.warning("%s; serving its dequantized weights (model.safetensors)", exc)
    return language_model_weights(iterate_weights(folder))


# What `--quantization` takes (vLLM's spelling): gguf, the weights a GGUF file ships (served so whenever the folder
# holds one), and int8, a float checkpoint's dense linear layers quantized at load.
QUANTIZATIONS = ("gguf", "int8")


def check_quantization(quantization: str | None, folder: str | Path) -> None:
    """Raises ValueError, naming the method and why, where `--quantization` cannot apply to the model folder."""
    if quantization is None:
        return
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"--quantization {quantization} is not supported here; choose one of "
                         f"{', '.join(QUANTIZATIONS)}")
    ships_gguf = (Path(folder) / GGUF_WEIGHTS).is_file()
    if quantization == "gguf" and not ships_gguf:
        raise ValueError(f"--quantization gguf: {folder} holds no GGUF file; give --model FILE.gguf")
    if quantization == "int8" and ships_gguf:
        raise ValueError(f"--quantization int8: {folder} ships quantized weights (its GGUF file), served as they "
                         "ship; int8 quantizes a float checkpoint")


# The dense linear layers `--quantization int8` quantizes (the embedding, norms, router and experts stay float).
INT8_LINEARS = tuple(f"{name}.weight" for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                       "down_proj"))


def checkpoint_weights_int8(folder: str | Path) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """The float checkpoint's weights with its dense linear layers quantized to int8 per output channel, as they
    are read (`QuantizedWeight.int8_per_channel`)."""
    from epdserve.shared.models.quantized_weight import QuantizedWeight

    for name, tensor in checkpoint_weights(folder):
        if name.endswith(INT8_LINEARS) and ".experts." not in name and tensor.dim() == 2:
            tensor = QuantizedWeight.int8_per_channel(tensor)
        yield name, tensor


def _fitted_to_folder(weights: Iterator[tuple[str, torch.Tensor | QuantizedWeight]],
                      folder: str | Path) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """The GGUF file's tensors, each checked against the folder's: a folder built on the file may have added
    rows since (the demo's <image> token: a zero row of the embedding), which the file's tensor gets as zero
    rows too, once the folder's are seen to be zero; any other difference is an error."""
    import torch

    from epdserve.shared.models.quantized_weight import QuantizedWeight

    with contextlib.ExitStack() as files:
        slices = {}
        for path in safetensors_files(folder):
            f = files.enter_context(safe_open(str(path), framework="pt"))
            slices.update((name, (f, key)) for key in f.keys() if (name := _language_model_name(key)))
        for name, tensor in weights:
            if name not in slices:
                yield name, tensor  # the loader names what the model has no parameter for
                continue
            f, key = slices[name]
            shape, rows = tuple(f.get_slice(key).get_shape()), tensor.shape[0]
            if shape != tuple(tensor.shape):
                added = f.get_slice(key)[rows:] if shape[1:] == tuple(tensor.shape[1:]) and shape[0] > rows else None
                if added is None or torch.count_nonzero(added):
                    raise ValueError(f"{name}: {tuple(tensor.shape)} in {GGUF_WEIGHTS} but {shape} in the folder's "
                                     "safetensors")
                tensor = (tensor.with_zero_rows(shape[0] - rows) if isinstance(tensor, QuantizedWeight)
                          else torch.cat([tensor, tensor.new_zeros(shape[0] - rows, *shape[1:])]))
            yield name, tensor


# Where a multimodal checkpoint keeps its language model (older and newer transformers layouts), and the
# parts that belong to the encoder instead.
_TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                  ("language_model.lm_head.", "lm_head."))
_ENCODER_PREFIXES = ("vision_tower.", "model.vision_tower.", "multi_modal_projector.", "model.multi_modal_projector.",
                     "visual.", "model.visual.")


def _language_model_name(name: str) -> str | None:
    """A checkpoint tensor's causal-LM name; None for an encoder's."""
    if name.startswith(_ENCODER_PREFIXES):
        return None
    for old, new in _TEXT_PREFIXES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def language_model_weights(weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The language model's tensors under causal-LM names; encoder tensors are left out."""
    return ((lm_name, tensor) for name, tensor in weights if (lm_name := _language_model_name(name)) is not None)
