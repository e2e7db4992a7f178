"""CLIP vision transformer: the image tower of LLaVA-style models.

Pixels are cut into non-overlapping patches by a strided convolution; a learned class embedding is
prepended and learned position embeddings added; a pre-layernorm follows; then pre-norm encoder layers
(bidirectional attention, MLP). A LLaVA model reads the hidden states of one inner layer, so only the
layers up to the deepest one read are built, loaded and run. Numerics follow HF transformers'
`CLIPVisionModel` (SDPA attention at scale head_size**-0.5, LayerNorm in the model dtype).
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from epdserve.shared.models.layers.linear import Linear
from epdserve.shared.models.weight_loader import load_weights
from epdserve.shared.processing.vision_config import ACTIVATION_NAMES, CLIPVisionConfig, check_activation


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


# HF activation names -> functions computing what HF's ACT2FN entries compute.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "quick_gelu": quick_gelu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}


assert set(ACTIVATIONS) == set(ACTIVATION_NAMES)


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    check_activation(name)
    return ACTIVATIONS[name]


class CLIPAttention(nn.Module):
    def __init__(self, config: CLIPVisionConfig) -> None:
        super().__init__()
        self.num_heads, self.head_size = config.num_heads, config.head_size
        self.scale = config.head_size ** -0.5
        # q, k and v stacked in one matmul (rows in that order); loaded from HF's three projections.
        self.qkv_proj = Linear(config.hidden_size, 3 * config.hidden_size)
        self.out_proj = Linear(config.hidden_size, config.hidden_size)

    def checkpoint_pieces(self, prefix: str) -> dict[str, tuple[str, tuple]]:
        """HF's q/k/v projections (weights and biases) -> (our fused parameter, rows in it)."""
        hidden = self.num_heads * self.head_size
        return {f"{prefix}{part}.{kind}": (f"{prefix}qkv_proj.{kind}", (slice(i * hidden, (i + 1) * hidden),))
                for i, part in enumerate(("q_proj", "k_proj", "v_proj")) for kind in ("weight", "bias")}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, seq, hidden = x.shape
        # [n, seq, 3 * hidden] -> 3 x [n, num_heads, seq, head_size]
        q, k, v = self.qkv_proj(x).view(n, seq, 3, self.num_heads, self.head_size).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, scale=self.scale)
        return self.out_proj(o.transpose(1, 2).reshape(n, seq, hidden))


class CLIPMLP(nn.Module):
    def __init__(self, config: CLIPVisionConfig) -> None:
        super().__init__()
        self.act = get_activation(config.hidden_act)
        self.fc1 = Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class CLIPEncoderLayer(nn.Module):
    def __init__(self, config: CLIPVisionConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = CLIPAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = CLIPMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPVisionEmbeddings(nn.Module):
    def __init__(self, config: CLIPVisionConfig) -> None:
        super().__init__()
        self.config = config
        self.class_embedding = nn.Parameter(torch.empty(config.hidden_size))
        self.patch_embedding = nn.Conv2d(config.num_channels, config.hidden_size, config.patch_size,
                                         stride=config.patch_size, bias=False)
        self.position_embedding = nn.Embedding(config.num_positions, config.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        # [n, C, H, W] -> [n, hidden, H / patch, W / patch] -> [n, num_patches, hidden], patches row-major
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight  # [n, num_positions, hidden]


class CLIPVisionTransformer(nn.Module):
    """The first `num_layers` encoder layers of a CLIP vision model (its post-layernorm is never read)."""

    def __init__(self, config: CLIPVisionConfig, num_layers: int | None = None) -> None:
        super().__init__()
        num_layers = config.num_layers if num_layers is None else num_layers
        if not 0 <= num_layers <= config.num_layers:
            raise ValueError(f"cannot build {num_layers} of the tower's {config.num_layers} layers")
        self.config = config
        self.embeddings = CLIPVisionEmbeddings(config)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)  # HF's spelling
        self.layers = nn.ModuleList(CLIPEncoderLayer(config) for _ in range(num_layers))

    def forward(self, pixel_values: torch.Tensor, hidden_state_ids: Iterable[int]) -> list[torch.Tensor]:
        """Hidden states [n, num_positions, hidden] at the given indices, in their order.

        Index 0 is the pre-layernormed embeddings, index i the output of layer i (HF's `hidden_states`)."""
        wanted = list(hidden_state_ids)
        if any(not 0 <= i <= len(self.layers) for i in wanted):
            raise ValueError(f"hidden state indices {wanted} outside 0..{len(self.layers)}")
        x = self.pre_layrnorm(self.embeddings(pixel_values))
        found = {0: x}
        for i, layer in enumerate(self.layers[:max(wanted, default=0)], start=1):
            x = layer(x)
            found[i] = x
        return [found[i] for i in wanted]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors (relative to the tower: `embeddings.`, `encoder.layers.N.`, ...) into our
        parameters. Layers past the ones built and the unused post-layernorm are skipped; every parameter
        must be written."""
        pieces = {}
        for i, layer in enumerate(self.layers):
            pieces.update(layer.self_attn.checkpoint_pieces(f"layers.{i}.self_attn."))
        load_weights(self, weights, pieces, rename=self._our_name, what="vision tower weight")
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()

    def _our_name(self, hf_name: str) -> str | None:
        """The name a tower tensor goes by here; None for those not loaded."""
        name = hf_name.removeprefix("vision_model.").replace("encoder.layers.", "layers.")
        if name.startswith("post_layernorm.") or name.endswith("position_ids"):
            return None
        layer = name.split(".")[1] if name.startswith("layers.") else ""
        return None if layer.isdigit() and int(layer) >= len(self.layers) else name
