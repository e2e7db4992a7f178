"""An engine's KV events name exactly the blocks its prefix cache holds, hashed as a router hashes them."""
from epdserve import LLM, SamplingParams
from epdserve.services.proxy.prefix_index import PrefixIndex
from epdserve.shared.block_hash import extend_block_hashes

BLOCK_SIZE = 16


def test_events_follow_the_prefix_cache_through_eviction(tiny_model_paths):
    llm = LLM(model=tiny_model_paths["llama"], num_kv_blocks=12, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    engine = llm.engine
    first = list(range(1, 65))  # 4 full blocks
    llm.generate([{"prompt_token_ids": first}], SamplingParams(temperature=0, max_tokens=1))
    snapshot = engine.kv_events(None)
    assert snapshot.snapshot
    hashes = extend_block_hashes([], first, BLOCK_SIZE)
    assert set(hashes[:3]) <= set(snapshot.stored)  # the last token is computed, so block 4 may be partial
    # Fill the pool with other prompts: the first prompt's blocks are evicted and say so.
    others = [[1000 + i * 100 + t for t in range(64)] for i in range(4)]
    llm.generate([{"prompt_token_ids": p} for p in others], SamplingParams(temperature=0, max_tokens=1))
    batch = engine.kv_events(snapshot.last_seq + 1)
    assert not batch.snapshot and batch.first_seq == snapshot.last_seq + 1
    assert set(hashes[:3]) & set(batch.removed)
    # A router that applied the snapshot, then the batch, knows exactly what the cache holds.
    index = PrefixIndex()
    for b in (snapshot, batch):
        assert index.apply("e", b.first_seq, b.last_seq, b.stored, b.removed, b.snapshot)
    cached = set(engine.scheduler.block_manager.cached_blocks)
    assert cached == set(engine.kv_events(None).stored)
    assert {h for h in [*hashes, *snapshot.stored, *batch.stored] if index.match([h])} == cached
