"""1 encoder + 1 prefill + 1 decode + proxy with every engine on UCX (`--kv-transport ucx`, every network
device: `--ucx-net-devices all`), each its own process, driven by the official openai client.

Greedy float32 answers equal HF transformers' token for token (a mismatch only at a checked near-tie of
HF's own logits) on text and image prompts, with the embeddings and the KV pulled over UCX, never
recomputed; and a prefill killed during decode's pull falls back to recomputing the prompt on decode,
as over ZeroMQ (test_epd_stack.py). One stack for the module; the kill comes last.
"""
import base64
import io

import openai
import pytest
import torch
from PIL import Image

from tests.e2e.conftest import picture_png

MAX_TOKENS = 16
NUM_BLOCKS = 512
TEXT_PROMPTS = ["The capital of France is", "def fibonacci(n):"]
GREEDY = dict(temperature=0, max_tokens=MAX_TOKENS)
IDS = dict(extra_body={"return_tokens_as_token_ids": True})
PULLED, RECOMPUTED, FAILED = ("epdserve:remote_kv_requests_total", "epdserve:local_prefills_total",
                              "epdserve:kv_transfer_failures_total")


@pytest.fixture(scope="module")
def stack(demo_model, stack_factory):
    return stack_factory(demo_model, encoders=1, prefills=1, decodes=1,
                         transport_args=["--kv-transport", "ucx", "--ucx-net-devices", "all"],
                         # One seat on decode: the kill test makes a request wait there for room.
                         engine_args=["--num-kv-blocks", str(NUM_BLOCKS), "--max-num-seqs", "1",
                                      "--lease-seconds", "5"],
                         # Every request through prefill, then decode: the handoff is what is tested.
                         proxy_args=["--routing-policy", "load", "--rpc-timeout", "10"])


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def decode_counts(stack) -> dict[str, float]:
    metrics = stack.services["decode-0"].metrics()
    return {name: metrics.get(name, 0.0) for name in (PULLED, RECOMPUTED, FAILED)}


def test_text_completions_equal_hf_with_the_kv_pulled_over_ucx(stack, client, smollm2, hf_greedy, near_tie_check,
                                                                ids_of):
    model, tokenizer = smollm2
    for prompt in TEXT_PROMPTS:
        before = decode_counts(stack)
        resp = client.completions.create(model="demo", prompt=prompt, logprobs=0, **GREEDY, **IDS)
        ref, logits = hf_greedy(model, tokenizer.encode(prompt), MAX_TOKENS)
        near_tie_check(prompt, ids_of(resp.choices[0].logprobs.tokens), ref, logits)
        after = decode_counts(stack)
        assert (after[PULLED] - before[PULLED], after[RECOMPUTED], after[FAILED]) == (1, 0, 0), after


def test_chat_equals_hf(stack, client, smollm2, hf_greedy, near_tie_check, ids_of):
    model, tokenizer = smollm2
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                                  add_special_tokens=False)
    ref, logits = hf_greedy(model, prompt_ids, MAX_TOKENS)
    resp = client.chat.completions.create(model="demo", messages=messages, logprobs=True, **GREEDY, **IDS)
    near_tie_check("chat", ids_of([c.token for c in resp.choices[0].logprobs.content]), ref, logits)
    assert decode_counts(stack)[RECOMPUTED] == 0


def test_image_chat_equals_hf_llava(stack, client, demo_model, near_tie_check, ids_of, hf_greedy):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(demo_model, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(demo_model)
    png, question = picture_png(3), "What is in this picture?"
    hf_messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    text = processor.apply_chat_template(hf_messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=text, images=[Image.open(io.BytesIO(png))], return_tensors="pt")
    with torch.no_grad():
        ref, logits = hf_greedy(model, inputs["input_ids"][0].tolist(), MAX_TOKENS,
                                pixel_values=inputs["pixel_values"])
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": question}]}]
    prefill, fetched = stack.services["prefill-0"], "epdserve:embeddings_fetched_total"
    before, embeddings_before = decode_counts(stack), prefill.metrics().get(fetched, 0.0)
    # The embeddings go encoder -> prefill over UCX, the prompt's KV prefill -> decode.
    resp = client.chat.completions.create(model="demo", messages=messages, logprobs=True, **GREEDY, **IDS)
    near_tie_check("image chat", ids_of([c.token for c in resp.choices[0].logprobs.content]), ref, logits)
    assert resp.usage.prompt_tokens == inputs["input_ids"].shape[1]
    assert decode_counts(stack)[PULLED] == before[PULLED] + 1
    assert prefill.metrics()[fetched] == embeddings_before + 1


def test_a_prefill_killed_during_the_pull_is_recomputed_on_decode(stack, smollm2, hf_greedy, near_tie_check, ids_of,
                                                                   prefill_killed_during_pull):
    before = decode_counts(stack)
    prompt = TEXT_PROMPTS[0]
    resp = prefill_killed_during_pull(stack, prompt, MAX_TOKENS)
    model, tokenizer = smollm2
    ref, logits = hf_greedy(model, tokenizer.encode(prompt), MAX_TOKENS)
    near_tie_check(prompt, ids_of(resp.choices[0].logprobs.tokens), ref, logits)
    after = decode_counts(stack)
    # The long stream was pulled; the request under test failed its fetch and was recomputed.
    assert (after[PULLED] - before[PULLED], after[RECOMPUTED] - before[RECOMPUTED], after[FAILED] - before[FAILED]) \
        == (1, 1, 1), (before, after)
    assert "recomputing the prompt here" in stack.services["decode-0"].log.read_text()
