"""Engine configuration: frozen dataclasses built once at the entry point and passed down.

Nothing below the entry point reads the environment or the model folder again; it reads these.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "Qwen3MoeForCausalLM", "MixtralForCausalLM", "Gemma3ForCausalLM")
# The language model inside a multimodal checkpoint (LLaVA's `text_config`) is named by its model_type.
# Qwen2.5-VL's is a Qwen2 decoder whose RoPE takes 3-D positions (M-RoPE).
_TEXT_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                     "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
                     "qwen2_5_vl_text": "Qwen2ForCausalLM"}
# Vision-language architectures whose config.json may keep the language model's settings at its top level
# (checkpoints saved before transformers 5) rather than in `text_config`.
_FLAT_MULTIMODAL_ARCHITECTURES = {"Qwen2_5_VLForConditionalGeneration": "Qwen2ForCausalLM"}
# Architectures whose attention RMS-normalises each query and key head before RoPE.
_QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM")
# Architectures whose config may slide the window over some layers only (`layer_types`, or every layer from
# `max_window_layers` on); the others slide it over every layer when they have one.
_LAYERED_WINDOW_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
# The dtypes a model runs in, by name, with their size in bytes. Names, not torch dtypes: the proxy reads
# model folders too, and loads no torch.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# What the KV pool may store (--kv-cache-dtype, vLLM's spellings) by its dtype's name; "auto": the model's dtype.
# FP8 is stored unscaled (scale 1.0, vLLM's default without calibrated scales), saturated at its largest value.
# int8: each token's row of each head quantized to its own scale, the scale's float16 after the values.
KV_CACHE_DTYPES = {"auto": None, "bfloat16": "bfloat16", "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn",
                   "fp8_e5m2": "float8_e5m2", "int8": "int8"}
KV_DTYPE_BYTES = {**DTYPE_BYTES, "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1}
# The bytes of an int8 row's scale (a float16), stored after its head_size values (kernels/int8_rows.py).
INT8_ROW_SCALE_BYTES = 2


def kv_row_size(head_size: int, kv_dtype_name: str) -> int:
    """Elements of one token's row of one head in the KV pool: head_size, plus an int8 row's scale bytes."""
    return head_size + INT8_ROW_SCALE_BYTES if kv_dtype_name == "int8" else head_size


def read_config_json(path: str | Path) -> dict[str, Any]:
    """A model folder's `config.json`; FileNotFoundError naming the folder where there is none."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"no model at {str(path)!r}: expected an HF folder with config.json")
    return json.loads(config_file.read_text())


def dtype_name(dtype: str | torch.dtype) -> str:
    """A supported dtype's name ("float32"...), from its name or its torch dtype; raises ValueError."""
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of {sorted(DTYPE_BYTES)}")
    return name


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """A supported dtype as torch's; raises ValueError."""
    import torch

    return getattr(torch, dtype_name(dtype))


# What the language model's config must say itself for its model type's defaults not to matter.
_TEXT_CONFIG_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
                     "attention_bias", "mlp_bias")


def _text_config(raw: dict) -> dict:
    """The language model's config inside a multimodal one. Checkpoints often list only what differs from
    the model type's defaults, so those defaults fill the rest (from transformers' config classes, which
    load torch: a config that names everything is read without them, as the proxy does); embeddings are
    tied if either level says so."""
    text = dict(raw["text_config"])
    model_type = text.get("model_type", "llama")
    complete = all(k in text for k in _TEXT_CONFIG_KEYS) and ("rope_parameters" in text or "rope_theta" in text)
    try:
        if not complete:
            from transformers import AutoConfig

            text = {**AutoConfig.for_model(model_type).to_dict(), **text}
    except (ImportError, ValueError, KeyError):
        pass  # an unknown type fails below, naming itself
    text["tie_word_embeddings"] = bool(raw.get("tie_word_embeddings")) or bool(raw["text_config"].get("tie_word_embeddings"))
    text.setdefault("architectures", None)
    text["architectures"] = text["architectures"] or [_TEXT_MODEL_TYPES.get(model_type, model_type)]
    return text


