"""Qwen2.5-VL against HF transformers: image tokens, M-RoPE positions, encoder outputs and greedy tokens.

Ours: image bytes -> QwenImageProcessor (HF's pixel math) -> QwenVLEncoder (our windowed tower and merger)
-> each image's token expanded by its size -> M-RoPE positions (processing/mrope.py) -> the engine with
mm_placeholders, mm_embeddings and mrope_positions. HF: its image processor, the chat template and
Qwen2_5_VLProcessor's token expansion -> Qwen2_5_VLForConditionalGeneration.generate on the same tiny
checkpoint. Greedy float32 tokens must be equal; a mismatch is accepted only where HF's own top-2 logits
are within tests/conftest.py's TIE_GAP (on this tiny model's spread logits, none is expected).
"""
import io
import itertools
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from epdserve import LLM, SamplingParams
from epdserve.shared.checkpoints.tiny_qwen2_5_vl import IMAGE_PAD
from epdserve.shared.engine.sampling_params import RequestOutputKind
from epdserve.shared.models.qwen_vl_encoder import QwenVLEncoder
from epdserve.shared.processing.mrope import mrope_positions
from epdserve.shared.processing.multimodal import (ImagePromptSpec, expand_image_tokens, load_image_processor,
                                                   mm_hash)
from epdserve.shared.processing.tokenizer import load_tokenizer

MAX_NEW_TOKENS = 12
BLOCK_SIZE = 16
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, output_kind=RequestOutputKind.FINAL_ONLY)


