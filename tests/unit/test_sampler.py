"""Sampler: filters never sample outside their set, seeds reproduce, penalties and min_tokens apply."""
import pytest
import torch

from epdserve.shared.request import Request
from epdserve.shared.sampler import Sampler, _top_k_top_p
from epdserve.shared.sampling_params import SamplingParams

VOCAB = 50


def reqs(n, **params):
    return [Request(f"r{i}", [1, 2, 3], SamplingParams(**params), max_model_len=1000) for i in range(n)]


def logits_batch(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, VOCAB, generator=g) * 3


def test_greedy_is_argmax():
    logits = logits_batch(4)
    out = Sampler()(logits, reqs(4, temperature=0.0))
    assert out.token_ids == logits.argmax(-1).tolist()


@pytest.mark.parametrize("k", [1, 3, 10])
def test_top_k_never_samples_outside_the_k_best(k):
    logits = logits_batch(8)
    allowed = logits.topk(k, dim=-1).indices
    sampler = Sampler(seed=1)
    for _ in range(30):
        out = sampler(logits, reqs(8, temperature=1.5, top_k=k))
        for i, t in enumerate(out.token_ids):
            assert t in allowed[i].tolist()


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_top_p_never_samples_outside_the_nucleus(p):
    logits = logits_batch(8, seed=2)
    probs = torch.softmax(logits, -1)
    sampler = Sampler(seed=3)
    for _ in range(30):
        out = sampler(logits, reqs(8, temperature=1.0, top_p=p))
        for i, t in enumerate(out.token_ids):
            # The nucleus: tokens whose higher-probability predecessors hold less than p of the mass.
            before = probs[i][probs[i] > probs[i, t]].sum()
            assert before < p


@pytest.mark.parametrize("min_p", [0.05, 0.3, 0.9])
def test_min_p_never_samples_below_threshold(min_p):
    logits = logits_batch(8, seed=4)
    probs = torch.softmax(logits, -1)
    sampler = Sampler(seed=5)
    for _ in range(30):
        out = sampler(logits, reqs(8, temperature=1.0, min_p=min_p))
        for i, t in enumerate(out.token_ids):
            assert probs[i, t] >= min_p * probs[i].max()


def test_top_k_top_p_mask_keeps_at_least_one():
    logits = torch.tensor([[5.0, 1.0, 0.0, -1.0]])
    masked = _top_k_top_p(logits, torch.tensor([0]), torch.tensor([1e-6]))
    assert torch.isfinite(masked).tolist() == [[True, False, False, False]]


def test_seed_reproduces_whatever_the_batch():
    logits = logits_batch(4, seed=6)
    alone = Sampler(seed=0)(logits[:1], reqs(1, temperature=1.0, seed=42)).token_ids[0]
    in_batch = Sampler(seed=99)(logits, reqs(1, temperature=1.0, seed=42) + reqs(3, temperature=1.0)).token_ids[0]
    assert in_batch == alone
    # And a sequence of draws repeats for the same seed.
    a, b = reqs(1, temperature=1.0, seed=7), reqs(1, temperature=1.0, seed=7)
    sa, sb = Sampler(seed=1), Sampler(seed=2)
    assert [sa(logits[:1], a).token_ids[0] for _ in range(20)] == [sb(logits[:1], b).token_ids[0] for _ in range(20)]


def test_different_seeds_differ():
    logits = torch.zeros(1, VOCAB)
    draws = {tuple(Sampler()(logits, reqs(1, temperature=1.0, seed=s)).token_ids) for s in range(10)}
    assert len(draws) > 1


def test_min_tokens_masks_stop_tokens():
    logits = torch.full((1, VOCAB), -5.0)
    logits[0, 7] = 10.0  # the stop token is by far the best
    r = reqs(1, temperature=0.0, min_tokens=2, stop_token_ids=[7])
    assert Sampler()(logits, r).token_ids[0] != 7
    r[0].output_token_ids = [1, 1]  # min_tokens reached
    assert Sampler()(logits, r).token_ids[0] == 7


def test_repetition_penalty_demotes_seen_tokens():
    logits = torch.zeros(1, VOCAB)
    logits[0, 2] = 1.0  # token 2 is in the prompt
    logits[0, 9] = 0.9
    assert Sampler()(logits, reqs(1, temperature=0.0)).token_ids == [2]
    assert Sampler()(logits, reqs(1, temperature=0.0, repetition_penalty=1.5)).token_ids == [9]


def test_presence_and_frequency_penalties_count_output_tokens():
    logits = torch.zeros(1, VOCAB)
    logits[0, 4] = 1.0
    logits[0, 5] = 0.5
    r = reqs(1, temperature=0.0, frequency_penalty=0.3)
    r[0].output_token_ids = [4, 4]
    assert Sampler()(logits, r).token_ids == [5]  # 1.0 - 2*0.3 < 0.5
    r = reqs(1, temperature=0.0, presence_penalty=0.4)
    r[0].output_token_ids = [4, 4]
    assert Sampler()(logits, r).token_ids == [4]  # 1.0 - 0.4 > 0.5


def test_logprobs_are_raw_and_ranked():
    logits = logits_batch(2, seed=8)
    out = Sampler()(logits, reqs(2, temperature=0.0, logprobs=3))
    raw = torch.log_softmax(logits, -1)
    for i, lp in enumerate(out.logprobs):
        top = raw[i].topk(3)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        assert lp.rank == 1 and lp.logprob == pytest.approx(float(top.values[0]))
