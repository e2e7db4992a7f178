"""The engine end to end on a tiny random model: API, stops, bad input, abort, streaming, no leaks."""
import asyncio
import json
import shutil
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from epdserve import LLM, AsyncLLM, RequestOutputKind, SamplingParams
from epdserve.shared.engine.request import RequestStatus

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_paths):
    return LLM(model=tiny_model_paths["llama"], num_kv_blocks=256)


def assert_clean(llm):
    stats = llm.engine.stats()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_free_blocks == stats.num_total_blocks


def test_generate_accepts_strings_and_token_ids(llm):
    tok = llm.get_tokenizer()
    text_out, ids_out = llm.generate(["Hello world", {"prompt_token_ids": tok.encode("Hello world")}],
                                     SamplingParams(max_tokens=6, **GREEDY))
    assert text_out.prompt_token_ids == ids_out.prompt_token_ids
    assert text_out.outputs[0].token_ids == ids_out.outputs[0].token_ids
    assert len(text_out.outputs[0].token_ids) == 6 and text_out.outputs[0].finish_reason == "length"
    assert text_out.outputs[0].text == tok.decode(text_out.outputs[0].token_ids)
    assert_clean(llm)


def test_chat_uses_the_chat_template(llm):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = llm.chat(messages, SamplingParams(max_tokens=3, **GREEDY))[0]
    tok = llm.get_tokenizer()
    assert out.prompt_token_ids == tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    suffix = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
    assert out.prompt_token_ids[-len(suffix):] == suffix


def test_stop_strings_and_stop_tokens(llm):
    params = SamplingParams(max_tokens=24, **GREEDY)
    base = llm.generate("The lighthouse keeper", params)[0].outputs[0]
    stop = base.text[len(base.text) // 2:len(base.text) // 2 + 3]
    cut = llm.generate("The lighthouse keeper", SamplingParams(max_tokens=24, stop=[stop], **GREEDY))[0].outputs[0]
    assert cut.text == base.text[:base.text.index(stop)]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    kept = llm.generate("The lighthouse keeper", SamplingParams(max_tokens=24, stop=stop,
                                                                include_stop_str_in_output=True, **GREEDY))[0]
    assert kept.outputs[0].text == base.text[:base.text.index(stop) + len(stop)]
    token = base.token_ids[4]
    by_token = llm.generate("The lighthouse keeper", SamplingParams(max_tokens=24, stop_token_ids=[token],
                                                                    **GREEDY))[0].outputs[0]
    first = base.token_ids.index(token)
    assert by_token.token_ids == base.token_ids[:first + 1]
    assert by_token.finish_reason == "stop" and by_token.stop_reason == token
    assert_clean(llm)


def test_eos_stops_unless_ignored(llm):
    eos = llm.engine.model_config.eos_token_ids[0]
    # Make EOS the sampled token by forbidding... nothing: instead ask min_tokens, which masks EOS.
    out = llm.generate("x", SamplingParams(max_tokens=5, temperature=0.0, min_tokens=5))[0].outputs[0]
    assert eos not in out.token_ids and len(out.token_ids) == 5


def test_seeded_sampling_reproduces_across_batches(llm):
    # The tiny model's logits are steep (scaled lm_head): a high temperature makes sampling matter.
    params = SamplingParams(temperature=5.0, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate("Once upon a time", params)[0].outputs[0].token_ids
    batch = llm.generate(["Once upon a time", "Other prompt", "A third one"],
                         [params, SamplingParams(temperature=1.0, max_tokens=12),
                          SamplingParams(temperature=0.7, seed=5, max_tokens=12)])
    assert batch[0].outputs[0].token_ids == alone
    other_seed = llm.generate("Once upon a time", SamplingParams(temperature=5.0, top_p=0.95, seed=4321,
                                                                  max_tokens=12, ignore_eos=True))[0]
    assert other_seed.outputs[0].token_ids != alone


def test_logprobs_per_token(llm):
    out = llm.generate("Hello", SamplingParams(max_tokens=4, logprobs=3, **GREEDY))[0].outputs[0]
    assert len(out.logprobs) == 4
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and entry[token].rank == 1  # greedy picks the best
        assert 3 <= len(entry) <= 4
        assert all(lp.logprob <= 0 for lp in entry.values())
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)))


@pytest.mark.parametrize("bad, message", [
    ("", "empty"),
    ({"prompt_token_ids": []}, "empty"),
    ({"prompt_token_ids": [1] * 5000}, "fewer than"),
    ({"prompt_token_ids": [10 ** 9]}, "token ids"),
    (None, "prompt must be"),
])
def test_bad_prompt_raises_and_leaves_others_alone(llm, bad, message):
    good = llm.engine.add_request("in-flight", "Hello", SamplingParams(max_tokens=3, **GREEDY))
    with pytest.raises(ValueError, match=message):
        llm.generate([bad], SamplingParams(max_tokens=2))
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert good.status == RequestStatus.FINISHED_LENGTH and good.num_output_tokens == 3
    assert_clean(llm)