def _rope(params: dict | None, default_theta: float) -> tuple[float, dict[str, Any] | None]:
    """rope_theta and the scaling (None for plain RoPE) of HF `rope_parameters` / `rope_scaling`. M-RoPE's
    sections (`_mrope_section`) are not scaling: "mrope" is plain RoPE over three position streams."""
    rope = dict(params or {})
    rope.pop("mrope_section", None)
    rope.pop("mrope_interleaved", None)
    theta = float(rope.pop("rope_theta", default_theta))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    return theta, None if rope_type in ("default", "mrope") else {**rope, "rope_type": rope_type}


def _mrope_section(raw: dict, head_size: int) -> tuple[int, ...] | None:
    """M-RoPE's split of the rotary frequency pairs among the temporal, height and width positions (Qwen2.5-VL);
    None for 1-D RoPE."""
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    section = rope.get("mrope_section")
    if section is None:
        return None
    if rope.get("mrope_interleaved"):
        raise ValueError("interleaved M-RoPE is not supported")
    section = tuple(int(s) for s in section)
    if len(section) != 3 or any(s < 0 for s in section) or sum(section) != head_size // 2:
        raise ValueError(f"mrope_section {list(section)} must be three sizes summing to head_size / 2 = "
                         f"{head_size // 2}")
    return section


def _sliding_layers(arch: str, raw: dict) -> tuple[int, ...]:
    """The layers a sliding window applies to, as HF chooses them: Gemma 3 and Qwen2/Qwen3 by `layer_types`
    when the config lists them, else Gemma 3 every layer but each `sliding_window_pattern`-th and Qwen2/Qwen3
    the layers from `max_window_layers` on; the other families every layer."""
    num_layers = raw["num_hidden_layers"]
    layer_types = raw.get("layer_types")
    if layer_types and arch in (*_LAYERED_WINDOW_ARCHITECTURES, "Gemma3ForCausalLM"):
        if len(layer_types) != num_layers:
            raise ValueError(f"layer_types names {len(layer_types)} layers, the model has {num_layers}")
        return tuple(i for i, kind in enumerate(layer_types) if kind == "sliding_attention")
    if arch == "Gemma3ForCausalLM":
        pattern = raw.get("sliding_window_pattern", 6)
        return tuple(i for i in range(num_layers) if (i + 1) % pattern)
    if arch in _LAYERED_WINDOW_ARCHITECTURES:
        return tuple(range(raw.get("max_window_layers", 28), num_layers))
    return tuple(range(num_layers))


# The only MLP activation HF's Gemma 3 checkpoints name (`hidden_activation`), run as torch's tanh GELU.
_GEMMA3_ACTIVATIONS = ("gelu_pytorch_tanh",)


