"""The local offload tier: a conversation whose blocks the pool evicted comes back from the tier, its prefill
mostly skipped, with exactly the tokens of a run without tiers - its restored tokens cached ones, in its
usage and in the engine's prompt counters; a corrupted tier file is recomputed."""
import pytest
import torch

from epdserve import LLM, SamplingParams
from epdserve.shared.block_hash import extend_block_hashes
from epdserve.shared.engine.outputs import RequestOutput

BLOCK_SIZE = 16
NUM_BLOCKS = 24  # a pool the other conversations overflow
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def conversation(i: int, length: int = 160) -> list[int]:
    return [(1 + i * 997 + t * 31) % 2000 + 3 for t in range(length)]


@pytest.fixture(scope="module")
def reference(tiny_model_paths):
    """Greedy tokens of conversation 0 on an engine without tiers, its pool never short."""
    llm = LLM(model=tiny_model_paths["llama"], num_kv_blocks=256, block_size=BLOCK_SIZE)
    return llm.generate([{"prompt_token_ids": conversation(0)}], GREEDY)[0].outputs[0].token_ids


def evict_then_return(llm: LLM) -> tuple[RequestOutput, int]:
    """Conversation 0, then enough others to evict it from the pool, then 0 again: its output the second
    time, and the prompt tokens the engine computed for it then."""
    engine = llm.engine
    llm.generate([{"prompt_token_ids": conversation(0)}], GREEDY)
    for i in range(1, 5):
        llm.generate([{"prompt_token_ids": conversation(i)}], GREEDY)
    hashes = extend_block_hashes([], conversation(0), BLOCK_SIZE)
    assert not set(hashes) & set(engine.block_manager.cached_blocks), "the pool still holds conversation 0"
    before = engine.num_prompt_tokens
    out = llm.generate([{"prompt_token_ids": conversation(0)}], GREEDY)[0]
    return out, engine.num_prompt_tokens - before


def test_without_tiers_an_evicted_conversation_is_prefilled_again(tiny_model_paths, reference):
    llm = LLM(model=tiny_model_paths["llama"], num_kv_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    out, computed = evict_then_return(llm)
    assert out.outputs[0].token_ids == reference
    assert computed == len(conversation(0)) and out.num_cached_tokens == 0
    stats = llm.engine.stats()  # no tier: nothing looked up beyond the pool
    assert stats.external_prefix_cache_queries == stats.external_prefix_cache_hits == 0


def test_an_evicted_conversation_comes_back_from_the_local_tier(tiny_model_paths, reference, tmp_path):
    llm = LLM(model=tiny_model_paths["llama"], num_kv_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
              kv_offloading_size=0.01, kv_offloading_path=str(tmp_path))
    before = llm.engine.stats()
    out, computed = evict_then_return(llm)
    assert out.outputs[0].token_ids == reference
    # 160 prompt tokens: 9 full blocks restored (the 10th holds the last token, which is computed).
    assert computed == len(conversation(0)) - 9 * BLOCK_SIZE
    # Restored tokens are cached ones: in the request's usage, and in the engine's counters of the prompts
    # it prefilled (the 6 requests, each looked up once; the last one's 9 blocks found in the tier).
    assert out.num_cached_tokens == 9 * BLOCK_SIZE
    after = llm.engine.stats()
    looked_up = 6 * len(conversation(0))
    assert after.prefix_cache_queries - before.prefix_cache_queries == looked_up
    assert after.external_prefix_cache_queries - before.external_prefix_cache_queries == looked_up
    assert after.external_prefix_cache_hits - before.external_prefix_cache_hits == 9 * BLOCK_SIZE
    sources = {k: after.prompt_tokens_by_source[k] - before.prompt_tokens_by_source.get(k, 0)
               for k in after.prompt_tokens_by_source}
    assert sources["external_kv_transfer"] == 9 * BLOCK_SIZE and sum(sources.values()) == looked_up
    stats = llm.engine.stats().kv_tiers["local"]
    assert stats.hit_blocks == 9 and stats.failed_restores == 0 and sum(stats.restore_buckets) == 1
    assert stats.saved_blocks >= 9 and stats.restored_bytes == 9 * llm.engine.connectors[0].file.block_bytes
    # The KV events name the tier: what the pool evicted, the local tier stored.
    events = llm.engine.kv_events(None)
    (local,) = events.tiers
    assert local.tier == "local" and set(extend_block_hashes([], conversation(1), BLOCK_SIZE)[:9]) <= set(local.stored)
    assert not list(tmp_path.iterdir())  # the tier's file left the folder once mapped
    llm.engine.close()


@pytest.mark.parametrize("kv_cache_dtype, stored", [("fp8", torch.float8_e4m3fn), ("int8", torch.int8)])
def test_an_8_bit_pool_keeps_its_blocks_8_bit_in_the_tier(tiny_model_paths, tmp_path, kv_cache_dtype, stored):
    """--kv-cache-dtype fp8 / int8: the tier holds blocks as the pool stores them (about a quarter of float32's
    bytes; int8 rows with their scales), and what comes back from it gives the tokens of an engine of that pool
    whose pool never evicted the conversation."""
    narrow = dict(model=tiny_model_paths["llama"], block_size=BLOCK_SIZE, kv_cache_dtype=kv_cache_dtype)
    want = LLM(num_kv_blocks=256, **narrow).generate([{"prompt_token_ids": conversation(0)}], GREEDY)[0]
    llm = LLM(num_kv_blocks=NUM_BLOCKS, kv_offloading_size=0.01, kv_offloading_path=str(tmp_path), **narrow)
    out, computed = evict_then_return(llm)
    assert out.outputs[0].token_ids == want.outputs[0].token_ids
    assert computed == len(conversation(0)) - 9 * BLOCK_SIZE
    file = llm.engine.connectors[0].file
    assert file.dtype == stored == llm.engine.runner.kv_cache.dtype
    assert file.block_bytes == llm.engine.runner.kv_cache[:, :, 0].numel()
    llm.engine.close()


def test_a_corrupted_tier_file_is_recomputed_not_used(tiny_model_paths, reference, tmp_path):
    llm = LLM(model=tiny_model_paths["llama"], num_kv_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
              kv_offloading_size=0.01, kv_offloading_path=str(tmp_path))
    tier = llm.engine.connectors[0]
    engine = llm.engine
    llm.generate([{"prompt_token_ids": conversation(0)}], GREEDY)
    for i in range(1, 5):
        llm.generate([{"prompt_token_ids": conversation(i)}], GREEDY)
    # Flip one bit of every block this tier holds, in the mapped file's pages, as a bad disk would.
    for block_hash in tier.hashes():
        data = tier.file.slot(tier.file._entries[block_hash].slot).view(-1).view(torch.uint8)
        data[7] ^= 0x40
    before = engine.num_prompt_tokens
    out = llm.generate([{"prompt_token_ids": conversation(0)}], GREEDY)[0]
    assert out.outputs[0].token_ids == reference
    assert engine.num_prompt_tokens - before == len(conversation(0))  # recomputed whole
    stats = engine.stats().kv_tiers["local"]
    assert stats.failed_restores == 1 and stats.corrupt_blocks >= 1 and stats.hit_blocks == 0
    # The load that failed brought nothing: no cached tokens, no tier hits.
    assert out.num_cached_tokens == 0 and engine.stats().external_prefix_cache_hits == 0
    engine.close()
