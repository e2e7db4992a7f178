"""LoRA adapters in the engine: greedy float32 output with each adapter equals HF transformers + PEFT token for
token, in one batch that mixes three adapters and the base model; their KV never meets in the prefix cache;
and an adapter the base model cannot serve is refused at load with a message saying why."""
from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import torch

from epdserve import LLM, LoRARequest, RequestOutputKind, SamplingParams

pytestmark = pytest.mark.slow  # more than ten seconds: left out of `make test-fast`

MAX_NEW_TOKENS = 12
PROMPTS = ["The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the steps",
           "Ships passed far out on the horizon",
           "In winter the storms arrived without warning. Waves broke over the rocks and threw spray",
           "His daughter wrote to him from the city"]
ADAPTERS = ("all", "attn", "mlp-rslora")


@pytest.fixture(scope="module")
def lora_paths(tiny_model_paths, tmp_path_factory):
    from epdserve.shared.checkpoints.tiny_lora import build_tiny_lora

    root = tmp_path_factory.mktemp("loras")
    return {v: str(build_tiny_lora(tiny_model_paths["llama"], root / v, v, seed=i + 1)) for i, v in enumerate(ADAPTERS)}


@pytest.fixture(scope="module")
def tokenized(tiny_model_paths):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_paths["llama"])
    return [tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def hf_references(tiny_model_paths, lora_paths, tokenized, hf_greedy):
    """(adapter or None, prompt index) -> HF + PEFT greedy (tokens, logits), float32, each prompt alone."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    refs = {}
    for name in (None, *ADAPTERS):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_paths["llama"], dtype=torch.float32).eval()
        if name is not None:
            model = PeftModel.from_pretrained(model, lora_paths[name]).eval()
        for i, ids in enumerate(tokenized):
            refs[name, i] = hf_greedy(model, ids, MAX_NEW_TOKENS)
    return refs


def lora_request(name, lora_paths):
    return None if name is None else LoRARequest(name, 1 + ADAPTERS.index(name), lora_paths[name])


def greedy_cases(llm, cases, lora_paths, tokenized, hf_references, near_tie_check) -> int:
    """The near ties of each (adapter name or None, prompt index) of `cases` generated greedily in one call,
    each checked against HF + PEFT's reference."""
    outputs = llm.generate([{"prompt_token_ids": tokenized[i]} for _, i in cases],
                           SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS),
                           lora_request=[lora_request(name, lora_paths) for name, _ in cases])
    return sum(near_tie_check(f"{name} prompt {i}", out.outputs[0].token_ids, *hf_references[name, i])
               for (name, i), out in zip(cases, outputs))


def test_mixed_batch_matches_hf_peft(tiny_model_paths, lora_paths, tokenized, hf_references, near_tie_check):
    llm = LLM(model=tiny_model_paths["llama"], enable_lora=True, max_loras=3, max_lora_rank=16, num_kv_blocks=256)
    # Every prompt with every adapter and the base, interleaved: one step holds all four.
    cases = [(name, i) for i in range(len(tokenized)) for name in (None, *ADAPTERS)]
    ties = greedy_cases(llm, cases, lora_paths, tokenized, hf_references, near_tie_check)
    assert ties <= 1
    # The adapters matter: each changes some prompt's output from the base model's.
    for name in ADAPTERS:
        assert any(hf_references[name, i][0] != hf_references[None, i][0] for i in range(len(tokenized))), name


def test_adapters_never_share_kv(tiny_model_paths, lora_paths, tokenized, hf_references, near_tie_check):
    """The same prompt through two adapters and the base, one after the other with the prefix cache on:
    each computes its own KV (no hit across adapters) and gets its own HF-exact output; the same adapter
    again hits its own blocks."""
    llm = LLM(model=tiny_model_paths["llama"], enable_lora=True, max_loras=2, max_lora_rank=16, num_kv_blocks=256,
              block_size=8)
    prompt = {"prompt_token_ids": tokenized[2]}
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)
    cached = []
    for name in (None, "all", "attn", None, "all"):
        out = llm.generate(prompt, params, lora_request=lora_request(name, lora_paths))[0]
        near_tie_check(f"{name}", out.outputs[0].token_ids, *hf_references[name, 2])
        cached.append(out.num_cached_tokens)
    # The first of each computed its whole prompt; a repeat hits its own full blocks.
    full = (len(tokenized[2]) - 1) // 8 * 8
    assert cached == [0, 0, 0, full, full] and full > 0


