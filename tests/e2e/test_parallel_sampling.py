"""n > 1, best_of and lists of prompts through the official openai client, on a unified engine and on
1 prefill + 1 decode: the prompt is prefilled once (engine metrics), decode pulls its KV once, seeded
choices repeat, greedy choices are HF's tokens."""
import httpx
import openai
import pytest
import torch

PROMPT = "Write a short poem about the sea."
MESSAGES = [{"role": "user", "content": PROMPT}]
SAMPLED = dict(temperature=1.0, max_tokens=12, seed=1234)
LAYOUTS = {"unified": dict(unified=1), "1p1d": dict(prefills=1, decodes=1)}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def stack(request, stack_factory, default_model_path):
    stack = stack_factory(default_model_path, engine_args=["--num-kv-blocks", "512"], **LAYOUTS[request.param])
    yield stack
    stack.stop()  # one stack at a time (each engine a SmolLM2 process): stopped before the next starts


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def engine(stack, role):
    return next(s for s in stack.services.values() if s.role == role)


def prefilling_engine(stack):
    return engine(stack, "prefill" if "prefill-0" in stack.services else "unified")


def test_n3_with_a_seed_repeats_differs_and_prefills_once(stack, client):
    prefill = prefilling_engine(stack)
    before = prefill.metrics()
    decode_before = engine(stack, "decode").metrics() if "decode-0" in stack.services else None
    first = client.chat.completions.create(model="demo", messages=MESSAGES, n=3, **SAMPLED)
    after = prefill.metrics()
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert len(set(texts)) == 3, texts
    # The prompt was looked up once and computed once (what the cache held aside), not three times.
    prompt_len, cached = first.usage.prompt_tokens, first.usage.prompt_tokens_details.cached_tokens
    assert after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"] == prompt_len
    computed = after["vllm:iteration_tokens_total_sum"] - before["vllm:iteration_tokens_total_sum"]
    decoded = 0 if decode_before is not None else first.usage.completion_tokens - 3
    assert computed == prompt_len - cached + decoded
    if decode_before is not None:  # decode pulled the KV once and forked it
        decode_after = engine(stack, "decode").metrics()
        assert decode_after["epdserve:remote_kv_requests_total"] - decode_before["epdserve:remote_kv_requests_total"] == 1
    again = client.chat.completions.create(model="demo", messages=MESSAGES, n=3, **SAMPLED)
    assert [c.message.content for c in again.choices] == texts


def test_n3_streaming_reassembles_to_the_same_choices(client):
    whole = client.chat.completions.create(model="demo", messages=MESSAGES, n=3, **SAMPLED)
    parts, finishes, usage = {}, {}, None
    for chunk in client.chat.completions.create(model="demo", messages=MESSAGES, n=3, stream=True,
                                                stream_options={"include_usage": True}, **SAMPLED):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            parts[choice.index] = parts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert [parts[i] for i in range(3)] == [c.message.content for c in whole.choices]
    assert finishes == {i: c.finish_reason for i, c in enumerate(whole.choices)}
    assert usage.prompt_tokens == whole.usage.prompt_tokens  # counted once, not per choice
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_greedy_n2_gives_twice_hf_greedy(client, default_model_path, hf_causal_lm, ids_of):
    from transformers import AutoTokenizer

    prompt = "The capital of France is"
    out = client.completions.create(model="demo", prompt=prompt, n=2, max_tokens=8, temperature=0, logprobs=0,
                                    extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
    tokens = [ids_of(c.logprobs.tokens) for c in out.choices]
    assert tokens[0] == tokens[1]
    model = hf_causal_lm(default_model_path)
    ids = AutoTokenizer.from_pretrained(default_model_path)(prompt, return_tensors="pt").input_ids
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                         pad_token_id=model.generation_config.eos_token_id)[0, ids.shape[1]:].tolist()
    assert tokens[0] == ref


def test_a_list_of_prompts_gives_one_choice_per_prompt_and_n(stack, client):
    prompts = ["The capital of France is", "Once upon a time", "The lighthouse keeper"]
    greedy = dict(max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    alone = [client.completions.create(model="demo", prompt=p, **greedy).choices[0].text for p in prompts]
    batch = client.completions.create(model="demo", prompt=prompts, n=2, **greedy)
    assert [c.index for c in batch.choices] == list(range(6))
    assert [c.text for c in batch.choices] == [t for t in alone for _ in range(2)]
    single = client.completions.create(model="demo", prompt=prompts[0], **greedy)
    assert batch.usage.prompt_tokens == sum(
        client.completions.create(model="demo", prompt=p, **greedy).usage.prompt_tokens for p in prompts)
    assert batch.usage.completion_tokens == 6 * 6 and single.usage.completion_tokens == 6

    token_lists = [httpx.post(stack.url + "/tokenize", json={"prompt": p}).json()["tokens"] for p in prompts]
    by_ids = client.completions.create(model="demo", prompt=token_lists, **greedy)
    assert [c.text for c in by_ids.choices] == alone

    parts = {}
    for chunk in client.completions.create(model="demo", prompt=prompts, n=2, stream=True, **greedy):
        for choice in chunk.choices:
            parts[choice.index] = parts.get(choice.index, "") + choice.text
    assert [parts[i] for i in range(6)] == [c.text for c in batch.choices]


def test_best_of_returns_the_most_likely_of_its_sequences(client):
    params = dict(prompt="The weather today is", max_tokens=8, temperature=1.0, seed=99,
                  extra_body={"ignore_eos": True})
    three = client.completions.create(model="demo", n=3, logprobs=0, **params)
    scores = [sum(c.logprobs.token_logprobs) for c in three.choices]
    best = client.completions.create(model="demo", n=1, best_of=3, **params)
    assert len(best.choices) == 1 and best.choices[0].index == 0
    assert best.choices[0].text == three.choices[scores.index(max(scores))].text
    assert best.choices[0].logprobs is None  # not asked for
    assert best.usage.completion_tokens == 3 * 8  # every sequence generated counts


@pytest.mark.parametrize("body, param", [
    (dict(n=2, best_of=1), "best_of"),
    (dict(best_of=2, stream=True), "best_of"),
    (dict(n=129), "n"),
    (dict(n=64, prompt=["a", "b", "c"]), "prompt"),
])
def test_bad_n_and_best_of_are_400s_naming_the_field(client, body, param):
    body = {"prompt": "Hello", "max_tokens": 2, **body}
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="demo", **body)
    assert info.value.status_code == 400 and param in str(info.value.body)