def encode(image: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


def picture(height: int, width: int, seed: int) -> np.ndarray:
    """Smooth colour gradients with a few discs: closer to a photo than noise is."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width] / max(height, width)
    rgb = np.stack([np.sin(x * rng.uniform(2, 9) + c) * np.cos(y * rng.uniform(2, 9)) for c in range(3)], -1)
    for _ in range(4):
        cy, cx, r = rng.uniform(0, 1), rng.uniform(0, 1), rng.uniform(0.05, 0.3)
        rgb[(y - cy) ** 2 + (x - cx) ** 2 < r * r] = rng.uniform(-1, 1, 3)
    return ((rgb + 1) * 127.5).clip(0, 255).astype(np.uint8)


# Three sizes, hence three token counts (merged tokens of 28 x 28 pixels, at most 80 an image): a small
# square one, a wide non-square one, and a large photo the processor scales down to its pixel bound.
IMAGES = {
    "small-square": encode(Image.fromarray(picture(60, 60, 0))),
    "wide": encode(Image.fromarray(picture(90, 230, 1)), "JPEG"),
    "photo": encode(Image.fromarray(picture(300, 400, 2))),
    "other-photo": encode(Image.fromarray(picture(300, 400, 3))),  # same size as photo: same prompt tokens
}
QUESTION = "What is in this picture?"
PROMPTS = {
    "small-square": ([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}],
                     ["small-square"]),
    "wide": ([{"role": "system", "content": "You describe images in one sentence."},
              {"role": "user", "content": [{"type": "text", "text": "Look at this:\n"}, {"type": "image"},
                                           {"type": "text", "text": "\nWhat do you see?"}]}], ["wide"]),
    "photo": ([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}], ["photo"]),
    "same-photo": ([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is it?"}]}],
                   ["photo"]),
    "other-photo": ([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}],
                    ["other-photo"]),
    "two-images": ([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"},
                                                 {"type": "text", "text": "Compare the two images."}]}],
                   ["wide", "photo"]),
    "text-only": ([{"role": "user", "content": "Why is the sky blue?"}], []),
}


class Pipeline:
    """Our side of the image path, as the proxy and the encoder run it."""

    def __init__(self, model_path: str) -> None:
        self.images = load_image_processor(model_path)
        self.encoder = QwenVLEncoder.from_pretrained(model_path)
        self.spec = ImagePromptSpec.from_pretrained(model_path)
        self.tokenizer = load_tokenizer(model_path)

    def prepare(self, messages, image_files: list[bytes]):
        """(token ids, placeholders, embeddings by hash, M-RoPE positions) for one chat prompt."""
        config = self.images.config
        rgbs = [self.images.load(data) for data in image_files]
        hashes = [mm_hash(rgb, config) for rgb in rgbs]
        grids = [config.grid(*rgb.shape[:2]) for rgb in rgbs]
        prompt = expand_image_tokens(self.tokenizer.encode_chat(messages), self.spec, hashes,
                                     [config.num_tokens(*rgb.shape[:2]) for rgb in rgbs])
        embeddings = {}
        for rgb, item_hash in zip(rgbs, hashes):
            patches, grid = self.images.preprocess_patches(rgb)
            embeddings[item_hash] = self.encoder.encode(patches, [grid])[0]
        m = config.merge_size
        positions = mrope_positions(len(prompt.token_ids), prompt.mm_placeholders,
                                    [(t, h // m, w // m) for t, h, w in grids])
        return prompt.token_ids, prompt.mm_placeholders, embeddings, positions


_ids = itertools.count()


def run_engine(llm: LLM, prepared) -> list[list[int]]:
    """Add every prepared request at once, step to the end, return tokens in order."""
    engine = llm.engine
    requests = [engine.make_request(f"r{next(_ids)}", {"prompt_token_ids": ids}, PARAMS, mm_placeholders=phs,
                                    mm_embeddings=embs, mrope_positions=positions)
                for ids, phs, embs, positions in prepared]
    for request in requests:
        engine.add_request(request.request_id, request)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return [list(finals[r.request_id].outputs[0].token_ids) for r in requests]


def hf_generate(model, inputs: dict):
    out = model.generate(**inputs, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=model.generation_config.eos_token_id)
    return out.sequences[0, inputs["input_ids"].shape[1]:].tolist(), [step[0] for step in out.logits]


@pytest.fixture(scope="module")
def hf_model(qwen2_5_vl_path):
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration.from_pretrained(qwen2_5_vl_path, dtype=torch.float32).eval()


def hf_processing(model_path: str):
    """prepare(messages, image files) -> HF's own model inputs for a chat prompt: its chat template, image
    processor, and Qwen2_5_VLProcessor's expansion of each image pad into grid.prod() / merge_size**2 pads
    (HF's combined processor itself needs torchvision for its video half, so its image half is spelled out)."""
    from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    image_processor = AutoImageProcessor.from_pretrained(model_path)
    assert not type(image_processor).__name__.endswith("Fast")
    image_token_id = AutoConfig.from_pretrained(model_path).image_token_id

    def prepare(messages, image_files: list[bytes]) -> dict:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        extra = {}
        if image_files:
            pixels = image_processor(images=[Image.open(io.BytesIO(f)) for f in image_files], return_tensors="pt")
            pieces = text.split(IMAGE_PAD)
            assert len(pieces) == len(image_files) + 1
            counts = (pixels["image_grid_thw"].prod(-1) // image_processor.merge_size ** 2).tolist()
            text = pieces[0] + "".join(IMAGE_PAD * n + rest for n, rest in zip(counts, pieces[1:]))
            extra = dict(pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"])
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        return dict(input_ids=ids, attention_mask=torch.ones_like(ids),
                    mm_token_type_ids=(ids == image_token_id).int(), **extra)

    return prepare


@pytest.fixture(scope="module")
def hf_inputs(qwen2_5_vl_path):
    prepare = hf_processing(qwen2_5_vl_path)
    return {name: prepare(messages, [IMAGES[i] for i in images]) for name, (messages, images) in PROMPTS.items()}


@pytest.fixture(scope="module")
def hf_reference(hf_model, hf_inputs):
    with torch.no_grad():
        return {name: hf_generate(hf_model, dict(inputs)) for name, inputs in hf_inputs.items()}


@pytest.fixture(scope="module")
def pipeline(qwen2_5_vl_path):
    return Pipeline(qwen2_5_vl_path)


@pytest.fixture(scope="module")
def prepared(pipeline):
    return {name: pipeline.prepare(messages, [IMAGES[i] for i in images])
            for name, (messages, images) in PROMPTS.items()}


def assert_matches_hf(check, ours, reference, names) -> None:
    near_ties = sum(check(name, tokens, *ref) for name, tokens, ref in zip(names, ours, reference))
    assert near_ties == 0, "the tiny model's logits are spread wide: no near-tie is expected"


def check_engine_is_clean(llm):
    stats = llm.engine.stats()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_free_blocks == stats.num_total_blocks


# -- prompt layout, positions, encoder --------------------------------------------------------------------
def test_prompt_tokens_and_positions_equal_hf(prepared, hf_inputs, hf_model):
    counts = set()
    for name, (token_ids, placeholders, embeddings, positions) in prepared.items():
        inputs = hf_inputs[name]
        assert token_ids == inputs["input_ids"][0].tolist(), name
        assert len(placeholders) == len(PROMPTS[name][1])
        for ph in placeholders:
            assert embeddings[ph.mm_hash].shape == (ph.length, 128)
            counts.add(ph.length)
        expected, _ = hf_model.model.get_rope_index(
            inputs["input_ids"], inputs["mm_token_type_ids"], image_grid_thw=inputs.get("image_grid_thw"),
            attention_mask=inputs["attention_mask"]) if placeholders else (
            torch.arange(len(token_ids)).expand(3, 1, -1), None)
        assert [list(row) for row in positions] == expected[:, 0].tolist(), name
    assert len(counts) == 3, f"three image sizes should give three token counts, got {sorted(counts)}"


def test_encoder_equals_hf(pipeline, hf_model, hf_inputs):
    inputs = hf_inputs["two-images"]
    with torch.no_grad():
        expected = hf_model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output
    grids = [tuple(g) for g in inputs["image_grid_thw"].tolist()]
    ours = pipeline.encoder.encode(inputs["pixel_values"], grids)
    assert len(ours) == len(expected) == 2
    for a, b in zip(ours, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # One image alone gives what it gives beside another, and our pixels are HF's.
    patches, grid = pipeline.images.preprocess_patches(pipeline.images.load(IMAGES["photo"]))
    assert grid == grids[1] and torch.equal(patches, inputs["pixel_values"][-patches.shape[0]:])
    torch.testing.assert_close(pipeline.encoder.encode(patches, [grid])[0], ours[1], rtol=1e-6, atol=1e-6)


def test_encoder_refuses_patches_that_do_not_fit(pipeline):
    with pytest.raises(ValueError, match="patches must have shape"):
        pipeline.encoder.encode(torch.zeros(16, 1176), [(1, 4, 8)])
    with pytest.raises(ValueError, match="multiples of 2"):
        pipeline.encoder.encode(torch.zeros(15, 1176), [(1, 3, 5)])


# -- greedy tokens ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", [dict(enable_prefix_caching=False),
                                  # 24-token chunks: every image but the smallest is split across steps
                                  dict(enable_prefix_caching=False, max_num_batched_tokens=24),
                                  # a pool too small for the batch: requests are preempted and recomputed
                                  dict(enable_prefix_caching=False, num_kv_blocks=24, max_num_batched_tokens=256)],
                         ids=["batched", "chunked-prefill", "preemption"])
def test_greedy_equals_hf(qwen2_5_vl_path, prepared, hf_reference, path, near_tie_check):
    llm = LLM(model=qwen2_5_vl_path, **path)
    names = list(PROMPTS)
    # A text prompt may come without positions (as the proxy sends it): they are its token indices.
    text_ids, *_ = prepared["text-only"]
    ours = run_engine(llm, [prepared[n] for n in names] + [(text_ids, (), {}, None)])
    assert_matches_hf(near_tie_check, ours, [hf_reference[n] for n in names + ["text-only"]],
                      names + ["text-only without positions"])
    if "num_kv_blocks" in path:
        assert llm.engine.stats().num_preemptions > 0, "the pool was meant to be too small for the batch"
    check_engine_is_clean(llm)


def test_prefix_cache_hits_through_the_same_image_only(qwen2_5_vl_path, prepared, hf_reference, pipeline,
                                                       near_tie_check):
    llm = LLM(model=qwen2_5_vl_path, enable_prefix_caching=True, block_size=BLOCK_SIZE)

    def hits_of(name):
        before = llm.engine.stats().prefix_cache_hits
        assert_matches_hf(near_tie_check, run_engine(llm, [prepared[name]]), [hf_reference[name]], [name])
        return llm.engine.stats().prefix_cache_hits - before

    assert hits_of("photo") == 0
    # The same picture sent again in another file format: same hash, and the cache reaches past the image
    # up to where the question differs; the positions there are the same too.
    first_ids, (first_ph,), _, first_positions = prepared["photo"]
    bmp = pipeline.images.load(encode(Image.open(io.BytesIO(IMAGES["photo"])), "BMP"))
    assert mm_hash(bmp, pipeline.images.config) == first_ph.mm_hash
    same_ids, (same_ph,), _, same_positions = prepared["same-photo"]
    assert same_ph == first_ph
    common = next(i for i, (a, b) in enumerate(zip(first_ids, same_ids)) if a != b)
    assert common > same_ph.offset + same_ph.length
    assert [row[:common] for row in same_positions] == [row[:common] for row in first_positions]
    assert hits_of("same-photo") == min(common, len(same_ids) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert common // BLOCK_SIZE * BLOCK_SIZE >= same_ph.offset + same_ph.length
    # Another picture of the same size: identical token ids and positions, another hash; only the blocks
    # before the image may be reused.
    other_ids, (other_ph,), _, other_positions = prepared["other-photo"]
    assert other_ids == first_ids and other_positions == first_positions and other_ph.mm_hash != first_ph.mm_hash
    assert hits_of("other-photo") == other_ph.offset // BLOCK_SIZE * BLOCK_SIZE
    check_engine_is_clean(llm)


def test_engine_checks_mrope_positions(qwen2_5_vl_path, prepared, tmp_path, default_model_path):
    from epdserve.shared.checkpoints.tiny_models import build_tiny_model

    llm = LLM(model=qwen2_5_vl_path, num_kv_blocks=16)
    ids, phs, embs, positions = prepared["wide"]
    make = llm.engine.make_request
    with pytest.raises(ValueError, match="needs its mrope_positions"):
        make("a", {"prompt_token_ids": ids}, PARAMS, mm_placeholders=phs, mm_embeddings=embs)
    with pytest.raises(ValueError, match=r"3 rows of \d+ positions"):
        make("b", {"prompt_token_ids": ids}, PARAMS, mm_placeholders=phs,
             mrope_positions=[row[:-1] for row in positions])
    with pytest.raises(ValueError, match=r"must lie in \[0, "):
        make("c", {"prompt_token_ids": ids}, PARAMS, mm_placeholders=phs,
             mrope_positions=[row[:-1] + (len(ids),) for row in positions])
    text_llm = LLM(model=str(build_tiny_model("qwen2", tmp_path / "qwen2", default_model_path)), num_kv_blocks=16)
    with pytest.raises(ValueError, match="for models with M-RoPE"):
        text_llm.engine.make_request("d", [1, 2, 3], PARAMS, mrope_positions=[[0, 1, 2]] * 3)


@pytest.mark.parametrize("name", ["wide", "two-images", "text-only"])
def test_a_continued_request_recomputes_at_the_same_positions(qwen2_5_vl_path, prepared, hf_reference, name):
    """What a decode that recomputes the prompt after prefill's first token does, and a migrated stream after
    several: the prompt at its M-RoPE positions, the delivered tokens and the rest continuing from the
    prompt's largest position plus one - the rest equals HF's."""
    llm = LLM(model=qwen2_5_vl_path, num_kv_blocks=64)
    engine = llm.engine
    ids, phs, embs, positions = prepared[name]
    reference = hf_reference[name][0]
    assert len(reference) == MAX_NEW_TOKENS
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, output_kind=RequestOutputKind.DELTA)
    for cut in (1, 5):
        rid = f"{name}-{cut}"
        request = engine.make_request(rid, {"prompt_token_ids": ids}, params, mm_placeholders=phs,
                                      mm_embeddings=embs, mrope_positions=positions,
                                      peer_token_ids=[reference[:cut]])
        engine.add_request(rid, request)
        following = []
        while engine.has_work():
            following += [t for out in engine.step() if out.request_id == rid for t in out.outputs[0].token_ids]
        assert following == reference[cut:], f"cut at {cut}"
    check_engine_is_clean(llm)


@pytest.mark.parametrize("fail, drafting", [(False, False), (True, False), (False, True)],
                         ids=["pulled", "recomputed", "pulled-decode-drafting"])
def test_prefill_then_decode_equals_hf(qwen2_5_vl_path, prepared, hf_reference, copy_connector, keep, fail,
                                       drafting):
    """Prefill computes the image prompts at their positions and keeps the blocks; decode gets the same
    positions with prefill's first token, pulls the blocks (or, when the pull fails, recomputes the prompt
    at those positions) and continues from the prompt's largest position plus one: HF's tokens throughout.
    A decode with a draft model (the checkpoint itself) computes the draft's KV of the pulled prompt at
    those positions too, and verifies its drafts after them; after the text prompt, where the draft sees
    what the target sees, it accepts them."""
    import asyncio

    from epdserve import AsyncLLM
    from epdserve.shared.engine.llm import build_engine_config
    from epdserve.shared.engine.llm_engine import LLMEngine

    names = ["small-square", "wide", "two-images"] + (["text-only"] if drafting else [])
    prefill_engine = LLMEngine(build_engine_config(qwen2_5_vl_path, num_kv_blocks=64), detokenize=False)
    prefill_engine.add_connector(copy_connector(None), prefill_engine.finish_load, prefill_engine.release_kv)
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "model": qwen2_5_vl_path, "adaptive": False} if drafting else None
    decode = AsyncLLM.from_config(build_engine_config(qwen2_5_vl_path, num_kv_blocks=64, speculative_config=spec),
                                  detokenize=False)
    connector = copy_connector(decode.kv_cache, fail=fail)
    decode.add_connector(connector)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, output_kind=RequestOutputKind.DELTA)

    def prefill(rid, ids, phs, embs, positions):
        request = prefill_engine.make_request(rid, {"prompt_token_ids": ids}, params, mm_placeholders=phs,
                                              mm_embeddings=embs, mrope_positions=positions, max_output_tokens=1,
                                              kv_transfer_params=keep)
        prefill_engine.add_request(rid, request)
        first, held = None, None
        while prefill_engine.has_unfinished_requests():
            for out in prefill_engine.step():
                first = out.outputs[0].token_ids[0] if out.outputs[0].token_ids else first
                held = out.kv_block_ids or held
        return first, held

    async def decoded(rid, ids, phs, embs, positions, first, held):
        # Decode has the embeddings too: the recompute needs them (a service fetches them from the encoder).
        request = await decode.make_request({"prompt_token_ids": ids}, params, rid, mm_placeholders=phs,
                                            mm_embeddings=embs, mrope_positions=positions, peer_token_ids=[[first]],
                                            kv_transfer_params=(prefill_engine.runner.kv_cache, held, len(ids)))
        tokens = [first]
        async for out in decode.generate(request):
            tokens += out.outputs[0].token_ids
        return tokens

    async def main():
        runs = []
        for name in names:
            first, held = prefill(name, *prepared[name])
            runs.append(decoded(name, *prepared[name], first, held))
        return await asyncio.gather(*runs)

    try:
        results = asyncio.run(main())
        for name, tokens in zip(names, results):
            assert tokens == hf_reference[name][0], name
        assert {load.request_id for load in connector.loads} == set(names)
        for name in names:
            assert prefill_engine.release_kv(name)
        if drafting:
            assert decode.stats().spec_decode.num_accepted_tokens > 0
    finally:
        decode.shutdown()


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_verifies_drafts_at_the_positions_after_the_prompt(qwen2_5_vl_path, prepared,
                                                                               hf_reference, near_tie_check, method):
    """Drafts are computed at the positions their tokens would have: the prompt's largest M-RoPE position plus
    one, two, ... So with drafts accepted after image prompts, every prompt still equals HF. The draft model
    is the checkpoint itself, an M-RoPE model too, rotating the request's tokens and its drafts by the same
    3-D positions: where it sees what the target sees (a text prompt; it sees an image's placeholders, not
    its embeddings), every draft is accepted."""
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3, "adaptive": False} \
        if method == "ngram" else {"method": "draft_model", "num_speculative_tokens": 3, "model": qwen2_5_vl_path, "adaptive": False}
    llm = LLM(model=qwen2_5_vl_path, num_kv_blocks=128, speculative_config=spec)
    # The positions a step computes for a request's last token and 4 drafts after its first output token.
    ids, phs, embs, positions = prepared["two-images"]
    request = llm.engine.make_request("positions", {"prompt_token_ids": ids}, PARAMS, mm_placeholders=phs,
                                      mm_embeddings=embs, mrope_positions=positions)
    top = max(max(row) for row in positions)
    assert top + 1 < len(ids)  # the images' positions are compressed: the largest is far below the length
    assert request.rope_positions(len(ids), len(ids) + 5).tolist() == [list(range(top + 1, top + 6))] * 3
    stats = llm.engine.scheduler.spec_stats
    with_images = [name for name, (_, images) in PROMPTS.items() if images]
    ours = run_engine(llm, [prepared[n] for n in with_images])
    accepted, drafted = stats.num_accepted_tokens, stats.num_draft_tokens
    ours += run_engine(llm, [prepared["text-only"]])
    names = with_images + ["text-only"]
    assert_matches_hf(near_tie_check, ours, [hf_reference[n] for n in names], names)
    if method == "ngram":  # the tiny model repeats itself after these images: its own output is drafted
        assert accepted > 0
    else:
        assert stats.num_accepted_tokens - accepted == stats.num_draft_tokens - drafted > 0
    check_engine_is_clean(llm)


