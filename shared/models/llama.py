"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3, Qwen3-MoE, Mixtral, Gemma 3, and the
language model of Qwen2.5-VL) over the paged KV cache.

The families differ only where ModelConfig says so: biases, per-head query/key RMSNorm (Qwen3, Gemma 3), a
sparse mixture-of-experts MLP in some or all layers (Qwen3-MoE, Mixtral; layers/sparse_moe.py), a sliding
window on some or all layers, and Gemma 3's ways: scaled embeddings, (1 + weight) RMSNorms, four norms a
layer, a GeGLU MLP, its own attention scale, a second RoPE for the sliding layers, soft-capped logits; and
Qwen2.5-VL's M-RoPE, which rotates by three positions per token (layers/rotary_embedding.py).
Numerics follow HF transformers (float32 RMSNorm, rotate-half RoPE, residuals in the model dtype), so
greedy float32 output matches `generate` token for token. The Q/K/V projections are fused into one
matmul: on CPU a batch-64 decode step is a handful of small matmuls per layer, and fewer, larger ones
run closer to the machine's peak.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from epdserve.kernels import cpu_layer_ops
from epdserve.shared.config import LoRAConfig, ModelConfig
from epdserve.shared.models.layers.attention import Attention, AttentionMetadata
from epdserve.shared.models.layers.linear import Linear
from epdserve.shared.models.layers.lora import LoRAStack, LoRAState
from epdserve.shared.models.layers.quantized_embedding import QuantizedEmbedding
from epdserve.shared.models.layers.rms_norm import RMSNorm
from epdserve.shared.models.layers.rotary_embedding import RotaryEmbedding
from epdserve.shared.models.layers.sparse_moe import Experts, SparseMoE
from epdserve.shared.models.quantized_weight import QuantizedWeight
from epdserve.shared.models.weight_loader import load_weights


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_size = config.num_heads, config.num_kv_heads, config.head_size
        self.q_size = self.num_heads * self.head_size
        self.kv_size = self.num_kv_heads * self.head_size
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_size, config.layer_sliding_window(layer_id),
                              config.attention_scale)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_size, config.rms_norm_eps, config.unit_offset_norms)
            self.k_norm = RMSNorm(self.head_size, config.rms_norm_eps, config.unit_offset_norms)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:  # each head on its own: [num_tokens * heads, head_size]
            q, k = self.q_norm(q.reshape(-1, self.head_size)), self.k_norm(k.reshape(-1, self.head_size))
        q = q.view(-1, self.num_heads, self.head_size)
        k = k.view(-1, self.num_kv_heads, self.head_size)
        v = v.view(-1, self.num_kv_heads, self.head_size)
        q, k = RotaryEmbedding.apply(rope, q, k)
        o = self.attn(q, k, v, meta)
        return self.o_proj(o.view(-1, self.q_size))

    def checkpoint_pieces(self, prefix: str) -> dict[str, tuple[str, tuple]]:
        """HF's q/k/v projections (weights and biases) -> (our fused parameter, rows in it)."""
        sizes = {"q_proj": self.q_size, "k_proj": self.kv_size, "v_proj": self.kv_size}
        pieces, offset = {}, 0
        for part, size in sizes.items():
            for kind in ("weight", "bias") if self.qkv_proj.bias is not None else ("weight",):
                pieces[f"{prefix}{part}.{kind}"] = (f"{prefix}qkv_proj.{kind}", (slice(offset, offset + size),))
            offset += size
        return pieces


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # Two projections rather than one fused: on CPU one matmul of twice the width measured no faster
        # (oneDNN, 64 and 2048 rows).
        self.gate_proj = Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.up_proj = Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.gelu = config.hidden_act == "gelu_pytorch_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gelu:  # GeGLU (Gemma 3): HF's act(gate) * up, in the model dtype
            return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh").mul_(self.up_proj(x)))
        return self.down_proj(cpu_layer_ops.silu_mul_(self.gate_proj(x), self.up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id)
        is_sparse = config.moe is not None and layer_id in config.moe.sparse_layers
        self.mlp = SparseMoE(config) if is_sparse else LlamaMLP(config)
        # Which RoPE table the layer's attention rotates by (the sliding layers' own, where they have one).
        self.local_rope = config.sliding_rope_theta is not None and config.is_sliding_layer(layer_id)

        def norm() -> RMSNorm:
            return RMSNorm(config.hidden_size, config.rms_norm_eps, config.unit_offset_norms)

        self.input_layernorm = norm()
        # Llama's pre-MLP norm; with sandwich norms (Gemma) the attention output's, under HF's same name.
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm() if config.sandwich_norms else None
        self.post_feedforward_layernorm = norm() if config.sandwich_norms else None

    def fused_form(self) -> dict | None:
        """This layer as cpu_layer_ops.decoder_stack takes it, or None where it does not run on the CPU kernels (a
        sparse MLP, LoRA, another attention backend, a linear layer off the panel kernels)."""
        attn, mlp = self.self_attn, self.mlp
        backend = attn.attn.backend
        if not isinstance(mlp, LlamaMLP) or backend is None or backend.name != "cpu":
            return None
        keys, values = attn.attn.key_cache.transpose(1, 2), attn.attn.value_cache.transpose(1, 2)
        if not (keys.is_contiguous() and values.is_contiguous()):
            return None
        dtype = self.input_layernorm.weight.dtype
        linears = {"qkv": attn.qkv_proj, "o": attn.o_proj, "gate": mlp.gate_proj, "up": mlp.up_proj,
                   "down": mlp.down_proj}
        weights = {name: linear.panel_weight(dtype) for name, linear in linears.items()}
        norms = {"input_norm": self.input_layernorm, "post_attention_norm": self.post_attention_layernorm,
                 "q_norm": attn.q_norm, "k_norm": attn.k_norm, "pre_feedforward_norm": self.pre_feedforward_layernorm,
                 "post_feedforward_norm": self.post_feedforward_layernorm}
        if None in weights.values() or any(n is not None and n.weight.dtype != dtype for n in norms.values()):
            return None
        # The gate and up projections in one call where their panels allow it (up None: gate's output holds both).
        if gate_up := Linear.joined_panel_weight(mlp.gate_proj, mlp.up_proj, dtype):
            weights.update(gate=gate_up, up=None)
        return dict(**{k: None if n is None else n.weight for k, n in norms.items()},
                    unit_offset=self.input_layernorm.unit_offset, gelu=mlp.gelu, local_rope=self.local_rope, **weights,
                    num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads, head_size=attn.head_size,
                    scale=attn.attn.scale, sliding_window=attn.attn.sliding_window or -1, key_cache=keys,
                    value_cache=values)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, delta: torch.Tensor | None,
                meta: AttentionMetadata) -> torch.Tensor:
        """x: the residual stream, updated in place; delta: what the layer before adds to it (None for the
        first). Returns what this layer adds: each add happens inside the RMSNorm that follows it."""
        attn_out = self.self_attn(rope, self.input_layernorm(x, delta), meta)
        if self.pre_feedforward_layernorm is None:
            return self.mlp(self.post_attention_layernorm(x, attn_out))
        hidden = self.pre_feedforward_layernorm(x, self.post_attention_layernorm(attn_out))
        return self.post_feedforward_layernorm(self.mlp(hidden))