def test_more_adapters_than_slots_in_one_call(tiny_model_paths, lora_paths, tokenized):
    """Refused before anything is added; calls within the limit then swap adapters through the slots."""
    llm = LLM(model=tiny_model_paths["llama"], enable_lora=True, max_loras=2, max_lora_rank=16, num_kv_blocks=64)
    with pytest.raises(ValueError, match="no room for LoRA adapters"):
        llm.generate([{"prompt_token_ids": tokenized[1]}] * 3, SamplingParams(max_tokens=2),
                     lora_request=[lora_request(n, lora_paths) for n in ADAPTERS])
    assert not llm.engine.has_unfinished_requests()
    for names in (ADAPTERS[:2], ADAPTERS[1:], ADAPTERS[::2]):
        outs = llm.generate([{"prompt_token_ids": tokenized[1]}] * 2, SamplingParams(max_tokens=2),
                            lora_request=[lora_request(n, lora_paths) for n in names])
        assert [len(o.outputs[0].token_ids) for o in outs] == [2, 2]


def test_triton_kernels_in_the_model_match_hf_peft(tiny_model_paths, lora_paths, tokenized, hf_references,
                                                  near_tie_check):
    """The Triton attention backend applies adapters with the Triton LoRA kernels (the interpreter, on CPU)."""
    llm = LLM(model=tiny_model_paths["llama"], enable_lora=True, max_loras=3, max_lora_rank=16, num_kv_blocks=64,
              attention_backend="triton")
    from epdserve.kernels import lora_shrink_expand

    assert llm.engine.runner.lora.shrink is lora_shrink_expand.lora_shrink
    cases = [(None, 1), ("all", 1), ("attn", 3), ("mlp-rslora", 1)]
    outputs = llm.generate([{"prompt_token_ids": tokenized[i]} for _, i in cases],
                           SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS),
                           lora_request=[lora_request(name, lora_paths) for name, _ in cases])
    for (name, i), out in zip(cases, outputs):
        near_tie_check(f"{name} prompt {i}", out.outputs[0].token_ids, *hf_references[name, i])


