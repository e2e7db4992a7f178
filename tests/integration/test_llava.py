"""The image path against HF transformers: encoder outputs, prompt layout and greedy tokens.

Ours: image bytes -> ImageProcessor -> LlavaEncoder -> image tokens expanded into placeholders ->
the engine with mm_placeholders/mm_embeddings. HF: AutoProcessor -> LlavaForConditionalGeneration.generate.
Greedy float32 tokens must be equal; as in test_hf_exactness.py, a mismatch is accepted only where HF's
own top-2 logits at that step are within tests/conftest.py's TIE_GAP, and the comparison of that sequence
ends there.
"""
import io
import itertools
import json

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from epdserve import LLM, SamplingParams
from epdserve.shared.processing.image_processor import ImageProcessor
from epdserve.shared.checkpoints.llava_demo import IMAGE_TOKEN
from epdserve.shared.models.llava_encoder import LlavaEncoder
from epdserve.shared.processing.multimodal import ImagePromptSpec, expand_image_tokens, mm_hash
from epdserve.shared.engine.sampling_params import RequestOutputKind
from epdserve.shared.models.weights import iterate_weights, language_model_weights

pytestmark = pytest.mark.slow  # more than ten seconds: left out of `make test-fast`

MAX_NEW_TOKENS = 16
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


IMAGES = {
    "photo": encode(Image.fromarray(picture(300, 400, 0))),
    "other": encode(Image.fromarray(picture(300, 400, 1))),  # same size as photo: same prompt tokens
    "tall-gray": encode(Image.fromarray(picture(480, 180, 2)).convert("L")),
    "small-jpeg": encode(Image.fromarray(picture(64, 96, 3)), "JPEG"),
    "wide-rgba": encode(Image.fromarray(np.dstack([picture(200, 520, 4), picture(200, 520, 5)[..., 0]]), "RGBA")),
}
QUESTION = "What is in this picture?"
PROMPTS = {
    "one-image": ([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}], ["photo"]),
    "same-image": ([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is it?"}]}],
                   ["photo"]),
    "other-image": ([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}], ["other"]),
    "text-around-image": ([{"role": "system", "content": "You describe images in one sentence."},
                           {"role": "user", "content": [{"type": "text", "text": "Look at this:\n"}, {"type": "image"},
                                                        {"type": "text", "text": "\nWhat do you see?"}]}],
                          ["tall-gray"]),
    "two-images": ([{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                                 {"type": "text", "text": "Compare the two images."}]}],
                   ["small-jpeg", "wide-rgba"]),
}


class Pipeline:
    """Our side of the image path, as the proxy and the encoder run it."""

    def __init__(self, model_path: str) -> None:
        self.images = ImageProcessor.from_pretrained(model_path)
        self.encoder = LlavaEncoder.from_pretrained(model_path)
        self.spec = ImagePromptSpec.from_pretrained(model_path)

    def prepare(self, tokenizer, messages, image_files: list[bytes]):
        """(token ids, placeholders, embeddings by hash) for one chat prompt; images encoded in one batch."""
        rgbs = [self.images.load(data) for data in image_files]
        hashes = [mm_hash(rgb, self.images.config) for rgb in rgbs]
        pixel_values = torch.stack([self.images.preprocess(rgb) for rgb in rgbs]) if rgbs else None
        embeddings = dict(zip(hashes, self.encoder.encode(pixel_values))) if rgbs else {}
        prompt = expand_image_tokens(tokenizer.encode_chat(messages), self.spec, hashes)
        return prompt.token_ids, prompt.mm_placeholders, embeddings


_ids = itertools.count()


def run_engine(llm: LLM, prepared) -> list[list[int]]:
    """Add every (token ids, placeholders, embeddings) request at once, step to the end, return tokens in order."""
    engine = llm.engine
    requests = [engine.make_request(f"r{next(_ids)}", {"prompt_token_ids": ids}, PARAMS, mm_placeholders=phs,
                                    mm_embeddings=embs) for ids, phs, embs in prepared]
    for request in requests:
        engine.add_request(request.request_id, request)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return [list(finals[r.request_id].outputs[0].token_ids) for r in requests]


def assert_matches_hf(check, ours: list[list[int]], reference, names) -> int:
    return sum(check(name, tokens, *ref) for name, tokens, ref in zip(names, ours, reference))


def hf_generate(model, inputs: dict):
    out = model.generate(**inputs, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=model.generation_config.eos_token_id)
    return out.sequences[0, inputs["input_ids"].shape[1]:].tolist(), [step[0] for step in out.logits]