@pytest.mark.parametrize("params, message", [
    (dict(temperature=-1), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(top_k=-5), "top_k"),
    (dict(min_p=2), "min_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(min_tokens=9, max_tokens=2), "min_tokens"),
    (dict(presence_penalty=5), "presence_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(logprobs=100), "logprobs"),
    (dict(stop=[""]), "stop"),
    (dict(n=0), "n must be a positive integer"),
])
def test_bad_sampling_params_raise(params, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**params)


def test_unknown_model_path_raises(tmp_path):
    with pytest.raises(FileNotFoundError, match="no model"):
        LLM(model=str(tmp_path / "nowhere"))


def test_unsupported_dtype_raises(tiny_model_paths):
    with pytest.raises(ValueError, match="dtype"):
        LLM(model=tiny_model_paths["llama"], dtype="int8")


def test_bfloat16_runs(tiny_model_paths, llm):
    bf16 = LLM(model=tiny_model_paths["llama"], dtype="bfloat16", num_kv_blocks=64)
    assert bf16.engine.runner.kv_cache.dtype == torch.bfloat16
    out = bf16.generate("The lighthouse keeper", SamplingParams(max_tokens=8, **GREEDY))[0].outputs[0]
    ref = llm.generate("The lighthouse keeper", SamplingParams(max_tokens=8, **GREEDY))[0].outputs[0]
    assert len(out.token_ids) == 8
    assert out.token_ids[0] == ref.token_ids[0]  # rounding may change later tokens, not the confident first


def test_sharded_checkpoint_loads_identically(tiny_model_paths, tmp_path, llm):
    from safetensors.torch import load_file, save_file

    src = tiny_model_paths["qwen2"]
    dst = tmp_path / "sharded"
    shutil.copytree(src, dst)
    (dst / "model.safetensors").unlink()
    tensors = load_file(f"{src}/model.safetensors")
    names = sorted(tensors)
    weight_map = {}
    for k, part in enumerate((names[::2], names[1::2])):
        fname = f"model-0000{k + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(dst / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    params = SamplingParams(max_tokens=8, **GREEDY)
    a = LLM(model=src, num_kv_blocks=32).generate("Hello there", params)[0].outputs[0].token_ids
    b = LLM(model=str(dst), num_kv_blocks=32).generate("Hello there", params)[0].outputs[0].token_ids
    assert a == b


def test_triton_backend_matches_torch(tiny_model_paths):
    """Triton kernels (interpreted on CPU) and the PyTorch path generate the same tokens."""
    prompts = [{"prompt_token_ids": list(range(100, 100 + n))} for n in (1, 5, 19)]
    params = SamplingParams(max_tokens=3, **GREEDY)
    kwargs = dict(num_kv_blocks=16, block_size=16, max_num_batched_tokens=16)  # chunked prefill too
    torch_out = LLM(model=tiny_model_paths["qwen2"], attention_backend="torch", **kwargs).generate(prompts, params)
    triton_llm = LLM(model=tiny_model_paths["qwen2"], attention_backend="triton", **kwargs)
    assert triton_llm.engine.runner.attention_backend == "triton"
    triton_out = triton_llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in triton_out] == [o.outputs[0].token_ids for o in torch_out]


@pytest.mark.parametrize("kv_cache_dtype, stored", [("fp8", torch.float8_e4m3fn), ("int8", torch.int8)])
def test_every_backend_reads_a_narrow_kv_cache_as_the_cpu_kernel_does(tiny_model_paths, kv_cache_dtype, stored):
    """--kv-cache-dtype fp8 and int8 on the Triton kernels (interpreted on CPU) and the torch path: the same
    stored values as the C++ CPU path (int8: the same rows and scales), widened as they are read, so the same
    tokens."""
    prompts = [{"prompt_token_ids": list(range(100, 100 + n))} for n in (1, 5, 19)]
    params = SamplingParams(max_tokens=3, **GREEDY)
    kwargs = dict(num_kv_blocks=16, block_size=16, max_num_batched_tokens=16, kv_cache_dtype=kv_cache_dtype)
    outs, pools = {}, {}
    for backend in ("cpu", "triton", "torch"):
        llm = LLM(model=tiny_model_paths["qwen2"], attention_backend=backend, **kwargs)
        assert llm.engine.runner.attention_backend == backend
        assert llm.engine.runner.kv_cache.dtype == stored
        outs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        pools[backend] = llm.engine.runner.kv_cache
    assert outs["triton"] == outs["cpu"] == outs["torch"]
    assert torch.equal(pools["triton"], pools["cpu"]) and torch.equal(pools["torch"], pools["cpu"])


def test_async_streams_deltas_and_aborts(tiny_model_paths):
    engine = AsyncLLM.from_model(tiny_model_paths["llama"], num_kv_blocks=128)

    async def collect(prompt, params, request_id):
        pieces = []
        async for out in engine.generate(prompt, params, request_id=request_id):
            pieces.append(out)
        return pieces

    async def main():
        delta = SamplingParams(max_tokens=10, output_kind=RequestOutputKind.DELTA, **GREEDY)
        cumulative = SamplingParams(max_tokens=10, **GREEDY)
        streamed, full = await asyncio.gather(collect("Hello", delta, "a"), collect("Hello", cumulative, "b"))
        assert "".join(o.outputs[0].text for o in streamed) == full[-1].outputs[0].text
        assert sum((o.outputs[0].token_ids for o in streamed), []) == full[-1].outputs[0].token_ids
        assert full[-1].finished and full[-1].outputs[0].finish_reason == "length"

        # Leaving the stream early aborts the request and frees its blocks.
        long = SamplingParams(max_tokens=500, **GREEDY)
        async for out in engine.generate("Hello", long, request_id="c"):
            if len(out.outputs[0].token_ids) >= 3:
                break
        for _ in range(100):
            await asyncio.sleep(0.02)
            stats = engine.stats()
            if stats.num_running == stats.num_waiting == 0:
                break
        assert stats.num_running == 0 and stats.num_free_blocks == stats.num_total_blocks

        # An explicit abort ends the stream with finish_reason "abort".
        async def abort_soon():
            await asyncio.sleep(0.05)
            await engine.abort("d")
        outs, _ = await asyncio.gather(collect("Hello", long, "d"), abort_soon())
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"

        with pytest.raises(ValueError, match="empty"):
            await collect("", delta, "e")

        # A stream left mid-step, its id taken again at once (a service sent the request once more): the new
        # stream hears of its own request alone - not of the step the old one was in, nor of the old one's abort.
        short = SamplingParams(max_tokens=5, **GREEDY)
        reference = (await collect("Hello", short, "ref"))[-1].outputs[0]
        entered, release = threading.Event(), threading.Event()

        def hold(num_tokens: int) -> None:  # on the engine's thread, before a step's forward
            if not release.is_set():
                entered.set()
                release.wait(60)

        old = engine.generate("Hello", long, request_id="f")
        await old.__anext__()
        engine.on_step(hold)
        assert await asyncio.to_thread(entered.wait, 60)
        await old.aclose()  # the engine is mid-step with it
        again = asyncio.create_task(collect("Hello", short, "f"))
        while "f" not in engine._streams:  # the new stream is open, its submit queued behind the abort
            await asyncio.sleep(0.01)
        release.set()
        outs = await again
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
        assert outs[-1].outputs[0].token_ids == reference.token_ids

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


@settings(max_examples=12, deadline=None)
@given(st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 12)),
    st.tuples(st.just("step"), st.integers(1, 4)),
    st.tuples(st.just("abort"), st.integers(0, 30)),
), max_size=25))
def test_random_add_step_abort_never_leaks(llm, ops):
    engine = llm.engine
    ids = []
    for i, op in enumerate(ops):
        if op[0] == "add":
            rid = f"h{i}-{len(ids)}"
            engine.add_request(rid, {"prompt_token_ids": [(i * 7 + j) % 50 + 100 for j in range(op[1])]},
                               SamplingParams(max_tokens=op[2], temperature=0.8, seed=i))
            ids.append(rid)
        elif op[0] == "step":
            for _ in range(op[1]):
                engine.step()
        elif ids:
            engine.abort_request(ids[op[1] % len(ids)])
    engine.abort_request(ids)
    assert_clean(llm)


def test_step_time_is_broken_down_by_phase(llm):
    before = llm.engine.stats()
    llm.generate(["Hello", "The lighthouse keeper"], SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True))
    after = llm.engine.stats()
    assert after.num_steps > before.num_steps
    for phase, seconds in after.step_seconds.items():
        if phase == "draft":  # proposals: this engine does not speculate
            assert seconds == 0.0
            continue
        assert seconds > before.step_seconds[phase], f"{phase} was not timed"


def test_aborted_prompts_leave_the_queue_estimate_at_once(llm):
    """Admission control (--max-queue-wait) reads how long queued prompts will take: once they are aborted
    and nothing is left to step, it must say nothing waits - no step would come to recount it, and every
    later request would be refused behind prompts nobody waits for."""
    engine = llm.engine
    params = SamplingParams(max_tokens=1, **GREEDY)
    ids = [f"queued-{i}" for i in range(6)]
    for i, request_id in enumerate(ids):
        engine.add_request(request_id, {"prompt_token_ids": [100 + i] * 200}, params)
    engine.step()  # learns the rate; the rest still wait
    assert engine.queue_estimate.seconds > 0
    engine.abort_request(ids)
    assert engine.queue_estimate.seconds == 0.0
    assert not engine.has_unfinished_requests()