@pytest.fixture()
def bad_adapters(lora_paths, tiny_model_paths, tmp_path):
    from safetensors.torch import load_file, save_file

    from epdserve.shared.checkpoints.tiny_lora import build_tiny_lora

    bad = {}
    bad["rank"] = lora_paths["mlp-rslora"]  # rank 16 over a max of 8
    bad["other-base"] = str(build_tiny_lora(tiny_model_paths["qwen3"], tmp_path / "qwen3-lora", "attn"))
    corrupt = tmp_path / "corrupt"
    shutil.copytree(lora_paths["attn"], corrupt)
    data = (corrupt / "adapter_model.safetensors").read_bytes()
    (corrupt / "adapter_model.safetensors").write_bytes(data[:len(data) // 2])
    bad["corrupt"] = str(corrupt)
    dora = tmp_path / "dora"
    shutil.copytree(lora_paths["attn"], dora)
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    bad["dora"] = str(dora)
    bad["missing"] = str(tmp_path / "nowhere")
    nan = tmp_path / "nan"
    shutil.copytree(lora_paths["attn"], nan)
    tensors = load_file(nan / "adapter_model.safetensors")
    key = sorted(k for k in tensors if k.endswith("lora_B.weight"))[-1]
    tensors[key][0, 0] = float("nan")
    save_file(tensors, nan / "adapter_model.safetensors")
    bad["nan"] = str(nan)
    inf_alpha = tmp_path / "inf-alpha"
    shutil.copytree(lora_paths["attn"], inf_alpha)
    (inf_alpha / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": float("inf")}))
    bad["inf-alpha"] = str(inf_alpha)
    bool_rank = tmp_path / "bool-rank"
    shutil.copytree(lora_paths["attn"], bool_rank)
    (bool_rank / "adapter_config.json").write_text(json.dumps({**config, "r": True}))
    bad["bool-rank"] = str(bool_rank)
    huge = tmp_path / "huge"
    shutil.copytree(lora_paths["attn"], huge)
    with open(huge / "adapter_model.safetensors", "r+b") as f:
        f.truncate((1 << 30) + 1)  # sparse: nothing written, and nothing should be read
    bad["huge"] = str(huge)
    return bad


@pytest.mark.parametrize("case, message", [
    ("rank", "rank 16, above this server's max_lora_rank 8"),
    ("other-base", "an adapter for another base model"),
    ("corrupt", "adapter_model.safetensors is corrupt"),
    ("dora", "uses use_dora, which this server does not support"),
    ("missing", "no adapter_config.json"),
    ("nan", "holds weights that are not finite numbers"),
    ("inf-alpha", "'lora_alpha' must be a number"),
    ("bool-rank", "'r' in adapter_config.json must be a positive integer, got True"),
    ("huge", "adapter_model.safetensors is 1073741825 bytes, above the 1073741824 this server reads"),
])
def test_bad_adapters_are_refused_at_load(tiny_model_paths, lora_paths, tokenized, bad_adapters, case, message):
    from epdserve.shared.engine import LoRAAdapterError

    llm = LLM(model=tiny_model_paths["llama"], enable_lora=True, max_loras=2, max_lora_rank=8, num_kv_blocks=64)
    with pytest.raises(LoRAAdapterError, match=message):
        llm.generate({"prompt_token_ids": tokenized[1]}, SamplingParams(max_tokens=2),
                     lora_request=LoRARequest("bad", 1, bad_adapters[case]))
    # Nothing else disturbed: a good adapter and the base still run.
    outs = llm.generate([{"prompt_token_ids": tokenized[1]}] * 2, SamplingParams(max_tokens=2),
                        lora_request=[None, LoRARequest("attn", 2, lora_paths["attn"])])
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 2]


def test_a_service_reads_runtime_adapters_only_from_inside_its_roots(tiny_model_paths, lora_paths, tokenized,
                                                                    tmp_path):
    """With roots (a service's --lora-root), an adapter outside them, one whose folder or weights file links out
    of them, and one named like a path are refused, saying nothing of what exists outside; an adapter inside
    loads, and a start-up adapter (the operator's --lora-modules) loads from wherever it is."""
    from epdserve.shared.engine import LoRAAdapterError
    from epdserve.shared.models.lora_roots import outside_message

    root = tmp_path / "root"
    shutil.copytree(lora_paths["attn"], root / "attn")
    shutil.copytree(lora_paths["all"], root / "leaky")
    (root / "leaky" / "adapter_model.safetensors").unlink()
    (root / "leaky" / "adapter_model.safetensors").symlink_to(f"{lora_paths['all']}/adapter_model.safetensors")
    (root / "out").symlink_to(lora_paths["all"])
    llm = LLM(model=tiny_model_paths["llama"], enable_lora=True, max_loras=2, num_kv_blocks=64,
              lora_modules=[("mlp", lora_paths["mlp-rslora"])], lora_roots=[str(root)])

    def run(name: str, path: str):
        return llm.generate({"prompt_token_ids": tokenized[1]}, SamplingParams(max_tokens=2),
                            lora_request=LoRARequest(name, 9, path))

    for path in (lora_paths["all"], str(root / "out"), str(root / "absent"), f"{root}/../root/../..", "/etc",
                 "/proc/self/mem"):
        with pytest.raises(LoRAAdapterError) as refused:
            run("x", path)
        assert str(refused.value) == f"LoRA adapter 'x': {outside_message(path)}"
    with pytest.raises(LoRAAdapterError, match="no adapter_model.safetensors in"):
        run("leaky", str(root / "leaky"))
    with pytest.raises(LoRAAdapterError, match="lora_name must be"):
        run("../x", str(root / "attn"))
    assert len(run("attn", str(root / "attn"))[0].outputs[0].token_ids) == 2
    assert len(run("attn2", "attn")[0].outputs[0].token_ids) == 2  # relative to the root
    assert len(run("mlp", lora_paths["mlp-rslora"])[0].outputs[0].token_ids) == 2


def test_chat_takes_an_adapter(tiny_model_paths, lora_paths):
    llm = LLM(model=tiny_model_paths["llama"], enable_lora=True, max_loras=2, num_kv_blocks=64)
    conversation = [{"role": "user", "content": "Where do ships pass?"}]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    base = llm.chat(conversation, params)[0].outputs[0].token_ids
    adapted = llm.chat(conversation, params, lora_request=lora_request("all", lora_paths))[0].outputs[0].token_ids
    prompt = {"prompt_token_ids": llm.get_tokenizer().encode_chat(conversation, True)}
    assert adapted == llm.generate(prompt, params, lora_request=lora_request("all", lora_paths))[0].outputs[0].token_ids
    assert adapted != base


def test_lora_needs_enable_lora(tiny_model_paths, lora_paths):
    llm = LLM(model=tiny_model_paths["llama"], num_kv_blocks=64)
    with pytest.raises(ValueError, match="serves no adapters"):
        llm.generate([1, 2, 3], SamplingParams(max_tokens=2), lora_request=LoRARequest("a", 1, lora_paths["all"]))


def test_slot_bytes_are_what_the_model_allocates(tiny_model_paths):
    """The KV cache's budget counts the adapter slots as the model allocates them."""
    from epdserve.shared.models.lora_adapter import slot_bytes

    llm = LLM(model=tiny_model_paths["llama"], enable_lora=True, max_loras=3, max_lora_rank=8, num_kv_blocks=16)
    layers = llm.engine.runner.model.model.layers
    stacks = [p.lora for layer in layers for p in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                    layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)]
    allocated = sum(s.a.numel() * s.a.element_size() + s.b.numel() * s.b.element_size() for s in stacks)
    assert slot_bytes(llm.engine.config.model, llm.engine.config.lora) == allocated


def test_a_draft_model_drafts_for_adapter_requests(tiny_model_paths, lora_paths, tokenized, hf_references,
                                                   near_tie_check, caplog):
    """With adapters enabled, a draft model (without adapters: it drafts for every request with its base
    weights) speculates for the base and adapter requests alike: outputs equal HF + PEFT's, drafts are
    accepted, and no step fails."""
    llm = LLM(model=tiny_model_paths["llama"], enable_lora=True, max_loras=3, max_lora_rank=16, num_kv_blocks=256,
              speculative_config={"method": "draft_model", "num_speculative_tokens": 3,
                                  "model": tiny_model_paths["llama"], "adaptive": False})
    cases = [(name, i) for i in (0, 2) for name in (None, *ADAPTERS)]
    with caplog.at_level("WARNING", logger="epdserve"):
        ties = greedy_cases(llm, cases, lora_paths, tokenized, hf_references, near_tie_check)
    assert ties <= 1
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "WARNING")]
    # An adapter's requests alone have drafts accepted too.
    before = llm.engine.stats().spec_decode.num_accepted_tokens
    out = llm.generate({"prompt_token_ids": tokenized[1]}, SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS),
                       lora_request=lora_request("all", lora_paths))[0]
    near_tie_check("all prompt 1", out.outputs[0].token_ids, *hf_references["all", 1])
    assert llm.engine.stats().spec_decode.num_accepted_tokens > before


