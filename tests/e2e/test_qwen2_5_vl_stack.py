"""Qwen2.5-VL through 1 encoder + 1 prefill + 1 decode + proxy, each its own process, driven by the official
openai client: the encoder runs the windowed vision tower on each image (its token count from its size),
the proxy computes the prompt's M-RoPE positions, prefill and decode rotate by them (decode continuing
from the largest plus one). Every answer must equal HF Qwen2_5_VLForConditionalGeneration.generate on the
same tiny checkpoint, token for token (greedy, float32; a mismatch only at a checked near-tie).

The decode speculates (prompt lookup, --speculative-config): the drafts it verifies take the positions
after the prompt's largest, and what it answers - greedy, seeded with n > 1, under a JSON schema - must be
token for token what our engine answers without speculation (and greedy, HF's), with drafts accepted.
"""
import base64
import io
import itertools
import json

import jsonschema
import openai
import pytest
import torch
from PIL import Image

from tests.integration.test_qwen2_5_vl import IMAGES, Pipeline, hf_generate, hf_processing

MAX_TOKENS = 12
NUM_BLOCKS = 256
GREEDY = dict(temperature=0, max_tokens=MAX_TOKENS, logprobs=True, extra_body={"return_tokens_as_token_ids": True})
QUESTION = "What is in this picture?"
SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3, "adaptive": false}'
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                                    "maxItems": 3}},
          "required": ["name", "tags"], "additionalProperties": False}


def image_part(data: bytes) -> dict:
    mime = "jpeg" if data[:2] == b"\xff\xd8" else "png"
    return {"type": "image_url", "image_url": {"url": f"data:image/{mime};base64," + base64.b64encode(data).decode()}}


# Three sizes (three token counts), one of them non-square, and two images in one prompt.
CASES = {
    "small-square": [{"role": "user", "content": [image_part(IMAGES["small-square"]),
                                                  {"type": "text", "text": QUESTION}]}],
    "wide": [{"role": "system", "content": "You describe images in one sentence."},
             {"role": "user", "content": [{"type": "text", "text": "Look at this:\n"}, image_part(IMAGES["wide"]),
                                          {"type": "text", "text": "\nWhat do you see?"}]}],
    "photo": [{"role": "user", "content": [image_part(IMAGES["photo"]), {"type": "text", "text": QUESTION}]}],
    "two-images": [{"role": "user", "content": [image_part(IMAGES["wide"]), {"type": "text", "text": "and"},
                                                image_part(IMAGES["photo"]),
                                                {"type": "text", "text": "Compare the two images."}]}],
    "text-only": [{"role": "user", "content": "Why is the sky blue?"}],
}


def hf_messages(messages: list[dict]) -> tuple[list[dict], list[bytes]]:
    """The OpenAI messages as HF's chat template takes them, and their images' bytes in order."""
    out, images = [], []
    for m in messages:
        if isinstance(m["content"], str):
            out.append(m)
            continue
        parts = []
        for part in m["content"]:
            if part["type"] == "image_url":
                images.append(base64.b64decode(part["image_url"]["url"].split(",", 1)[1]))
                parts.append({"type": "image"})
            else:
                parts.append(part)
        out.append({"role": m["role"], "content": parts})
    return out, images


@pytest.fixture(scope="module")
def hf_reference(qwen2_5_vl_path):
    from transformers import Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(qwen2_5_vl_path, dtype=torch.float32).eval()
    prepare = hf_processing(qwen2_5_vl_path)
    reference = {}
    with torch.no_grad():
        for name, messages in CASES.items():
            inputs = prepare(*hf_messages(messages))
            out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, pad_token_id=model.generation_config.eos_token_id)
            reference[name] = (out.sequences[0, inputs["input_ids"].shape[1]:].tolist(),
                               [step[0] for step in out.logits], inputs["input_ids"].shape[1])
    return reference