def test_n_sequences_share_the_prompt_and_its_positions(qwen2_5_vl_path, prepared, hf_reference):
    """n = 2 greedy: one computation of the image prompt, both sequences forked from it at its positions."""
    llm = LLM(model=qwen2_5_vl_path, num_kv_blocks=64)
    ids, phs, embs, positions = prepared["two-images"]
    params = SamplingParams(n=2, temperature=0.0, max_tokens=MAX_NEW_TOKENS, output_kind=RequestOutputKind.FINAL_ONLY)
    request = llm.engine.make_request("n2", {"prompt_token_ids": ids}, params, mm_placeholders=phs,
                                      mm_embeddings=embs, mrope_positions=positions)
    llm.engine.add_request("n2", request)
    final = None
    while llm.engine.has_unfinished_requests():
        final = next((out for out in llm.engine.step() if out.finished), final)
    assert [list(c.token_ids) for c in final.outputs] == [hf_reference["two-images"][0]] * 2
    check_engine_is_clean(llm)


def test_the_cli_builds_the_same_checkpoint(qwen2_5_vl_path, tmp_path, capsys):
    """`epdserve model tiny-qwen2.5-vl`: the project's builder, fixed seed - the tests' checkpoint, byte for byte."""
    from epdserve.services.cli import main as cli

    assert cli.main(["model", "tiny-qwen2.5-vl", "--out", str(tmp_path / "tiny")]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(tmp_path / "tiny")
    built = sorted(p.name for p in (tmp_path / "tiny").iterdir())
    assert built == sorted(p.name for p in Path(qwen2_5_vl_path).iterdir())
    for name in ("model.safetensors", "config.json", "preprocessor_config.json", "tokenizer.json"):
        assert (tmp_path / "tiny" / name).read_bytes() == (Path(qwen2_5_vl_path) / name).read_bytes(), name