def test_seeded_sampling_with_an_adapter_is_reproducible_in_any_batch(tiny_model_paths, lora_paths, tokenized):
    """A seeded request with an adapter samples the same tokens, with bitwise the same logprobs, run alone
    twice and in batches that mix other adapters, the base model and other prompts' prefills, and continued on
    from half its tokens recomputed: its adapter's arithmetic does not depend on what else is in the step or
    on whether a token is computed in a prefill or a decode, as the base model's does not (checked first)."""
    llm = LLM(model=tiny_model_paths["llama"], enable_lora=True, max_loras=3, max_lora_rank=16, num_kv_blocks=256,
              max_num_batched_tokens=64)
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=40, logprobs=3, ignore_eos=True)
    prompt = {"prompt_token_ids": tokenized[0]}

    def seeded(out):
        return out.outputs[0].token_ids, [{t: (lp.logprob, lp.rank) for t, lp in e.items()}
                                          for e in out.outputs[0].logprobs]

    for name in (None, *ADAPTERS):
        alone = [seeded(llm.generate(prompt, params, lora_request=lora_request(name, lora_paths))[0])
                 for _ in range(2)]
        assert alone[0] == alone[1]
        # Beside other adapters, the base and prompts long enough to be chunked across the steps it decodes in.
        others = [(other, i) for i in (2, 1, 3) for other in (None, *ADAPTERS) if other != name]
        mixed = llm.generate([prompt] + [{"prompt_token_ids": tokenized[i] * 3} for _, i in others],
                             [params] + [SamplingParams(temperature=1.0, seed=9, max_tokens=30)] * len(others),
                             lora_request=[lora_request(name, lora_paths)] +
                                          [lora_request(other, lora_paths) for other, _ in others])
        assert seeded(mixed[0]) == alone[0], name
        # Continued from half its tokens (what a migrated stream does): the prompt and those tokens recomputed
        # as a prefill, then the same tokens as the first run's.
        cut = len(alone[0][0]) // 2
        engine = llm.engine
        engine.add_request("continued", engine.make_request(
            "continued", prompt, replace(params, output_kind=RequestOutputKind.DELTA),
            lora_request=lora_request(name, lora_paths), peer_token_ids=[list(alone[0][0][:cut])]))
        following = []
        while engine.has_work():
            following += [t for out in engine.step() if out.request_id == "continued" for t in out.outputs[0].token_ids]
        assert following == alone[0][0][cut:], name