def _gemma3_fields(raw: dict) -> dict[str, Any]:
    """What a Gemma 3 text config (transformers 4 or 5 layout) sets beyond the Llama family's fields."""
    if raw.get("attn_logit_softcapping") is not None:
        raise ValueError(f"Gemma 3 with attn_logit_softcapping={raw['attn_logit_softcapping']} is not supported "
                         "(the attention kernels do not soft-cap scores; HF's Gemma 3 checkpoints set none)")
    if raw.get("use_bidirectional_attention"):
        raise ValueError("Gemma 3 with use_bidirectional_attention is not supported (an encoder, not a decoder)")
    act = raw.get("hidden_activation") or "gelu_pytorch_tanh"
    if act not in _GEMMA3_ACTIVATIONS:
        raise ValueError(f"Gemma 3 with hidden_activation={act!r} is not supported (supported: {_GEMMA3_ACTIVATIONS})")
    # transformers 5 nests RoPE by layer type; transformers 4 has rope_theta, rope_scaling (global layers)
    # and rope_local_base_freq (sliding layers).
    nested = raw.get("rope_parameters") or {}
    if "full_attention" not in nested and "sliding_attention" not in nested:
        nested = {}
    full = {"rope_theta": raw.get("rope_theta", 1_000_000.0), **(nested.get("full_attention")
                                                                or raw.get("rope_scaling") or {})}
    local = {"rope_theta": raw.get("rope_local_base_freq", 10_000.0), **(nested.get("sliding_attention") or {})}
    rope_theta, rope_scaling = _rope(full, 1_000_000.0)
    sliding_rope_theta, sliding_rope_scaling = _rope(local, 10_000.0)
    cap = raw.get("final_logit_softcapping")
    return dict(
        rope_theta=rope_theta, rope_scaling=rope_scaling, sliding_rope_theta=sliding_rope_theta,
        sliding_rope_scaling=sliding_rope_scaling, sliding_window=raw.get("sliding_window", 4096),
        hidden_act=act, embedding_scale=raw["hidden_size"] ** 0.5,
        attention_scale=raw.get("query_pre_attn_scalar", 256) ** -0.5, unit_offset_norms=True,
        sandwich_norms=True, final_logit_softcapping=None if cap is None else float(cap),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
    )


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """The sparse MLP of a mixture-of-experts model (Qwen3-MoE, Mixtral): each token's top-k experts by
    the router's softmax, their outputs summed with those probabilities as weights."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    # The top-k probabilities divided by their sum (Mixtral always; Qwen3-MoE when `norm_topk_prob`).
    renormalize: bool
    # The top-k weights rounded to the model dtype before they scale the experts' outputs (Qwen3-MoE); Mixtral
    # scales in float32 and rounds the product. The same in float32.
    round_weights: bool
    # The layers whose MLP is sparse; the others run a dense MLP of the model's `intermediate_size`.
    sparse_layers: tuple[int, ...]

    @staticmethod
    def from_hf(arch: str, raw: dict) -> MoEConfig | None:
        """The sparse MLP an HF config describes, or None for a dense model."""
        num_layers = raw["num_hidden_layers"]
        # transformers writes either name for either model (its attribute_map aliases them).
        num_experts = raw.get("num_experts", raw.get("num_local_experts"))
        if arch == "MixtralForCausalLM":
            return MoEConfig(num_experts=8 if num_experts is None else num_experts,
                             top_k=raw.get("num_experts_per_tok", 2), intermediate_size=raw["intermediate_size"],
                             renormalize=True, round_weights=False, sparse_layers=tuple(range(num_layers)))
        if arch != "Qwen3MoeForCausalLM":
            return None
        num_experts = 128 if num_experts is None else num_experts
        # As HF's Qwen3MoeDecoderLayer chooses: every `decoder_sparse_step`-th layer but `mlp_only_layers`.
        step, dense = raw.get("decoder_sparse_step", 1), set(raw.get("mlp_only_layers") or ())
        sparse = tuple(i for i in range(num_layers)
                       if i not in dense and num_experts > 0 and step > 0 and (i + 1) % step == 0)
        if not sparse:
            return None
        return MoEConfig(num_experts=num_experts, top_k=raw.get("num_experts_per_tok", 8),
                         intermediate_size=raw.get("moe_intermediate_size", 768),
                         renormalize=bool(raw.get("norm_topk_prob", False)), round_weights=True,
                         sparse_layers=sparse)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """What the model code needs from an HF `config.json`, normalised across the supported architectures."""

    path: str
    architecture: str
    dtype_name: str  # "float32", "bfloat16" or "float16"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    rms_norm_eps: float
    rope_theta: float
    # HF `rope_parameters` / `rope_scaling` without rope_theta; None for plain RoPE.
    rope_scaling: dict[str, Any] | None
    max_model_len: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]
    model_id: str = ""
    qk_norm: bool = False  # per-head RMSNorm of queries and keys before RoPE (Qwen3, Gemma 3)
    moe: MoEConfig | None = None  # the sparse MLP, for a mixture-of-experts model
    # The layers `sliding_window` applies to (HF's "sliding_attention" layers); None: every layer. Each
    # layer's window is layer_sliding_window(i). Every layer keeps its whole context in the KV cache.
    sliding_layers: tuple[int, ...] | None = None
    # The RoPE of the sliding layers where they have their own (Gemma 3: rope_local_base_freq, unscaled);
    # None: every layer uses rope_theta and rope_scaling.
    sliding_rope_theta: float | None = None
    sliding_rope_scaling: dict[str, Any] | None = None
    hidden_act: str = "silu"  # the gated MLP's activation: "silu", or "gelu_pytorch_tanh" (Gemma 3's GeGLU)
    embedding_scale: float | None = None  # token embeddings times this, rounded to the model dtype (Gemma 3)
    attention_scale: float | None = None  # of the attention scores; None: head_size ** -0.5
    # RMSNorm scales by (1 + weight), in float32 before the cast to the model dtype (Gemma 3).
    unit_offset_norms: bool = False
    # Each layer norms its attention and MLP outputs before adding them to the residual stream (four norms
    # a layer: input, post_attention, pre_feedforward, post_feedforward; Gemma 3).
    sandwich_norms: bool = False
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap), in the model dtype
    # M-RoPE (Qwen2.5-VL): the rotary frequency pairs taken from the temporal, height and width position of
    # each token, in that order; None: 1-D positions. A request's 3-D positions come with it.
    mrope_section: tuple[int, ...] | None = None
    # How the weights are held: None as the checkpoint has them (a GGUF file's quantized tensors as they ship),
    # "int8": the dense linear layers quantized at load, per output channel (`--quantization int8`).
    quantization: str | None = None

    @staticmethod
    def from_pretrained(path: str | Path, dtype: str | torch.dtype = "float32",
                        max_model_len: int | None = None) -> ModelConfig:
        folder = Path(path)
        raw = read_config_json(folder)
        if "text_config" in raw:  # multimodal (LLaVA layout): the engine runs its language model
            raw = _text_config(raw)
        elif flat := next((_FLAT_MULTIMODAL_ARCHITECTURES[a] for a in raw.get("architectures") or ()
                           if a in _FLAT_MULTIMODAL_ARCHITECTURES), None):
            raw = {**raw, "architectures": [flat]}
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(f"unsupported architecture {archs}; supported: {list(SUPPORTED_ARCHITECTURES)}")
        num_heads = raw["num_attention_heads"]
        head_size = raw.get("head_dim") or raw["hidden_size"] // num_heads
        rope_theta, rope_scaling = _rope(raw.get("rope_parameters") or raw.get("rope_scaling"),
                                         raw.get("rope_theta", 10000.0))
        model_len = raw.get("max_position_embeddings", 2048)
        if max_model_len is not None:
            if max_model_len <= 0:
                raise ValueError(f"max_model_len must be positive, got {max_model_len}")
            model_len = min(model_len, max_model_len)
        use_sliding = raw.get("use_sliding_window", arch in ("MistralForCausalLM", "MixtralForCausalLM"))
        gemma = _gemma3_fields(raw) if arch == "Gemma3ForCausalLM" else {}
        sliding_window = gemma.pop("sliding_window", raw.get("sliding_window") if use_sliding else None)
        eos = raw.get("eos_token_id")
        generation_config = folder / "generation_config.json"
        if generation_config.is_file():
            eos = json.loads(generation_config.read_text()).get("eos_token_id", eos)
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        fields = dict(
            path=str(folder),
            architecture=arch,
            dtype_name=dtype_name(dtype),
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_size=head_size,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_model_len=model_len,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False)),
            o_bias=arch != "Qwen2ForCausalLM" and bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            sliding_window=sliding_window,
            eos_token_ids=eos_ids,
            model_id=raw.get("_name_or_path") or folder.name,
            qk_norm=arch in _QK_NORM_ARCHITECTURES,
            moe=MoEConfig.from_hf(arch, raw),
            sliding_layers=_sliding_layers(arch, raw) if sliding_window is not None or gemma else (),
            mrope_section=_mrope_section(raw, head_size),
        )
        return ModelConfig(**{**fields, **gemma})

    def is_sliding_layer(self, layer_id: int) -> bool:
        """Whether the layer is one of the sliding ones (whatever its window)."""
        return self.sliding_layers is None or layer_id in self.sliding_layers

    def layer_sliding_window(self, layer_id: int) -> int | None:
        """The sliding window of a layer's attention; None: the whole context."""
        return self.sliding_window if self.is_sliding_layer(layer_id) else None

    @property
    def dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype_name)

    def kv_bytes_per_token(self, kv_dtype_name: str | None = None) -> int:
        """Bytes of one token's K and V in every layer, stored in `kv_dtype_name` (None: the model's dtype)."""
        name = kv_dtype_name or self.dtype_name
        return 2 * self.num_layers * self.num_kv_heads * kv_row_size(self.head_size, name) * KV_DTYPE_BYTES[name]

    @property
    def num_weight_bytes(self) -> int:
        """Bytes of the language model's weights in `dtype` (a multimodal checkpoint's tower not counted)."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_size, self.num_kv_heads * self.head_size
        attention = h * (q + 2 * kv) + q * h + (q + 2 * kv) * self.qkv_bias + h * self.o_bias
        attention += 2 * self.head_size * self.qk_norm
        mlp = 3 * h * self.intermediate_size + (2 * self.intermediate_size + h) * self.mlp_bias
        layers = self.num_layers * (attention + (4 if self.sandwich_norms else 2) * h)  # + the RMSNorms
        if self.moe is None:
            layers += self.num_layers * mlp
        else:  # the sparse layers' experts and router
            num_sparse = len(self.moe.sparse_layers)
            layers += (self.num_layers - num_sparse) * mlp
            layers += num_sparse * self.moe.num_experts * (3 * h * self.moe.intermediate_size + h)
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return (layers + embeddings + h) * DTYPE_BYTES[self.dtype_name]


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int = 16
    # Size of the KV pool, first given wins: `num_blocks`, `kv_cache_memory_bytes`, else sized from the
    # memory available (see kv_cache_budget.py): `kv_cache_memory_fraction` of it after the weights
    # (None: the device's default).
    kv_cache_memory_bytes: int | None = None
    num_blocks: int | None = None
    enable_prefix_caching: bool = True
    kv_cache_memory_fraction: float | None = None
    # The local offload tier (offload_connector.py): bytes of blocks kept beyond the pool once evicted, in
    # a memory-mapped file of the engine's own in folder `kv_offloading_path` (None: the temp folder); 0:
    # none. With
    # `kv_offloading_save_finished`, finished requests' full blocks are saved too, not only evicted ones.
    kv_offloading_bytes: int = 0
    kv_offloading_path: str | None = None
    kv_offloading_save_finished: bool = False
    # The deployment's block-hash key (shared/block_hash.py deployment_key; None: unkeyed): the prefix
    # cache, the offload tier and the shared KV store all name blocks by hashes keyed with it.
    block_hash_key: bytes | None = field(default=None, repr=False)
    # What the pool stores, in vLLM's spellings (KV_CACHE_DTYPES): the model's dtype ("auto"), bfloat16, FP8 or int8;
    # the prefill->decode transfer, the offload tier and the shared store move blocks as stored.
    cache_dtype: str = "auto"

    def __post_init__(self):
        if self.cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype {self.cache_dtype!r} is not supported; choose one of "
                             f"{', '.join(KV_CACHE_DTYPES)}")
        if self.kv_offloading_bytes < 0:
            raise ValueError(f"kv_offloading_bytes must be at least 0, got {self.kv_offloading_bytes}")
        if self.kv_offloading_bytes and not self.enable_prefix_caching:
            raise ValueError("KV offloading finds blocks by their prefix hash: it needs prefix caching")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}")
        if self.kv_cache_memory_fraction is not None and not 0 < self.kv_cache_memory_fraction <= 1:
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction}")


# How a step's token budget is spent (step_budget.py): "prompts" (the default) bounds the step's prompt and draft
# tokens and lets every running request's next token ride on top, packing prompts whole; "shared" is vLLM V1's,
# decodes and prompt chunks sharing the budget, the last prompt chunked to fill it.
BUDGET_POLICIES = ("prompts", "shared")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 128
    # Tokens computed per step: with budget_policy "shared" prefill chunks and decodes together; with
    # "prompts" prefill chunks and draft tokens, each running request's next token coming on top.
    max_num_batched_tokens: int = 1024
    budget_policy: str = "prompts"

    def __post_init__(self):
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if self.budget_policy not in BUDGET_POLICIES:
            raise ValueError(f"budget_policy must be one of {', '.join(BUDGET_POLICIES)}, got {self.budget_policy!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# The keys of vLLM's speculative config that are ours too, by method; any other key is refused, never ignored.
# "adaptive" is ours (draft_policy.py): false verifies every draft proposed.
_SUFFIX_KEYS = ("suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
                "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob")
_SPECULATIVE_KEYS = {"ngram": ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "adaptive"),
                     "draft_model": ("method", "num_speculative_tokens", "model", "adaptive"),
                     "suffix": ("method", "num_speculative_tokens", *_SUFFIX_KEYS, "adaptive")}
SPECULATIVE_METHODS = tuple(_SPECULATIVE_KEYS)


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding, in vLLM's spelling (`--speculative-config '{"method": "ngram", ...}'`).

    "ngram" is prompt lookup: the proposal is what followed the latest earlier occurrence of the request's
    last n tokens (n from prompt_lookup_max down to prompt_lookup_min) in its prompt and output, up to
    num_speculative_tokens of it. vLLM's defaults: both lookup bounds 5 when neither is given, else the one
    given for both. "draft_model": a small model of the same vocabulary (`model`, a folder) proposes
    num_speculative_tokens greedy tokens; `draft` is its config, read at the entry point. "suffix": suffix
    decoding (suffix_proposer.py), num_speculative_tokens defaulting to the tree's depth. num_speculative_tokens
    is the most a request verifies in a step: `adaptive` (ours, default true) keeps only the drafts expected
    to pay for the rows they add (draft_policy.py)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    model: str | None = None
    draft: ModelConfig | None = None
    # Each step verifies only the drafts expected to pay for their rows (draft_policy.py); False: all of them.
    adaptive: bool = True
    # "suffix" (suffix_proposer.py), vLLM's keys; the cache of outputs is smaller than vLLM's 10000 requests
    # by default: its tree holds about depth nodes per output token, in Python objects.
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 256
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1

    def __post_init__(self):
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {SPECULATIVE_METHODS}, got {self.method!r}")
        # JSON's true is Python's 1: a bool is refused, not taken as a count.
        if not _is_int(self.num_speculative_tokens) or not 1 <= self.num_speculative_tokens <= 32:
            raise ValueError(f"num_speculative_tokens must be an integer in [1, 32], got {self.num_speculative_tokens!r}")
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) must not exceed prompt_lookup_max "
                             f"({self.prompt_lookup_max})")
        if not _is_int(self.suffix_decoding_max_tree_depth) or not 2 <= self.suffix_decoding_max_tree_depth <= 64:
            raise ValueError("suffix_decoding_max_tree_depth must be an integer in [2, 64], got "
                             f"{self.suffix_decoding_max_tree_depth!r}")
        if not _is_int(self.suffix_decoding_max_cached_requests) or self.suffix_decoding_max_cached_requests < 0:
            raise ValueError("suffix_decoding_max_cached_requests must be a non-negative integer, got "
                             f"{self.suffix_decoding_max_cached_requests!r}")
        factor, prob = self.suffix_decoding_max_spec_factor, self.suffix_decoding_min_token_prob
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 64:
            raise ValueError(f"suffix_decoding_max_spec_factor must be a number in (0, 64], got {factor!r}")
        if isinstance(prob, bool) or not isinstance(prob, (int, float)) or not 0 <= prob <= 1:
            raise ValueError(f"suffix_decoding_min_token_prob must be a number in [0, 1], got {prob!r}")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"adaptive must be true or false, got {self.adaptive!r}")
        if (self.method == "draft_model") != isinstance(self.model, str) or self.model == "":
            raise ValueError("speculative method 'draft_model' needs 'model' (the draft model's folder), and only it")

    @staticmethod
    def parse(spec: "str | dict | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        """From vLLM's JSON (text or dict); None stays None. Raises ValueError naming what is wrong."""
        if spec is None or isinstance(spec, SpeculativeConfig):
            return spec
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative config is not valid JSON: {exc}") from None
        if not isinstance(spec, dict):
            raise ValueError("speculative config must be a JSON object")
        if "method" not in spec or ("num_speculative_tokens" not in spec and spec["method"] != "suffix"):
            raise ValueError("speculative config needs 'method' and 'num_speculative_tokens'")
        keys = _SPECULATIVE_KEYS.get(spec["method"]) if isinstance(spec["method"], str) else None
        if keys is None:
            raise ValueError(f"speculative method must be one of {SPECULATIVE_METHODS}, got {spec['method']!r}")
        unknown = sorted(set(spec) - set(keys))
        if unknown:
            raise ValueError(f"speculative config: unsupported keys {unknown} for method {spec['method']!r} "
                             f"(supported: {list(keys)})")
        low, high = spec.get("prompt_lookup_min"), spec.get("prompt_lookup_max")
        low, high = (5, 5) if low is None and high is None else (high if low is None else low,
                                                               low if high is None else high)
        # Suffix decoding's drafts are as long as the tree is deep unless told otherwise (vLLM's default).
        depth = spec.get("suffix_decoding_max_tree_depth", 24)
        return SpeculativeConfig(spec["method"], spec.get("num_speculative_tokens", depth), low, high,
                                 spec.get("model"), adaptive=spec.get("adaptive", True),
                                 **{key: spec[key] for key in _SUFFIX_KEYS if key in spec})

    def with_draft(self, dtype: str, max_model_len: int) -> "SpeculativeConfig":
        """This config with its draft model's config read (draft_model; raises ValueError), else itself."""
        if self.method != "draft_model":
            return self
        try:
            draft = ModelConfig.from_pretrained(self.model, dtype, max_model_len)
        except FileNotFoundError as exc:
            raise ValueError(f"speculative config: {exc}") from None
        return replace(self, draft=draft)