class LlamaModel(nn.Module):
    # Every layer in one C++ call a step (fuse_layers), and where its attention calls' seconds go.
    decoder_stack = None
    attention_seconds: Callable[[float], None] | None = None

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        # Gemma scales embeddings by a float32 scalar rounded to the model dtype (HF: sqrt(3072) is 55.5 in
        # bfloat16); a buffer, not a weight.
        scale = None
        if config.embedding_scale is not None:
            scale = torch.tensor(config.embedding_scale, dtype=torch.float32).to(config.dtype)
        self.register_buffer("embed_scale", scale, persistent=False)
        # One RoPE table shared by all layers; the sliding layers' own second one where they have it (Gemma 3).
        self.rotary = RotaryEmbedding(config.head_size, config.max_model_len, config.rope_theta,
                                      config.rope_scaling, config.dtype, config.mrope_section)
        self.local_rotary = None
        if config.sliding_rope_theta is not None:
            self.local_rotary = RotaryEmbedding(config.head_size, config.max_model_len, config.sliding_rope_theta,
                                                config.sliding_rope_scaling, config.dtype)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.unit_offset_norms)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x if self.embed_scale is None else x * self.embed_scale

    def fuse_layers(self, attention_seconds: Callable[[float], None]) -> bool:
        """Run the layers as one C++ call a step (cpu_layer_ops.decoder_stack: the kernels the Python layers call, in
        the same order on the same tensors, so the same values bit for bit) where every layer is dense and runs on
        the CPU kernels; a decode step of a small model is then mostly its weights' reads, not Python's
        dispatch between ops. `attention_seconds(s)` is told, each step, what its attention calls took. False
        (the Python layers run) where a layer cannot be fused, after the KV cache is bound."""
        forms = [layer.fused_form() for layer in self.layers]
        if not forms or None in forms or len({n.eps for n in self.modules() if isinstance(n, RMSNorm)}) != 1:
            return False
        self.decoder_stack = cpu_layer_ops.decoder_stack(self.norm.eps, forms)
        self.attention_seconds = attention_seconds
        return self.decoder_stack is not None

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, meta: AttentionMetadata,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """positions: [num_tokens], or [3, num_tokens] with M-RoPE."""
        # The residual stream, updated in place: never the caller's tensor.
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds.clone()
        rope = self.rotary.lookup(positions)
        local_rope = rope if self.local_rotary is None else self.local_rotary.lookup(positions)
        if self.decoder_stack is not None:
            plan = next(iter(meta.plans.values()))  # the cpu backend's one plan serves every window
            delta, seconds = self.decoder_stack.forward(x, *rope, *local_rope, meta.slot_mapping, plan.table,
                                                        plan.table_rows, plan.lens)
            self.attention_seconds(seconds)
            return self.norm(x, delta)
        delta = None
        for layer in self.layers:
            delta = layer(local_rope if layer.local_rope else rope, x, delta, meta)
        return self.norm(x, delta)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, meta: AttentionMetadata,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, meta, inputs_embeds)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed(input_ids)

    def fuse_layers(self, attention_seconds: Callable[[float], None]) -> bool:
        return self.model.fuse_layers(attention_seconds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # Logits in the model dtype (soft-capped there, where the config says so), then float32, as HF
        # generate takes them.
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def enable_lora(self, lora: LoRAConfig, triton: bool) -> LoRAState:
        """Give every adaptable linear layer its slots of stacked adapter weights (all zero: no adapter);
        `triton`: apply them with the Triton kernels."""
        weight = self.lm_head.weight
        state = LoRAState(lora.max_loras, lora.max_lora_rank, triton)
        for layer in self.model.layers:
            attn = layer.self_attn
            attn.qkv_proj.lora = LoRAStack(state, attn.qkv_proj.in_features,
                                           (attn.q_size, attn.kv_size, attn.kv_size), weight.dtype, weight.device)
            attn.o_proj.lora = LoRAStack(state, attn.q_size, (attn.o_proj.out_features,), weight.dtype, weight.device)
            if isinstance(layer.mlp, LlamaMLP):
                for proj in (layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
                    proj.lora = LoRAStack(state, proj.in_features, (proj.out_features,), weight.dtype, weight.device)
        return state

    def set_lora(self, slot: int, weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write an adapter's weights ((layer, HF module) -> (A, scaled B)) into `slot` ({}: clear it)."""
        for i, layer in enumerate(self.model.layers):
            attn = layer.self_attn
            attn.qkv_proj.lora.set_slot(slot, [weights.get((i, m)) for m in ("q_proj", "k_proj", "v_proj")])
            attn.o_proj.lora.set_slot(slot, [weights.get((i, "o_proj"))])
            if isinstance(layer.mlp, LlamaMLP):
                for name in ("gate_proj", "up_proj", "down_proj"):
                    getattr(layer.mlp, name).lora.set_slot(slot, [weights.get((i, name))])

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], triton: bool = False) -> None:
        """Copy HF-named tensors into our parameters (every one written exactly once), then pack them. `triton`:
        the engine runs Triton's kernels (a quantized checkpoint's linear layers then run Triton's too)."""
        pieces = {}
        for name, module in self.named_modules():
            if isinstance(module, (LlamaAttention, Experts)):
                pieces.update(module.checkpoint_pieces(name + "."))
        tied = self.config.tie_word_embeddings
        skip = {"lm_head.weight"} if tied else set()
        # A quantized checkpoint's linear layers and embedding run on their weights as shipped where a
        # quantized kernel is (a tied lm_head on the embedding's).
        linears = {f"{name}.weight": module for name, module in self.named_modules()
                   if isinstance(module, Linear) and module.runs_quantized(module.weight, triton)}
        embedding = "model.embed_tokens.weight"
        quantizable = frozenset([*linears, embedding]) if linears else frozenset()
        for name, parts in load_weights(self, weights, pieces, skip, quantizable).items():
            weight = QuantizedWeight.stack_rows([part for _, part in sorted(parts, key=lambda p: p[0])])
            if name == embedding:
                if tied:
                    self.lm_head.set_quantized(weight, triton)
                own = self.lm_head.quantized if tied else weight.to(self.lm_head.weight.device)
                self.model.embed_tokens = QuantizedEmbedding(own, self.config.hidden_size, self.lm_head.weight.dtype)
            else:
                linears[name].set_quantized(weight, triton)
        for module in self.modules():
            if isinstance(module, (Linear, Experts)):
                module.pack()