@pytest.fixture(scope="module")
def stack(qwen2_5_vl_path, stack_factory):
    # Every engine is given the speculative config, as a deployment that gives all of them the same options
    # does: the decode speculates, the prefill checks it and goes on without (it samples first tokens only).
    return stack_factory(qwen2_5_vl_path, encoders=1, prefills=1, decodes=1,
                         engine_args=["--num-kv-blocks", str(NUM_BLOCKS), "--speculative-config", SPEC],
                         proxy_args=["--rpc-timeout", "30"])


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.mark.parametrize("name", CASES)
def test_chat_equals_hf(client, hf_reference, name, near_tie_check, ids_of):
    ref, logits, num_prompt = hf_reference[name]
    resp = client.chat.completions.create(model="demo", messages=CASES[name], **GREEDY)
    ours = ids_of([c.token for c in resp.choices[0].logprobs.content])
    assert near_tie_check(name, ours, ref, logits) == 0, "the tiny model's logits are spread wide: no near-tie"
    assert resp.usage.prompt_tokens == num_prompt


def test_streamed_two_images_equal_hf_and_the_prefix_cache_keeps_images_apart(stack, client, hf_reference,
                                                                               near_tie_check, ids_of):
    ref, logits, _ = hf_reference["two-images"]
    tokens = []
    for event in client.chat.completions.create(model="demo", messages=CASES["two-images"], stream=True, **GREEDY):
        if event.choices and event.choices[0].logprobs:
            tokens += ids_of([c.token for c in event.choices[0].logprobs.content])
    assert near_tie_check("two-images streamed", tokens, ref, logits) == 0
    # Asked again, the prompt is found in the prefill's prefix cache, images and all.
    again = client.chat.completions.create(model="demo", messages=CASES["two-images"], **GREEDY)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert ids_of([c.token for c in again.choices[0].logprobs.content]) == tokens
    # The same prompt with another picture of the photo's size: same token ids, another image hash, so the
    # cache stops before that image.
    other = [dict(CASES["two-images"][0], content=[*CASES["two-images"][0]["content"][:2],
                                                    image_part(IMAGES["other-photo"]),
                                                    CASES["two-images"][0]["content"][3]])]
    changed = client.chat.completions.create(model="demo", messages=other, **GREEDY)
    assert changed.usage.prompt_tokens == again.usage.prompt_tokens
    assert changed.usage.prompt_tokens_details.cached_tokens < again.usage.prompt_tokens_details.cached_tokens
    assert stack.services["encoder-0"].alive


def test_a_strip_of_an_image_is_a_400_naming_the_field(client):
    buf = io.BytesIO()
    Image.new("RGB", (2010, 10), (200, 10, 10)).save(buf, format="PNG")
    with pytest.raises(openai.BadRequestError, match="aspect ratio"):
        client.chat.completions.create(model="demo", messages=[{"role": "user", "content": [
            image_part(buf.getvalue()), {"type": "text", "text": "hi"}]}], max_tokens=4)


@pytest.fixture(scope="module")
def without_speculation(qwen2_5_vl_path):
    """Our offline engine, no speculation, and the proxy's side of the image path run in-process."""
    from epdserve import LLM

    return LLM(qwen2_5_vl_path, num_kv_blocks=128), Pipeline(qwen2_5_vl_path)


_ids = itertools.count()


def one_token_per_step(without_speculation, messages, **params) -> list[list[int]]:
    """Each sequence's tokens for `messages` (OpenAI's, with images), from the engine without speculation."""
    from epdserve import SamplingParams
    from epdserve.shared.engine.sampling_params import RequestOutputKind

    llm, pipeline = without_speculation
    ids, placeholders, embeddings, positions = pipeline.prepare(*hf_messages(messages))
    request = llm.engine.make_request(f"r{next(_ids)}", {"prompt_token_ids": ids},
                                      SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY, **params),
                                      mm_placeholders=placeholders, mm_embeddings=embeddings,
                                      mrope_positions=positions)
    llm.engine.add_request(request.request_id, request)
    final = None
    while llm.engine.has_unfinished_requests():
        final = next((out for out in llm.engine.step() if out.finished), final)
    return [list(c.token_ids) for c in sorted(final.outputs, key=lambda c: c.index)]


