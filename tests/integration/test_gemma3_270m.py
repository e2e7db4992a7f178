"""Gemma 3 270M's real weights (`epdserve model gemma3-270m`, converted from the packaged GGUF; the engine serves
the GGUF file's Q4_K_M weights as they ship): greedy float32 output equals HF transformers `generate` on the
converted folder token for token, for chat prompts in Gemma 3's turn format, and for a prompt longer than the
sliding window (512) prefilled in chunks, then again from the prefix cache. A mismatch is accepted only at a
near-tie of HF's top-2 logits (tests/conftest.py). Every tensor the engine reads from the file is the converted
folder's bit for bit.

One engine and one HF model serve every test: the 262k-token vocabulary makes each load cost seconds."""
import pytest
import torch

from epdserve import LLM, SamplingParams

pytestmark = pytest.mark.slow

BLOCK_SIZE = 16
CHUNK = 64  # max_num_batched_tokens: a long prompt takes many steps to prefill
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Answer in one short sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
]
WINDS, SEAS, SKIES = ("north-west", "east", "south"), ("calm", "moderate", "rough", "moderate"), ("good", "poor")
# About 600 tokens: the sliding layers see only the last 512 of them.
LOG = "\n".join(f"Day {d}: wind from the {WINDS[d % 3]}, sea {SEAS[d % 4]}, visibility {SKIES[d % 2]}; the lamp "
                f"was lit at {17 + d % 3}:{d % 6}0." for d in range(1, 21))
LONG_CHAT = [{"role": "user", "content": f"{LOG}\n\nOn which days was the sea rough?"}]


@pytest.fixture(scope="module")
def gemma(gemma3_270m_path):
    """(our engine: prefix caching and chunked prefill on; HF's model; the folder's HF tokenizer, as the engine
    loaded it: a second load of a 262k-token vocabulary would cost seconds more)."""
    from transformers import AutoModelForCausalLM

    llm = LLM(model=str(gemma3_270m_path), num_kv_blocks=128, block_size=BLOCK_SIZE, max_num_batched_tokens=CHUNK,
              enable_prefix_caching=True)
    hf = AutoModelForCausalLM.from_pretrained(gemma3_270m_path, dtype=torch.float32).eval()
    return llm, hf, llm.engine.tokenizer.hf


def test_every_gguf_tensor_is_the_converted_folders_bit_for_bit(gemma3_270m_path):
    from epdserve.shared.models.gguf_weights import gguf_weights
    from epdserve.shared.models.quantized_weight import QuantizedWeight
    from epdserve.shared.models.weights import GGUF_WEIGHTS, iterate_weights

    reference = dict(iterate_weights(gemma3_270m_path))
    for name, tensor in gguf_weights(gemma3_270m_path / GGUF_WEIGHTS):
        values = tensor.dequantize() if isinstance(tensor, QuantizedWeight) else tensor
        assert torch.equal(values.view(torch.int32), reference.pop(name).view(torch.int32)), name
    assert not reference, f"not in the GGUF file: {sorted(reference)}"


def template_ids(tokenizer, chat) -> list[int]:
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False).input_ids


def test_the_folder_speaks_gemma3s_turn_format(gemma):
    llm, hf, tokenizer = gemma
    text = tokenizer.apply_chat_template(CHATS[1] + [{"role": "assistant", "content": " Rayleigh scattering. "},
                                                     {"role": "user", "content": "And at sunset?"}],
                                         add_generation_prompt=True, tokenize=False)
    assert text == ("<bos><start_of_turn>user\nAnswer in one short sentence.\n\nWhy is the sky blue?<end_of_turn>\n"
                    "<start_of_turn>model\nRayleigh scattering.<end_of_turn>\n<start_of_turn>user\nAnd at sunset?"
                    "<end_of_turn>\n<start_of_turn>model\n")
    ids = template_ids(tokenizer, CHATS[0])
    assert ids[:2] == [tokenizer.bos_token_id, tokenizer.convert_tokens_to_ids("<start_of_turn>")]
    assert ids.count(tokenizer.bos_token_id) == 1
    # A turn's end stops generation, as <eos> does.
    stops = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<end_of_turn>")]
    assert list(llm.engine.model_config.eos_token_ids) == hf.generation_config.eos_token_id == stops


def test_chat_greedy_equals_hf(gemma, hf_greedy, near_tie_check):
    llm, hf, tokenizer = gemma
    max_tokens = 16
    outputs = llm.chat(CHATS, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    for i, (chat, out) in enumerate(zip(CHATS, outputs)):
        prompt = template_ids(tokenizer, chat)
        assert out.prompt_token_ids == prompt
        tokens, logits = hf_greedy(hf, prompt, max_tokens)
        near_tie_check(f"chat {i}", out.outputs[0].token_ids, tokens, logits)


def test_long_prompt_chunked_then_from_the_prefix_cache_equals_hf(gemma, hf_greedy, near_tie_check):
    llm, hf, tokenizer = gemma
    max_tokens = 8
    prompt = template_ids(tokenizer, LONG_CHAT)
    assert hf.config.sliding_window < len(prompt) <= 128 * BLOCK_SIZE - max_tokens
    reference = hf_greedy(hf, prompt, max_tokens)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)

    before = llm.engine.stats()
    cold = llm.generate({"prompt_token_ids": prompt}, params)[0]
    after = llm.engine.stats()
    near_tie_check("chunked prefill", cold.outputs[0].token_ids, *reference)
    assert after.num_steps - before.num_steps >= -(-len(prompt) // CHUNK) + max_tokens - 1  # prefilled in chunks

    warm = llm.generate({"prompt_token_ids": prompt}, params)[0]
    hits = llm.engine.stats().prefix_cache_hits - after.prefix_cache_hits
    assert hits == (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE  # every full block but the one with the last token
    assert warm.num_cached_tokens == hits
    near_tie_check("prefix-cache hit", warm.outputs[0].token_ids, *reference)
    stats = llm.engine.stats()
    assert stats.num_running == stats.num_waiting == 0
