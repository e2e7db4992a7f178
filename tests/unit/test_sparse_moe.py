"""The sparse MLP against HF transformers' own blocks (Qwen3-MoE with and without renormalised top-k weights,
Mixtral), loaded from the per-expert names checkpoints use; and the grouping by expert against a
token-by-token reference."""
import pytest
import torch

from epdserve.shared.config import ModelConfig, MoEConfig
from epdserve.shared.models.layers.sparse_moe import SparseMoE
from epdserve.shared.models.weight_loader import load_weights, our_name

HIDDEN, EXPERT_SIZE, NUM_EXPERTS, TOP_K = 64, 32, 6, 2


def hf_block(model_type: str, norm_topk_prob: bool, dtype: torch.dtype, top_k: int = TOP_K):
    """HF's sparse MLP with random weights, and those weights as a checkpoint of per-expert tensors."""
    from transformers import AutoConfig

    common = dict(hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=2, num_experts_per_tok=top_k)
    if model_type == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Block

        config = AutoConfig.for_model("mixtral", intermediate_size=EXPERT_SIZE, num_local_experts=NUM_EXPERTS, **common)
        names = {"gate": "block_sparse_moe.gate.weight", "expert": "block_sparse_moe.experts.{}.w{}.weight",
                 "gate_proj": "1", "up_proj": "3", "down_proj": "2"}
    else:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block

        config = AutoConfig.for_model("qwen3_moe", moe_intermediate_size=EXPERT_SIZE, num_experts=NUM_EXPERTS,
                                      norm_topk_prob=norm_topk_prob, **common)
        names = {"gate": "mlp.gate.weight", "expert": "mlp.experts.{}.{}.weight",
                 "gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}
    torch.manual_seed(0)
    block = Block(config).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    block = block.to(dtype)
    gate_up, down = block.experts.gate_up_proj, block.experts.down_proj
    checkpoint = [(names["gate"], block.gate.weight.detach())]
    for e in range(NUM_EXPERTS):
        checkpoint += [(names["expert"].format(e, names["gate_proj"]), gate_up[e, :EXPERT_SIZE].detach()),
                       (names["expert"].format(e, names["up_proj"]), gate_up[e, EXPERT_SIZE:].detach()),
                       (names["expert"].format(e, names["down_proj"]), down[e].detach())]
    return block, checkpoint


def ours(arch: str, renormalize: bool, checkpoint, dtype: torch.dtype, top_k: int = TOP_K) -> SparseMoE:
    moe = MoEConfig(num_experts=NUM_EXPERTS, top_k=top_k, intermediate_size=EXPERT_SIZE, renormalize=renormalize,
                    round_weights=arch == "Qwen3MoeForCausalLM", sparse_layers=(0,))
    config = ModelConfig(path="/m", architecture=arch, dtype_name=str(dtype).removeprefix("torch."), vocab_size=8,
                         hidden_size=HIDDEN, intermediate_size=EXPERT_SIZE, num_layers=1, num_heads=2, num_kv_heads=2,
                         head_size=32, rms_norm_eps=1e-6, rope_theta=1e4, rope_scaling=None, max_model_len=64,
                         tie_word_embeddings=False, qkv_bias=False, o_bias=False, mlp_bias=False,
                         sliding_window=None, eos_token_ids=(), moe=moe)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        layer = SparseMoE(config)
    finally:
        torch.set_default_dtype(default)
    # The checkpoint's names, as the model's loader sees them under the layer's own prefix.
    pieces = layer.experts.checkpoint_pieces("experts.")
    load_weights(layer, ((our_name("." + name).removeprefix(".mlp."), t) for name, t in checkpoint), pieces, set())
    layer.experts.pack()
    layer.gate.pack()
    return layer.eval().requires_grad_(False)


@pytest.mark.parametrize("arch, renormalize", [("Qwen3MoeForCausalLM", False), ("Qwen3MoeForCausalLM", True),
                                               ("MixtralForCausalLM", True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_hf_block(arch, renormalize, dtype):
    model_type = "mixtral" if arch == "MixtralForCausalLM" else "qwen3_moe"
    block, checkpoint = hf_block(model_type, renormalize, dtype)
    layer = ours(arch, renormalize, checkpoint, dtype)
    x = torch.randn(37, HIDDEN, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.no_grad():
        expected = block(x[None])[0]
        _, hf_weights, hf_ids = block.gate(x)
    ids, weights = layer.route(x)
    assert torch.equal(ids, hf_ids)  # the same experts, in the same order
    assert weights.dtype == hf_weights.dtype  # Mixtral scales in float32, Qwen3-MoE in the model dtype
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(weights, hf_weights, **tol)
    torch.testing.assert_close(layer(x), expected, **tol)
    if renormalize:
        torch.testing.assert_close(weights.float().sum(-1), torch.ones(len(x)), **tol)


def test_grouped_experts_equal_each_token_alone():
    """Grouping tokens by expert changes nothing for any token (the CPU linear kernel is batch-invariant)."""
    _, checkpoint = hf_block("qwen3_moe", True, torch.float32)
    layer = ours("Qwen3MoeForCausalLM", True, checkpoint, torch.float32)
    x = torch.randn(23, HIDDEN, generator=torch.Generator().manual_seed(2))
    batched = layer(x)
    alone = torch.cat([layer(x[i:i + 1]) for i in range(len(x))])
    assert torch.equal(batched, alone)


def test_the_packed_cpu_path_the_reference_and_the_triton_kernel_agree():
    from epdserve.kernels.fused_moe import fused_moe

    _, checkpoint = hf_block("mixtral", True, torch.float32)
    layer = ours("MixtralForCausalLM", True, checkpoint, torch.float32)
    x = torch.randn(19, HIDDEN, generator=torch.Generator().manual_seed(3))
    ids, weights = layer.route(x)
    experts = layer.experts
    packed = experts(x, ids, weights)
    triton = fused_moe(x, ids, weights, experts.gate_up_proj, experts.down_proj)  # interpreted on CPU
    experts._gate_up = experts._down = []  # unpacked: the PyTorch reference
    torch.testing.assert_close(experts(x, ids, weights), packed, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(triton, packed, rtol=1e-5, atol=1e-5)


def hf_order_reference(layer: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """HF's experts loop (one expert at a time, ascending, each adding its weighted outputs with index_add_),
    over our packed per-expert layers and activation kernel."""
    from epdserve.kernels import cpu_layer_ops

    ids, weights = layer.route(x)
    experts, size = layer.experts, EXPERT_SIZE
    out = torch.zeros_like(x)
    for e in range(NUM_EXPERTS):
        token_idx, choice = torch.where(ids == e)
        if len(token_idx) == 0:
            continue
        gate_up = experts._gate_up[e](x[token_idx])
        hidden = experts._down[e](cpu_layer_ops.silu_mul_(gate_up[:, :size], gate_up[:, size:]))
        out.index_add_(0, token_idx, (hidden * weights[token_idx, choice, None]).to(out.dtype))
    return out


@pytest.mark.parametrize("arch, renormalize", [("Qwen3MoeForCausalLM", False), ("MixtralForCausalLM", True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top_k", [2, 4])
def test_grouped_dispatch_and_combine_add_as_hf_does(arch, renormalize, dtype, top_k):
    """One gather for every (token, expert) pair and one combine after all experts give, bit for bit, what
    HF's loop of index_add_ per expert gives: the same products, added in the same order (which top-4 tells
    apart: a sum of more than two terms depends on it)."""
    model_type = "mixtral" if arch == "MixtralForCausalLM" else "qwen3_moe"
    _, checkpoint = hf_block(model_type, renormalize, dtype, top_k)
    layer = ours(arch, renormalize, checkpoint, dtype, top_k)
    x = torch.randn(41, HIDDEN, generator=torch.Generator().manual_seed(4)).to(dtype)
    assert torch.equal(layer(x), hf_order_reference(layer, x))


def test_the_timed_forward_times_every_part_and_changes_nothing():
    from epdserve.shared.engine.step_timer import MOE_PHASES, StepTimer

    _, checkpoint = hf_block("qwen3_moe", True, torch.float32)
    layer = ours("Qwen3MoeForCausalLM", True, checkpoint, torch.float32)
    x = torch.randn(29, HIDDEN, generator=torch.Generator().manual_seed(5))
    untimed = layer(x)
    timer = StepTimer(moe=True)
    layer.seconds = timer.seconds
    assert torch.equal(layer(x), untimed)
    assert all(timer.seconds[p] > 0 for p in MOE_PHASES), timer.seconds
    # The parts are inside the forward pass: the breakdown takes them out of it.
    timer.seconds["forward"] = 1.0
    assert timer.breakdown()["forward"] == pytest.approx(1.0 - sum(timer.seconds[p] for p in MOE_PHASES))