def served(stack, client, ids_of, messages, **params) -> list[list[int]]:
    """Each sequence's tokens for `messages`, asked with a cache salt of its own: no engine holds the prompt,
    so it goes encoder -> prefill -> decode, which pulls its KV from the prefill."""
    decode = stack.services["decode-0"]
    pulled = decode.metrics().get("epdserve:remote_kv_requests_total", 0.0)
    resp = client.chat.completions.create(model="demo", messages=messages, logprobs=True, extra_body={
        "return_tokens_as_token_ids": True, "cache_salt": f"speculating-{next(_ids)}"}, **params)
    assert decode.metrics().get("epdserve:remote_kv_requests_total", 0.0) > pulled
    choices = sorted(resp.choices, key=lambda c: c.index)
    return [ids_of([c.token for c in choice.logprobs.content]) for choice in choices]


def accepted(stack) -> float:
    return stack.services["decode-0"].metrics().get("vllm:spec_decode_num_accepted_tokens_total", 0.0)


@pytest.mark.parametrize("name", ["photo", "two-images"])
def test_speculating_decode_answers_as_without_speculation_and_hf(stack, client, hf_reference, without_speculation,
                                                                  near_tie_check, ids_of, name):
    """After these images the tiny model repeats itself, so its own output is drafted and accepted: the drafts'
    positions continue from the prompt's largest, or the tokens after them would not be HF's."""
    before = accepted(stack)
    ours = served(stack, client, ids_of, CASES[name], temperature=0, max_tokens=MAX_TOKENS)[0]
    assert accepted(stack) > before
    assert ours == one_token_per_step(without_speculation, CASES[name], temperature=0, max_tokens=MAX_TOKENS)[0]
    ref, logits, _ = hf_reference[name]
    assert near_tie_check(name, ours, ref, logits) == 0


@pytest.mark.parametrize("name, params", [("photo", dict(temperature=0.6, seed=7, n=2, max_tokens=24)),
                                          ("two-images", dict(temperature=0.8, top_p=0.9, seed=3, n=2,
                                                              max_tokens=24))])
def test_speculating_decode_samples_n_seeded_sequences_as_without_speculation(stack, client, without_speculation,
                                                                             ids_of, name, params):
    before = accepted(stack)
    assert served(stack, client, ids_of, CASES[name], **params) == \
        one_token_per_step(without_speculation, CASES[name], **params)
    assert accepted(stack) > before


def test_speculating_decode_keeps_to_a_json_schema_as_without_speculation(stack, client, without_speculation,
                                                                          ids_of):
    from epdserve.shared.engine.sampling_params import StructuredOutputsParams

    messages = [{"role": "user", "content": [image_part(IMAGES["photo"]), {
        "type": "text", "text": 'Repeat: {"name": "ann", "tags": ["x", "x", "x"]} and again: '}]}]
    schema = {"type": "json_schema", "json_schema": {"name": "tagged", "schema": SCHEMA}}
    tokenizer = without_speculation[0].get_tokenizer()
    before = accepted(stack)
    for params in (dict(temperature=0.0, max_tokens=60), dict(temperature=1.0, seed=4, max_tokens=60)):
        ours = served(stack, client, ids_of, messages, response_format=schema, **params)[0]
        assert ours == one_token_per_step(without_speculation, messages, **params,
                                          structured_outputs=StructuredOutputsParams.json_schema(SCHEMA))[0]
        jsonschema.validate(json.loads(tokenizer.decode(ours)), SCHEMA)
    assert accepted(stack) > before


def test_the_prefill_checks_the_config_and_does_not_speculate(stack):
    assert "prefill does not speculate" in stack.services["prefill-0"].log.read_text()
    assert "vllm:spec_decode_num_drafts_total" not in stack.services["prefill-0"].metrics()


def test_unified_stack_equals_hf(qwen2_5_vl_path, start_stack, hf_reference, near_tie_check, ids_of):
    """1 encoder + 1 unified engine: the positions travel in the GenerateRequest instead."""
    stack = start_stack(qwen2_5_vl_path, encoders=1, unified=1, engine_args=["--num-kv-blocks", str(NUM_BLOCKS)])
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    for name in ("two-images", "wide"):
        ref, logits, _ = hf_reference[name]
        resp = client.chat.completions.create(model="demo", messages=CASES[name], **GREEDY)
        assert near_tie_check(name, ids_of([c.token for c in resp.choices[0].logprobs.content]), ref, logits) == 0