@pytest.fixture(scope="module")
def hf_llava(llava_demo_path):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(llava_demo_path, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(llava_demo_path)


@pytest.fixture(scope="module")
def hf_inputs(hf_llava):
    """HF's own processing of every prompt: its chat template, image processor and token expansion."""
    _, processor = hf_llava
    inputs = {}
    for name, (messages, images) in PROMPTS.items():
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        pil = [Image.open(io.BytesIO(IMAGES[i])) for i in images]
        inputs[name] = processor(text=text, images=pil, return_tensors="pt")
    return inputs


@pytest.fixture(scope="module")
def hf_reference(hf_llava, hf_inputs):
    model, _ = hf_llava
    with torch.no_grad():
        return {name: hf_generate(model, dict(inputs)) for name, inputs in hf_inputs.items()}


@pytest.fixture(scope="module")
def pipeline(llava_demo_path):
    return Pipeline(llava_demo_path)


@pytest.fixture(scope="module")
def prepared(pipeline, llava_demo_path):
    from epdserve.shared.processing.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(llava_demo_path)
    return {name: pipeline.prepare(tokenizer, messages, [IMAGES[i] for i in images])
            for name, (messages, images) in PROMPTS.items()}


def check_engine_is_clean(llm):
    stats = llm.engine.stats()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_free_blocks == stats.num_total_blocks


# -- the demo checkpoint --------------------------------------------------------------------------------
def test_demo_checkpoint_is_smollm2_plus_an_image_token(llava_demo_path, default_model_path):
    from transformers import AutoProcessor, AutoTokenizer

    config = json.loads((default_model_path / "config.json").read_text())
    demo_config = json.loads(open(f"{llava_demo_path}/config.json").read())
    assert demo_config["architectures"] == ["LlavaForConditionalGeneration"]
    assert demo_config["text_config"]["vocab_size"] == config["vocab_size"] + 1
    tokenizer = AutoTokenizer.from_pretrained(llava_demo_path)
    assert tokenizer.convert_tokens_to_ids(IMAGE_TOKEN) == config["vocab_size"] == demo_config["image_token_index"]
    assert tokenizer.encode(f"a{IMAGE_TOKEN}b", add_special_tokens=False)[1] == config["vocab_size"]
    # The language model's tensors are SmolLM2's, unchanged; the embedding gains one zero row.
    smollm2 = dict(iterate_weights(default_model_path))
    demo_text = dict(language_model_weights(iterate_weights(llava_demo_path)))
    assert demo_text.keys() == smollm2.keys()
    for name, tensor in smollm2.items():
        if name == "model.embed_tokens.weight":
            assert torch.equal(demo_text[name][:-1], tensor) and not demo_text[name][-1].any()
        else:
            assert torch.equal(demo_text[name], tensor), name
    # A PIL-backed image processor, whatever backend transformers would prefer.
    processor = AutoProcessor.from_pretrained(llava_demo_path)
    assert not type(processor.image_processor).__name__.endswith("Fast")
    saved = json.loads(open(f"{llava_demo_path}/preprocessor_config.json").read())
    assert saved["image_processor_type"] == "CLIPImageProcessor"


def test_chat_template_renders_text_like_smollm2(llava_demo_path, default_model_path):
    from transformers import AutoTokenizer

    ours, smollm2 = AutoTokenizer.from_pretrained(llava_demo_path), AutoTokenizer.from_pretrained(default_model_path)
    conversations = [
        [{"role": "user", "content": "Hi there"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the sky blue?"},
         {"role": "assistant", "content": "Rayleigh scattering."}, {"role": "user", "content": "More, please."}],
    ]
    for conversation, generation in itertools.product(conversations, (True, False)):
        assert ours.apply_chat_template(conversation, add_generation_prompt=generation, tokenize=False) == \
            smollm2.apply_chat_template(conversation, add_generation_prompt=generation, tokenize=False)
    parts = [{"role": "user", "content": [{"type": "text", "text": "A"}, {"type": "image_url", "image_url": {}},
                                          {"type": "text", "text": "B"}]}]
    assert ours.apply_chat_template(parts, add_generation_prompt=True, tokenize=False).endswith(
        f"user\nA{IMAGE_TOKEN}B<|im_end|>\n<|im_start|>assistant\n")


def test_text_only_output_is_smollm2s(llava_demo_path, default_model_path, hf_causal_lm, near_tie_check):
    from epdserve.shared.processing.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(default_model_path)
    prompts = [tokenizer.encode_chat([{"role": "user", "content": q}])
               for q in ("What is the capital of France?", "Write a haiku about rain.", "List three prime numbers.")]
    prompts.append(tokenizer.encode("The lighthouse keeper climbed the stairs"))
    model = hf_causal_lm(default_model_path)
    with torch.no_grad():
        reference = [hf_generate(model, {"input_ids": torch.tensor([p]), "attention_mask": torch.ones(1, len(p),
                                                                                                     dtype=torch.long)})
                     for p in prompts]
    llm = LLM(model=llava_demo_path)
    ours = run_engine(llm, [(p, (), None) for p in prompts])
    assert_matches_hf(near_tie_check, ours, reference, [f"text-{i}" for i in range(len(prompts))])


# -- encoder and prompt layout --------------------------------------------------------------------------
def test_prompt_tokens_equal_hf_processor(prepared, hf_inputs, pipeline):
    for name, (token_ids, placeholders, embeddings) in prepared.items():
        assert token_ids == hf_inputs[name]["input_ids"][0].tolist(), name
        assert len(placeholders) == len(PROMPTS[name][1])
        for ph in placeholders:
            assert ph.length == pipeline.encoder.num_image_tokens == 256
            assert embeddings[ph.mm_hash].shape == (256, 576)


def test_pixels_and_encoder_equal_hf(pipeline, hf_llava, hf_inputs):
    model, _ = hf_llava
    names = ["one-image", "two-images", "text-around-image"]
    ours_pixels = torch.stack([pipeline.images(IMAGES[i]) for n in names for i in PROMPTS[n][1]])
    hf_pixels = torch.cat([hf_inputs[n]["pixel_values"] for n in names])
    assert torch.equal(ours_pixels, hf_pixels)
    with torch.no_grad():
        expected = model.get_image_features(pixel_values=hf_pixels, vision_feature_layer=-2,
                                            vision_feature_select_strategy="default").pooler_output
    ours = pipeline.encoder.encode(ours_pixels)
    assert len(ours) == len(expected)
    for a, b in zip(ours, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # One image alone gives what it gives inside a batch.
    torch.testing.assert_close(pipeline.encoder.encode(ours_pixels[1:2])[0], ours[1], rtol=1e-6, atol=1e-6)


# -- greedy tokens ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", [dict(enable_prefix_caching=False),
                                  # 64-token chunks: every image is split across several steps
                                  dict(enable_prefix_caching=False, max_num_batched_tokens=64)],
                         ids=["batched", "chunked-prefill"])
def test_greedy_equals_hf(llava_demo_path, prepared, hf_reference, path, near_tie_check):
    llm = LLM(model=llava_demo_path, **path)
    names = list(PROMPTS)
    ours = run_engine(llm, [prepared[n] for n in names])
    assert_matches_hf(near_tie_check, ours, [hf_reference[n] for n in names], names)
    check_engine_is_clean(llm)


def test_prefix_cache_hits_through_the_same_image_only(llava_demo_path, prepared, hf_reference, pipeline,
                                                       near_tie_check):
    llm = LLM(model=llava_demo_path, enable_prefix_caching=True, block_size=BLOCK_SIZE)

    def hits_of(name):
        before = llm.engine.stats().prefix_cache_hits
        assert_matches_hf(near_tie_check, run_engine(llm, [prepared[name]]), [hf_reference[name]], [name])
        return llm.engine.stats().prefix_cache_hits - before

    assert hits_of("one-image") == 0
    # The same picture sent again in another file format: same hash, and the cache reaches past the image
    # up to where the question differs.
    first_ids, (first_ph,), _ = prepared["one-image"]
    bmp = pipeline.images.load(encode(Image.open(io.BytesIO(IMAGES["photo"])), "BMP"))
    assert mm_hash(bmp, pipeline.images.config) == first_ph.mm_hash
    same_ids, (same_ph,), _ = prepared["same-image"]
    assert same_ph == first_ph
    common = next(i for i, (a, b) in enumerate(zip(first_ids, same_ids)) if a != b)
    assert common > same_ph.offset + same_ph.length
    assert hits_of("same-image") == min(common, len(same_ids) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert common // BLOCK_SIZE * BLOCK_SIZE >= same_ph.offset + same_ph.length - BLOCK_SIZE
    # Another picture of the same size: identical token ids, another hash; only the blocks before the
    # image may be reused.
    other_ids, (other_ph,), _ = prepared["other-image"]
    assert other_ids == first_ids and other_ph.mm_hash != first_ph.mm_hash
    assert hits_of("other-image") == other_ph.offset // BLOCK_SIZE * BLOCK_SIZE
    check_engine_is_clean(llm)


# -- other LLaVA layouts ---------------------------------------------------------------------------------
TINY_VISION = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                   num_attention_heads=4, image_size=28, patch_size=7, hidden_act="quick_gelu")
TINY_TEXT = dict(model_type="llama", hidden_size=48, intermediate_size=96, num_hidden_layers=1,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
LAYOUTS = {
    # LLaVA 1.5's choices, as the demo has them.
    "default": dict(vision_feature_layer=-2, vision_feature_select_strategy="default", projector_hidden_act="gelu"),
    # Several layers concatenated, the class token kept, another activation, no projector biases.
    "multi-layer-full": dict(vision_feature_layer=[-3, -1], vision_feature_select_strategy="full",
                             projector_hidden_act="gelu_pytorch_tanh", multimodal_projector_bias=False),
    "embeddings-layer": dict(vision_feature_layer=0, vision_feature_select_strategy="default",
                             projector_hidden_act="silu", vision_config=dict(TINY_VISION, hidden_act="gelu")),
}
# How the tower's and projector's tensors are named in checkpoints of various transformers versions.
NAMINGS = {
    "saved-by-transformers-5": lambda name: name.replace("model.vision_tower.", "vision_tower.").replace(
        "model.multi_modal_projector.", "multi_modal_projector."),
    "in-memory-transformers-5": lambda name: name,
    "transformers-4": lambda name: name.replace("model.vision_tower.", "vision_tower.vision_model.").replace(
        "model.multi_modal_projector.", "multi_modal_projector."),
}


@pytest.mark.parametrize("naming", NAMINGS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_encoder_equals_hf_on_other_layouts(tmp_path, layout, naming):
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    settings = dict(LAYOUTS[layout])
    config = LlavaConfig(vision_config=settings.pop("vision_config", TINY_VISION), text_config=TINY_TEXT,
                         image_token_id=63, **settings)
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).eval()
    state = model.state_dict()
    with torch.no_grad():  # layer norms away from 1/0, so that a mixed-up norm shows
        for name, tensor in state.items():
            if "norm" in name:
                tensor.add_(torch.randn_like(tensor) * 0.1)
    config.save_pretrained(tmp_path)
    rename = NAMINGS[naming]
    save_file({rename(k): v.contiguous() for k, v in state.items() if "lm_head" not in k},
              str(tmp_path / "model.safetensors"))
    pixels = torch.randn(3, 3, 28, 28)
    with torch.no_grad():
        # output_hidden_states spelled out: transformers 5 infers it from the layer index, and 0 reads as False.
        expected = model.get_image_features(pixel_values=pixels, vision_feature_layer=config.vision_feature_layer,
                                            vision_feature_select_strategy=config.vision_feature_select_strategy,
                                            output_hidden_states=True).pooler_output
    encoder = LlavaEncoder.from_pretrained(tmp_path)
    ours = encoder.encode(pixels)
    assert encoder.num_image_tokens == expected[0].shape[0]
    assert ImagePromptSpec.from_pretrained(tmp_path).num_image_tokens == encoder.num_image_tokens
    for a, b in zip(ours, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_encoder_refuses_bad_input_and_incomplete_checkpoints(tmp_path, pipeline):
    with pytest.raises(ValueError, match=r"shape \[n, 3, 224, 224\]"):
        pipeline.encoder.encode(torch.zeros(1, 3, 336, 336))
    with pytest.raises(ValueError, match=r"shape \[n, 3, 224, 224\]"):
        pipeline.encoder.encode(torch.zeros(3, 224, 224))
    from transformers import LlavaConfig

    LlavaConfig(vision_config=TINY_VISION, text_config=TINY_TEXT, image_token_id=63).save_pretrained(tmp_path)
    save_file({"multi_modal_projector.linear_1.weight": torch.zeros(48, 32)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks projector weights"):
        LlavaEncoder.from_pretrained(tmp_path)


def test_cli_builds_the_demo_into_the_cache(monkeypatch, tmp_path, capsys):
    from epdserve.services.cli import main as cli
    from epdserve.shared.checkpoints import default_model, llava_demo

    calls = []
    monkeypatch.setattr(default_model, "prepare_default_model", lambda cache_dir=None: tmp_path / "smollm2")
    monkeypatch.setattr(llava_demo, "build_llava_demo",
                        lambda out, text, seed=0: calls.append((out, text, seed)) or out)
    assert cli.main(["model", "llava-demo", "--cache-dir", str(tmp_path), "--seed", "3"]) == 0
    assert calls == [(tmp_path / "models" / "llava-demo", tmp_path / "smollm2", 3)]
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(tmp_path / "models" / "llava-demo")