@dataclass(frozen=True, slots=True)
class LoRAConfig:
    """LoRA adapters served beside the base weights: `max_loras` resident at once (each a slot of stacked
    weights in every targeted layer), none of rank above `max_lora_rank`."""

    max_loras: int = 4
    max_lora_rank: int = 16
    # (name, PEFT folder) of the adapters read and checked at start-up (an engine's --lora-modules).
    modules: tuple[tuple[str, str], ...] = ()
    # The folders other adapters may be read from (a service's --lora-root; () there: none but `modules`);
    # None: any folder, for the offline API, whose caller is the operator.
    roots: tuple[str, ...] | None = None
    max_bytes: int = 1 << 30  # the largest adapter weights file read (--max-lora-bytes)

    def __post_init__(self):
        if not _is_int(self.max_bytes) or self.max_bytes <= 0:
            raise ValueError(f"max_lora_bytes must be a positive integer, got {self.max_bytes!r}")
        names = [name for name, _ in self.modules]
        if len(set(names)) != len(names):
            raise ValueError(f"LoRA module names must be distinct, got {names}")
        if self.max_loras <= 0:
            raise ValueError(f"max_loras must be positive, got {self.max_loras}")
        if not 0 < self.max_lora_rank <= 512:
            raise ValueError(f"max_lora_rank must be in [1, 512], got {self.max_lora_rank}")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: str = "cpu"
    attention_backend: str = "auto"
    seed: int = 0
    lora: LoRAConfig | None = None  # None: no adapters
    # Seconds a service gives a request's structured output to compile before refusing the request (the
    # compile runs off the event loop either way; the offline LLM compiles without a limit).
    grammar_compile_timeout: float = 10.0
    # Speculative decoding (None: one token per request and step).
    speculative: SpeculativeConfig | None = None
    # Time a mixture-of-experts model's sparse MLPs by part in the step timer (routing, dispatch, experts,
    # combine); nothing for a dense model. Off: those layers run with no clock reads at all.
    profile_moe: bool = False

    @property
    def kv_dtype_name(self) -> str:
        """The dtype the KV pool stores, by name ("float32", "bfloat16", "float8_e4m3fn", ...)."""
        return KV_CACHE_DTYPES[self.cache.cache_dtype] or self.model.dtype_name

    def __post_init__(self):
        if not self.grammar_compile_timeout > 0:
            raise ValueError(f"grammar_compile_timeout must be positive, got {self.grammar_compile_timeout}")
        draft = self.speculative.draft if self.speculative is not None else None
        if self.speculative is not None and self.speculative.method == "draft_model" and draft is None:
            raise ValueError("a draft_model speculative config needs its draft's config (SpeculativeConfig.with_draft)")
        if draft is not None and draft.vocab_size != self.model.vocab_size:
            raise ValueError(f"speculative config: the draft model's vocabulary ({draft.vocab_size} tokens) is not "
                             f"the model's ({self.model.vocab_size})")


