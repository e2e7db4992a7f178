"""Parallel sampling (n > 1) on SmolLM2: the prompt computed once, its blocks shared by reference count,
copy-on-write of the shared partial block, every block back when the sequences end, are aborted or are
preempted - and each sequence exactly the request with n = 1 and seed + index."""
import asyncio

import pytest

from epdserve import LLM, SamplingParams
from epdserve.shared.engine.llm_engine import LLMEngine
from epdserve.shared.engine.parallel_sampling import sequence_id
from epdserve.shared.engine.request import RequestStatus

pytestmark = pytest.mark.slow  # more than ten seconds: left out of `make test-fast`

PROMPT = "The old lighthouse keeper climbed the narrow stairs and then"  # 10 tokens: 2 full blocks of 4 and a partial one
BS = 4
SAMPLED = dict(temperature=1.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(default_model_path):
    return LLM(model=default_model_path, block_size=BS, num_kv_blocks=96)


def assert_clean(engine: LLMEngine):
    stats = engine.stats()
    assert stats.num_running == stats.num_waiting == 0 and engine.scheduler.requests == {}
    assert stats.num_free_blocks == stats.num_total_blocks
    assert engine.scheduler.groups == {} and engine.output_processor.groups == {}


def counting(engine: LLMEngine) -> list[int]:
    computed: list[int] = []
    engine.on_step_tokens = computed.append
    return computed


def test_each_sequence_is_its_own_seeded_request_and_the_prompt_is_computed_once(llm):
    prompt_len = len(llm.get_tokenizer().encode(PROMPT))
    computed = counting(llm.engine)
    out = llm.generate(PROMPT, SamplingParams(n=3, seed=11, **SAMPLED))[0]
    # One prefill of the whole prompt, then one token per sequence and step (the first tokens are all
    # sampled from the prompt's last row).
    assert sum(computed) == prompt_len + 3 * (SAMPLED["max_tokens"] - 1)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    tokens = [c.token_ids for c in out.outputs]
    assert len({tuple(t) for t in tokens}) == 3, tokens
    alone = [llm.generate(PROMPT, SamplingParams(seed=11 + i, **SAMPLED))[0].outputs[0].token_ids for i in range(3)]
    assert tokens == alone
    again = llm.generate(PROMPT, SamplingParams(n=3, seed=11, **SAMPLED))[0]
    assert [c.token_ids for c in again.outputs] == tokens
    assert_clean(llm.engine)


def test_greedy_sequences_are_the_greedy_request(llm):
    greedy = dict(temperature=0.0, max_tokens=8, ignore_eos=True)
    out = llm.generate(PROMPT, SamplingParams(n=2, **greedy))[0]
    single = llm.generate(PROMPT, SamplingParams(**greedy))[0].outputs[0]
    assert [c.token_ids for c in out.outputs] == [single.token_ids] * 2
    assert [c.text for c in out.outputs] == [single.text] * 2
    assert_clean(llm.engine)


def test_forked_sequences_share_the_prompt_blocks_and_copy_the_partial_one(llm):
    engine = llm.engine
    leader = engine.add_request("fork", PROMPT, SamplingParams(n=3, seed=1, **SAMPLED))
    assert len(leader.forks) == 2 and engine.scheduler.groups["fork"] == [sequence_id("fork", i) for i in range(3)]
    engine.step()  # the whole prompt, and three first tokens
    sequences = [engine.scheduler.requests[sequence_id("fork", i)] for i in range(3)]
    prompt_blocks = list(leader.block_ids)
    assert len(prompt_blocks) == 3  # 10 tokens in blocks of 4
    assert all(s.block_ids == prompt_blocks and s.num_output_tokens == 1 for s in sequences)
    assert [engine.block_manager.blocks[b].ref_cnt for b in prompt_blocks] == [3, 3, 3]

    kv = engine.runner.kv_cache
    partial = kv[:, :, prompt_blocks[2]].clone()
    engine.step()  # each sequence writes its first token into the partial block: two copy it, one keeps it
    full, last = [s.block_ids[:2] for s in sequences], [s.block_ids[2] for s in sequences]
    assert full == [prompt_blocks[:2]] * 3 and len(set(last)) == 3 and prompt_blocks[2] in last
    assert all(engine.block_manager.blocks[b].ref_cnt == 1 for b in last)
    assert [engine.block_manager.blocks[b].ref_cnt for b in prompt_blocks[:2]] == [3, 3]
    # The copies hold the prompt's two tokens of that block like the original did.
    for block in last:
        assert kv[:, :, block, :, :2].equal(partial[:, :, :, :2])

    engine.abort_request("fork")
    assert all(s.status == RequestStatus.FINISHED_ABORTED for s in sequences)
    assert_clean(engine)


def test_abort_before_the_fork_and_while_decoding_frees_everything(llm):
    engine = llm.engine
    engine.add_request("early", PROMPT, SamplingParams(n=4, seed=2, **SAMPLED))
    outs = engine.abort_request("early")
    assert [o.finished for o in outs] == [False, False, False, True]  # finished once every sequence has
    assert [c.finish_reason for c in outs[-1].outputs] == ["abort"] * 4
    assert_clean(engine)

    engine.add_request("late", PROMPT, SamplingParams(n=3, seed=2, **SAMPLED))
    engine.step()
    engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    engine.abort_request("late")
    assert_clean(engine)


def test_a_sequence_that_ends_before_the_fork_hands_the_prompt_to_the_next(llm):
    engine = llm.engine
    leader = engine.add_request("heir", PROMPT, SamplingParams(n=3, seed=5, **SAMPLED))
    engine.abort_request(leader.request_id)  # the sequence alone, not its group
    heir = engine.scheduler.waiting[0]
    assert heir.request_id == sequence_id("heir", 1) and [f.index for f in heir.forks] == [2]
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            finals[out.request_id] = out
    assert [c.index for c in finals["heir"].outputs] == [0, 1, 2]
    assert [c.finish_reason for c in finals["heir"].outputs] == ["abort", "length", "length"]
    alone = llm.generate(PROMPT, SamplingParams(seed=7, **SAMPLED))[0].outputs[0].token_ids
    assert finals["heir"].outputs[2].token_ids == alone
    assert_clean(engine)


def test_preempting_one_sequence_leaves_the_others_exact(default_model_path):
    # 10-token prompt + 12 new tokens = 6 blocks per sequence alone; 3 sequences sharing 2 full prompt blocks
    # need 14, the pool has 11: the newest sequence is preempted and recomputes while the others go on.
    small = LLM(model=default_model_path, block_size=BS, num_kv_blocks=11)
    params = dict(temperature=1.0, max_tokens=12, ignore_eos=True)
    out = small.generate(PROMPT, SamplingParams(n=3, seed=21, **params))[0]
    assert small.engine.stats().num_preemptions > 0
    alone = [small.generate(PROMPT, SamplingParams(seed=21 + i, **params))[0].outputs[0].token_ids for i in range(3)]
    assert [c.token_ids for c in out.outputs] == alone
    assert_clean(small.engine)


def test_a_group_on_every_seat_shares_them_with_later_requests_and_stays_exact(default_model_path):
    """n = 6 on a 6-seat engine, then two more requests: they are seated at once (the group parks some
    sequences meanwhile), and every sequence's tokens are those of its seed alone."""
    small = LLM(model=default_model_path, block_size=BS, num_kv_blocks=96, max_num_seqs=6)
    engine = small.engine
    params = dict(temperature=1.0, max_tokens=12, ignore_eos=True)
    engine.add_request("g", PROMPT, SamplingParams(n=6, seed=40, **params))
    engine.step()  # the prompt and the fork: six seats taken
    assert len(engine.scheduler.running) == 6
    for rid in ("late-0", "late-1"):
        engine.add_request(rid, PROMPT, SamplingParams(seed=50, **params))
    engine.step()
    assert {"late-0", "late-1"} <= {r.request_id for r in engine.scheduler.running}  # seated in one step
    assert engine.scheduler.parked
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            finals[out.request_id] = out
    alone = [small.generate(PROMPT, SamplingParams(seed=40 + i, **params))[0].outputs[0].token_ids for i in range(6)]
    assert [c.token_ids for c in finals["g"].outputs] == alone
    late = small.generate(PROMPT, SamplingParams(seed=50, **params))[0].outputs[0].token_ids
    assert finals["late-0"].outputs[0].token_ids == finals["late-1"].outputs[0].token_ids == late
    assert_clean(engine)


def test_a_group_larger_than_the_batch_is_refused(llm):
    with pytest.raises(ValueError, match="max_num_seqs"):
        llm.engine.make_request("big", PROMPT, SamplingParams(n=1000))


@pytest.mark.parametrize("pulled", [True, False])
def test_disaggregated_group_equals_one_engine(llm, default_model_path, copy_connector, prefill_held, pulled):
    """Prefill runs the group to its n first tokens on one set of blocks; decode loads them once and forks
    them (or, when the KV cannot be had, recomputes each sequence): the tokens of one engine."""
    from dataclasses import replace

    from epdserve import AsyncLLM, RequestOutputKind
    from epdserve.shared.engine.llm import build_engine_config

    params = SamplingParams(n=3, seed=3, **SAMPLED)
    unified = [c.token_ids for c in llm.generate(PROMPT, params)[0].outputs]
    config = build_engine_config(default_model_path, block_size=BS, num_kv_blocks=48)
    prefill = LLMEngine(config, detokenize=False)
    decode = AsyncLLM.from_config(config, detokenize=False)
    decode.add_connector(copy_connector(decode.kv_cache, fail=not pulled))
    try:
        prompt_ids = prefill.tokenizer.encode(PROMPT)
        first_tokens, held = prefill_held(prefill, "g", prompt_ids, params)
        assert len(held) == 3 and prefill.stats().num_free_blocks == 48 - 3  # one set of blocks for three

        async def main():
            group = await decode.make_request(prompt_ids, replace(params, output_kind=RequestOutputKind.DELTA), "g",
                                              peer_token_ids=[[t] for t in first_tokens],
                                              kv_transfer_params=(prefill.runner.kv_cache, held, len(prompt_ids)))
            tokens = {i: [t] for i, t in enumerate(first_tokens)}
            async for out in decode.generate(group):
                tokens[out.outputs[0].index] += out.outputs[0].token_ids
            return [tokens[i] for i in range(3)]

        assert asyncio.run(main()) == unified
        assert prefill.release_kv("g") and prefill.stats().num_free_blocks == 48
        stats = decode.stats()
        assert stats.num_running == stats.num_waiting == 0 and stats.num_free_blocks == stats.num_total_blocks
    finally:
        decode.shutdown()