def test_a_request_that_finds_every_slot_taken_at_its_start_is_refused_quietly(tiny_model_paths, lora_paths,
                                                                              tokenized, caplog):
    """Two requests checked while a slot was free, started one after the other: the second finds the one slot
    taken by the first's adapter and is refused with NoLoRASlotError (retryable: the service answers 503),
    without a traceback in the log - a full engine is not a fault."""
    import asyncio

    from epdserve.shared.engine import AsyncLLM, NoLoRASlotError
    from epdserve.shared.engine.llm import build_engine_config

    llm = AsyncLLM.from_config(build_engine_config(tiny_model_paths["llama"], enable_lora=True, max_loras=1,
                                                   max_lora_rank=16, num_kv_blocks=64))

    async def race() -> None:
        params = SamplingParams(max_tokens=40, ignore_eos=True)
        first, second = [await llm.make_request({"prompt_token_ids": tokenized[1]}, params, f"r-{name}",
                                                lora_request=lora_request(name, lora_paths))
                         for name in ("all", "attn")]
        running = llm.generate(first)
        await anext(running)  # its adapter holds the slot
        with pytest.raises(NoLoRASlotError, match="no room for LoRA adapter 'attn'"):
            async for _ in llm.generate(second):
                pass
        async for _ in running:
            pass

    try:
        with caplog.at_level("WARNING"):
            asyncio.run(race())
    finally:
        llm.shutdown()
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]


def test_async_adapters_change_only_on_the_engine_thread(tiny_model_paths, lora_paths, tokenized, monkeypatch):
    """AsyncLLM reads an adapter off both the event loop and the engine's thread, and keeps, seats and forgets
    it by typed commands on the engine's thread: load_lora, a request naming a new adapter, unload_lora; the
    names it reports follow at once. A refused adapter is kept nowhere."""
    import asyncio
    import threading

    from epdserve.shared.engine import AsyncLLM
    from epdserve.shared.engine.llm import build_engine_config
    from epdserve.shared.engine.lora_manager import LoRAManager

    calls = []
    for method in ("read", "add", "remove", "can_seat"):
        original = getattr(LoRAManager, method)

        def traced(self, *args, _method=method, _original=original):
            calls.append((_method, threading.current_thread().name))
            return _original(self, *args)

        monkeypatch.setattr(LoRAManager, method, traced)
    llm = AsyncLLM.from_config(build_engine_config(tiny_model_paths["llama"], enable_lora=True, max_loras=2,
                                                   max_lora_rank=8, num_kv_blocks=64))
    without = AsyncLLM.from_config(build_engine_config(tiny_model_paths["llama"], num_kv_blocks=16))

    async def main() -> None:
        await llm.load_lora(lora_request("all", lora_paths))
        await llm.load_lora(lora_request("all", lora_paths))  # kept already: not read again
        assert llm.lora_adapters() == ["all"]
        request = await llm.make_request({"prompt_token_ids": tokenized[1]}, SamplingParams(max_tokens=2), "r",
                                         lora_request=lora_request("attn", lora_paths))
        assert request.lora_name == "attn" and llm.lora_adapters() == ["all", "attn"]
        assert await llm.can_seat_lora("attn")
        async for _ in llm.generate(request):
            pass
        with pytest.raises(ValueError, match="above this server's max_lora_rank 8"):
            await llm.load_lora(LoRARequest("mlp-rslora", 9, lora_paths["mlp-rslora"]))
        assert await llm.unload_lora("attn") and not await llm.unload_lora("attn")
        assert llm.lora_adapters() == ["all"]
        with pytest.raises(ValueError, match="serves no adapters"):
            await without.load_lora(lora_request("all", lora_paths))

    try:
        asyncio.run(main())
    finally:
        llm.shutdown()
        without.shutdown()
    assert [m for m, _ in calls] == ["read", "add", "read", "add", "can_seat", "read", "remove", "remove"]
    assert all(thread == "epdserve-engine" for method, thread in calls if method != "read")
    assert all(thread not in ("epdserve-engine", "MainThread") for method, thread in calls if method == "read")