@dataclass(frozen=True, slots=True)
class TransportConfig:
    """How services reach each other."""

    kv_transport: str = "zmq"  # data plane for KV blocks and embeddings: "zmq" or "ucx"
    # Folder holding one CURVE certificate shared by the deployment (`epdserve.key` and
    # `epdserve.key_secret`): every service then authenticates and encrypts every connection.
    curve_dir: str | None = None
    rpc_timeout: float = 30.0  # seconds a control request (an RPC) may take before the peer counts as gone
    transfer_timeout: float = 60.0  # seconds one KV or embedding fetch may take
    # UCX's NET_DEVICES: the interfaces the ucx transport may use. "all" (UCX's own default) reaches
    # peers on other hosts; name the fabric (e.g. "mlx5_0:1" or "eth0") to keep it off the others.
    ucx_net_devices: str = "all"
    # The deployment's shared secret: every handshake proves it (transport/channel/peer_auth.py). None: peers are not
    # authenticated, which only a service nothing else can reach (bound to loopback) may run without.
    secret: bytes | None = field(default=None, repr=False)

    def __post_init__(self):
        if self.kv_transport not in ("zmq", "ucx"):
            raise ValueError(f"kv_transport must be 'zmq' or 'ucx', got {self.kv_transport!r}")
        if not self.ucx_net_devices.strip():
            raise ValueError("ucx_net_devices must name devices, or be 'all'")
        if self.rpc_timeout <= 0 or self.transfer_timeout <= 0:
            raise ValueError("timeouts must be positive")

    def transfer_options(self) -> dict:
        """Keyword arguments of transports.create_server / create_client for the chosen transport."""
        return {"net_devices": self.ucx_net_devices} if self.kv_transport == "ucx" else {}

    def server_options(self, block_port: int) -> dict:
        """transfer_options of a KV server whose blocks leave on `block_port` (ZMQ's block connections)."""
        return self.transfer_options() if self.kv_transport == "ucx" else {"block_port": block_port}


@dataclass(frozen=True, slots=True)
class ServiceConfig:
    """One service process (encoder, prefill, decode or unified)."""

    role: str
    engine_id: str
    host: str = "127.0.0.1"  # bind address; "0.0.0.0" must be asked for
    port: int = 0  # control channel (0: any free port)
    data_port: int = 0  # KV / embedding transfer server (prefill, encoder)
    http_port: int = 0  # /health, /ready, /metrics
    # Host peers use to reach this service's data server; defaults to `host` (or this machine's name
    # when `host` is a wildcard).
    advertise_host: str | None = None
    lease_seconds: float = 10.0  # how long prefill keeps a request's KV for decode to pull
    encoder_cache_items: int = 256  # images whose embeddings the encoder keeps
    transport: TransportConfig = field(default_factory=TransportConfig)
    drain_timeout: float = 10.0  # on SIGTERM: seconds to finish what is in flight before exiting
    # Compute threads of the engine (or encoder) thread; every other thread of the service uses one.
    threads: int = 1
    # `model_name` of its metrics, as the proxy's (None: the model folder's name, the proxy's default too).
    served_model_name: str | None = None
    # Prefill: plain TCP port its KV blocks leave on (ZMQ transport without CURVE; 0: any free port,
    # which decodes learn in the handshake).
    block_port: int = 0
    # Admission control: a request whose prompt would wait longer than this (seconds) behind the prompts
    # queued here is refused, retryably (0: never).
    max_queue_wait: float = 60.0
    # Seconds between an engine's stats lines (stats_log.py); None: none.
    log_stats_interval: float | None = 10.0
    # An engine's shared KV store (`host:port` of `epdserve serve kvstore`; None: none), and how long one
    # call to it may take before the store counts as down (its requests then recompute).
    kv_store: str | None = None
    kv_store_timeout: float = 2.0
    # The KV store itself: bytes of blocks it keeps in memory, and on disk (per model; 0: no disk) in a
    # file in folder `kv_store_path` (None: the temp folder).
    kv_store_bytes: int = 1 << 30
    kv_store_disk_bytes: int = 0
    kv_store_path: str | None = None

    def __post_init__(self):
        if self.kv_store_timeout <= 0:
            raise ValueError(f"--kv-store-timeout must be positive, got {self.kv_store_timeout:g}")
        if self.kv_store_bytes <= 0:
            raise ValueError(f"--kv-store-size must be positive, got {self.kv_store_bytes} bytes")
        if self.kv_store_disk_bytes < 0:
            raise ValueError(f"--kv-store-disk-size must be at least 0, got {self.kv_store_disk_bytes} bytes")
        if self.max_queue_wait < 0:
            raise ValueError(f"--max-queue-wait must be at least 0, got {self.max_queue_wait:g}")
