"""Sampler: draws follow the filtered distribution exactly, filters never sample outside their set, seeds
reproduce whatever the batch, penalties and min_tokens apply, and odd parameters never fail a batch."""
import pytest
import torch

from epdserve.shared.engine.request import Request
from epdserve.shared.engine.sampler import Sampler, _inverse_cdf, _kth_largest
from epdserve.shared.engine.sampling_params import SamplingParams

VOCAB = 50


def reqs(n, **params):
    return [Request(f"r{i}", [1, 2, 3], SamplingParams(**params), max_model_len=1000) for i in range(n)]


def logits_batch(n, seed=0, vocab=VOCAB):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, vocab, generator=g) * 3


# -- reference distributions, computed from the definitions ---------------------------------------------
def reference_probs(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """The distribution a random row must follow: softmax(logits / T), then min-p, top-k, top-p, each
    renormalising what survives. Ties at a top-k or top-p edge are all kept."""
    p = torch.softmax(logits.double() / temperature, -1)
    p = torch.where(p < min_p * p.max(), 0.0, p)
    if 0 < top_k < len(p):
        p = torch.where(p < p.sort(descending=True).values[top_k - 1], 0.0, p)
    p = p / p.sum()
    above = torch.stack([p[p > q].sum() for q in p])
    p = torch.where(above < top_p, p, 0.0)
    return p / p.sum()


def reference_penalties(logits, request):
    """The penalties one row at a time, as plainly as they are defined."""
    sp, row = request.sampling_params, logits.clone()
    for t in set(request.all_token_ids):
        if 0 <= t < len(row):
            row[t] = row[t] / sp.repetition_penalty if row[t] > 0 else row[t] * sp.repetition_penalty
    for t in set(request.output_token_ids):
        if 0 <= t < len(row):
            n = request.output_token_ids.count(t)
            row[t] -= sp.frequency_penalty * n + sp.presence_penalty
    return row


def chi_square_p_value(counts, expected_probs):
    """P-value of Pearson's chi-square test of `counts` against `expected_probs` (categories of expected
    count zero must have count zero, or the p-value is 0)."""
    n = counts.sum().double()
    expected = expected_probs.double() * n
    if bool((counts[expected == 0] > 0).any()):
        return 0.0
    live = expected > 0
    stat = ((counts[live].double() - expected[live]) ** 2 / expected[live]).sum()
    df = int(live.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def draw_counts(row_logits, n, sampler_seed=0, seeded=False, history=None, **params):
    """How often each token comes out of n independent draws from one row: a batch of n copies, each
    unseeded (the sampler's noise) or with its own seed."""
    vocab = len(row_logits)
    requests = []
    for i in range(n):
        r = Request(f"r{i}", [1, 2, 3], SamplingParams(seed=i if seeded else None, **params), max_model_len=1000)
        if history is not None:
            r.output_token_ids = list(history)
            r.all_token_ids = [1, 2, 3] + list(history)
        requests.append(r)
    out = Sampler(seed=sampler_seed)(row_logits.expand(n, vocab).contiguous(), requests)
    return torch.bincount(torch.tensor(out.token_ids), minlength=vocab)


SMALL = torch.tensor([2.0, 1.5, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -3.0])
CASES = {
    "temperature 1": dict(temperature=1.0),
    "temperature 0.6": dict(temperature=0.6),
    "temperature 1.7": dict(temperature=1.7),
    "top-k 3 (tie at the edge: 4 kept)": dict(temperature=1.0, top_k=3),
    "top-k 6": dict(temperature=0.8, top_k=6),
    "top-p 0.5": dict(temperature=1.0, top_p=0.5),
    "top-p 0.9": dict(temperature=1.3, top_p=0.9),
    "min-p 0.2": dict(temperature=1.0, min_p=0.2),
    "min-p, top-k, top-p": dict(temperature=0.9, min_p=0.05, top_k=7, top_p=0.8),
}


@pytest.mark.parametrize("seeded", [False, True], ids=["unseeded", "seeded"])
@pytest.mark.parametrize("case", CASES)
def test_draws_follow_the_filtered_distribution(case, seeded):
    params = CASES[case]
    counts = draw_counts(SMALL, 20000, seeded=seeded, **params)
    expected = reference_probs(SMALL, **params)
    assert chi_square_p_value(counts, expected) > 1e-4, (counts.tolist(), (expected * 20000).tolist())


@pytest.mark.parametrize("case", [case for case, params in CASES.items() if set(params) == {"temperature"}])
def test_draws_by_temperature_follow_the_distribution_where_the_kernel_is_not_built(case, monkeypatch):
    """Rows sampled by temperature alone go through the C++ op where it is built (above); elsewhere through the
    filters' PyTorch path, with the same distribution."""
    from epdserve.kernels import cpu_layer_ops

    monkeypatch.setattr(cpu_layer_ops, "available", lambda: False)
    params = CASES[case]
    counts = draw_counts(SMALL, 20000, seeded=True, **params)
    expected = reference_probs(SMALL, **params)
    assert chi_square_p_value(counts, expected) > 1e-4, (counts.tolist(), (expected * 20000).tolist())


def test_the_distribution_check_rejects_a_wrong_distribution():
    # The draws of a filtered row do not pass for the unfiltered or the unscaled distribution.
    counts = draw_counts(SMALL, 20000, temperature=1.0, top_p=0.9)
    assert chi_square_p_value(counts, reference_probs(SMALL, top_p=0.9)) > 1e-4
    assert chi_square_p_value(counts, reference_probs(SMALL)) == 0.0  # tokens outside the nucleus
    counts = draw_counts(SMALL, 20000, temperature=1.3)
    assert chi_square_p_value(counts, reference_probs(SMALL, temperature=1.3)) > 1e-4
    assert chi_square_p_value(counts, reference_probs(SMALL, temperature=1.2)) < 1e-4


def test_draws_follow_the_distribution_across_a_large_vocabulary():
    # 700 tokens: several blocks of the two-level inverse CDF and a padded last one; live tokens sit at
    # block edges, everything else can never be drawn.
    logits = torch.full((700,), float("-inf"))
    live = torch.tensor([0, 1, 255, 256, 257, 400, 511, 512, 640, 698, 699])
    logits[live] = torch.linspace(1.0, -1.0, len(live))
    counts = draw_counts(logits, 20000, temperature=1.0)
    assert chi_square_p_value(counts, reference_probs(logits)) > 1e-4
    # And a dense row: every token has some mass.
    logits = torch.randn(300, generator=torch.Generator().manual_seed(3)) * 0.5
    counts = draw_counts(logits, 30000, temperature=1.0, top_p=0.95)
    assert chi_square_p_value(counts, reference_probs(logits, top_p=0.95)) > 1e-4


def test_draws_follow_the_penalised_distribution():
    logits = torch.tensor([1.0, 0.8, 0.6, -0.4, 0.3, 0.0, -0.2, -1.0])
    history = [0, 0, 3, 5]
    params = dict(temperature=0.8, repetition_penalty=1.4, frequency_penalty=0.3, presence_penalty=0.2)
    counts = draw_counts(logits, 20000, history=history, **params)
    request = reqs(1, **params)[0]
    request.output_token_ids, request.all_token_ids = list(history), [1, 2, 3] + history
    expected = reference_probs(reference_penalties(logits, request), temperature=0.8)
    assert chi_square_p_value(counts, expected) > 1e-4


@pytest.mark.parametrize("vocab", [900, 832, 1024])  # padded blocks of 256, blocks of 64, of 256
def test_inverse_cdf_splits_the_unit_interval_by_weight(vocab):
    # Evenly spaced uniforms land on each token in proportion to its weight, to within one: any offset at
    # a block edge shows. Zero weights (whole blocks of them too), a huge block before tiny ones.
    weights = torch.zeros(2, vocab)
    weights[0, [3, 100, 255]] = torch.tensor([5000.0, 3000.0, 1991.0])
    weights[0, [256, 300, 700, vocab - 1]] = torch.tensor([1.0, 2.0, 3.0, 3.0])
    weights[1] = torch.rand(vocab, generator=torch.Generator().manual_seed(1)) ** 4
    weights[1, 256:512] = 0.0
    n = 20000
    u = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    for row in weights:
        drawn = _inverse_cdf(row.expand(n, -1).contiguous(), u)
        counts = torch.bincount(drawn, minlength=vocab).double()
        assert bool(((counts - n * row.double() / row.double().sum()).abs() <= 1.0).all())
    # The ends of [0, 1) give the first and the last token of nonzero weight.
    row = torch.zeros(1, vocab)
    row[0, [260, 300, 530]] = torch.tensor([1.0, 0.5, 0.5])
    ends = torch.tensor([0.0, torch.nextafter(torch.tensor(1.0, dtype=torch.float64), torch.tensor(0.0)).item()],
                        dtype=torch.float64)
    assert _inverse_cdf(row.expand(2, -1).contiguous(), ends).tolist() == [260, 530]


@pytest.mark.parametrize("vocab", [8192, 8000, 1000])  # blocks of 256, of 64, padded blocks
def test_kth_largest_matches_a_full_topk(vocab):
    g = torch.Generator().manual_seed(20)
    weights = torch.softmax(torch.randn(8, vocab, generator=g) * 3, -1)
    weights[1] = 0.0  # fewer than k nonzero values
    weights[1, [5, 4000 % vocab]] = 0.5
    weights[2] = torch.randint(0, 4, (vocab,), generator=g).float()  # ties everywhere, across blocks
    weights[3, ::2] = 0.0
    weights[4] = 1.0 / vocab  # one value
    for k_max in [1, 2, 7, 16]:
        k = torch.randint(1, k_max + 1, (8,), generator=g)
        k[0] = k_max
        expected = torch.stack([weights[i].topk(int(k[i])).values[-1] for i in range(8)]).unsqueeze(1)
        assert torch.equal(_kth_largest(weights, k), expected)


def test_greedy_is_argmax():
    logits = logits_batch(4)
    out = Sampler()(logits, reqs(4, temperature=0.0))
    assert out.token_ids == logits.argmax(-1).tolist()


def test_greedy_is_argmax_after_penalties():
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(16, VOCAB, generator=g)
    requests = []
    for i in range(16):
        sp = SamplingParams(temperature=0.0, repetition_penalty=[1.0, 1.3, 0.8, 2.0][i % 4],
                            frequency_penalty=[0.0, 0.5, -0.4, 1.5][i // 4], presence_penalty=[0.0, 0.7][i % 2])
        r = Request(f"r{i}", torch.randint(VOCAB, (5,), generator=g).tolist(), sp, max_model_len=1000)
        for t in torch.randint(VOCAB, (int(torch.randint(0, 12, (), generator=g)),), generator=g).tolist():
            r.append_output_token(t)
        requests.append(r)
    expected = torch.stack([reference_penalties(logits[i], r) for i, r in enumerate(requests)])
    torch.testing.assert_close(Sampler()._apply_logits_processors(logits, requests)[0], expected)
    assert Sampler()(logits, requests).token_ids == expected.argmax(-1).tolist()
    # Rows without penalties in a batch with some are left exactly as they were.
    mixed = requests[:3] + reqs(2, temperature=0.0)
    penalised = Sampler()._apply_logits_processors(logits[:5], mixed)[0]
    assert torch.equal(penalised[3:], logits[3:5])


@pytest.mark.parametrize("k", [1, 3, 10])
def test_top_k_never_samples_outside_the_k_best(k):
    logits = logits_batch(8)
    allowed = logits.topk(k, dim=-1).indices
    sampler = Sampler(seed=1)
    for _ in range(30):
        out = sampler(logits, reqs(8, temperature=1.5, top_k=k))
        for i, t in enumerate(out.token_ids):
            assert t in allowed[i].tolist()


def test_top_k_keeps_ties_at_the_edge():
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0, 3.0, 2.0]])
    seen = set(draw_counts(logits[0], 4000, temperature=5.0, top_k=2).nonzero().flatten().tolist())
    assert seen == {1, 3, 4}


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


def test_top_p_keeps_at_least_the_most_likely_token():
    logits = logits_batch(8, seed=9)
    out = Sampler()(logits, reqs(8, temperature=1.0, top_p=1e-6))
    assert out.token_ids == logits.argmax(-1).tolist()


@pytest.mark.parametrize("min_p", [0.05, 0.3, 0.9])
def test_min_p_never_samples_below_threshold(min_p):
    logits = logits_batch(8, seed=4)
    probs = torch.softmax(logits, -1)
    sampler = Sampler(seed=5)
    for _ in range(30):
        out = sampler(logits, reqs(8, temperature=1.0, min_p=min_p))
        for i, t in enumerate(out.token_ids):
            assert probs[i, t] >= min_p * probs[i].max()


def test_filters_together_never_leave_their_sets():
    logits = logits_batch(64, seed=12, vocab=600)
    probs = torch.softmax(logits, -1)
    requests = reqs(64, temperature=1.0, top_k=20, top_p=0.6, min_p=0.02)
    for _ in range(5):
        out = Sampler(seed=_)(logits, requests)
        for i, t in enumerate(out.token_ids):
            p = probs[i]
            assert p[t] >= 0.02 * p.max()
            assert t in p.topk(20).indices.tolist()
            kept = torch.where((p >= 0.02 * p.max()) & (p >= p.topk(20).values[-1]), p, 0.0)
            assert kept[kept > kept[t]].sum() < 0.6 * kept.sum()


def test_seed_reproduces_whatever_the_batch():
    logits = logits_batch(4, seed=6)
    alone = Sampler(seed=0)(logits[:1], reqs(1, temperature=1.0, seed=42)).token_ids[0]
    in_batch = Sampler(seed=99)(logits, reqs(1, temperature=1.0, seed=42) + reqs(3, temperature=1.0)).token_ids[0]
    assert in_batch == alone
    # And a sequence of draws repeats for the same seed.
    a, b = reqs(1, temperature=1.0, seed=7), reqs(1, temperature=1.0, seed=7)
    sa, sb = Sampler(seed=1), Sampler(seed=2)
    assert [sa(logits[:1], a).token_ids[0] for _ in range(20)] == [sb(logits[:1], b).token_ids[0] for _ in range(20)]


@pytest.mark.parametrize("position", [0, 3, 7])
@pytest.mark.parametrize("params", [
    # Top-p 0.3 over a flat row needs several rejection rounds: they too come from the request's own noise.
    dict(temperature=1.0, top_p=0.3, top_k=30, repetition_penalty=1.2),
    # Temperature alone: the C++ op's path, in a batch whose other rows take the filters' path or argmax.
    dict(temperature=0.8),
], ids=["filtered", "temperature"])
def test_seeded_sequence_is_independent_of_company_and_position(position, params):
    target_logits = logits_batch(1, seed=13)[0] / 3
    company_logits = logits_batch(7, seed=14)
    company_params = [dict(temperature=0.0), dict(temperature=0.7), dict(temperature=1.0, seed=42, top_p=0.5),
                      dict(temperature=1.2, top_k=5, logprobs=2), dict(temperature=1.0, seed=43),
                      dict(temperature=1.0, min_p=0.1), dict(temperature=0.5, top_p=0.9)]

    def tokens(with_company: bool, sampler_seed: int) -> list[int]:
        target = reqs(1, seed=42, **params)[0]
        company = [reqs(1, **p)[0] for p in company_params] if with_company else []
        sampler, out = Sampler(seed=sampler_seed), []
        for _ in range(25):
            batch = company[:position] + [target] + company[position:]
            rows = [target_logits if r is target else company_logits[company.index(r)] for r in batch]
            token = sampler(torch.stack(rows), batch).token_ids[batch.index(target)]
            target.append_output_token(token)
            out.append(token)
        return out

    alone = tokens(False, 0)
    assert tokens(True, 1) == alone
    assert len(set(alone)) > 1


def test_a_seeded_token_depends_on_its_seed_and_position_only():
    # The contract an engine relies on when it continues a request whose first tokens a peer sampled: the
    # token at a position is the same whether the tokens before it were sampled here, elsewhere, or were
    # others; and sampling a position again (a failed batch sampled row by row) draws it again.
    logits = logits_batch(1, seed=15, vocab=600) / 4
    for params in [dict(temperature=1.0), dict(temperature=1.0, top_p=0.2), dict(temperature=0.8, top_k=3)]:
        here = reqs(1, seed=5, **params)[0]
        for _ in range(3):
            here.append_output_token(Sampler()(logits, [here]).token_ids[0])
        continued = reqs(1, seed=5, **params)[0]
        for token in here.output_token_ids:
            continued.append_output_token(token)  # sampled by a peer
        other_history = reqs(1, seed=5, **params)[0]
        for token in (7, 8, 9):
            other_history.append_output_token(token)
        nexts = {Sampler(seed=s)(logits, [r]).token_ids[0] for s, r in enumerate([here, continued, other_history])}
        assert len(nexts) == 1, params
        assert Sampler()(logits, [here]).token_ids == [nexts.pop()]  # again: the same draw
    # Seeds give different streams, and so do positions.
    flat = torch.zeros(1, 600)
    assert len({Sampler()(flat, reqs(1, seed=s, temperature=1.0)).token_ids[0] for s in range(12)}) > 3
    r = reqs(1, seed=5, temperature=1.0)[0]
    for _ in range(12):
        r.append_output_token(Sampler()(flat, [r]).token_ids[0])
    assert len(set(r.output_token_ids)) > 3


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


def test_min_tokens_per_row_and_out_of_range_stop_ids():
    logits = torch.full((3, VOCAB), -5.0)
    logits[:, 7] = 10.0
    logits[:, 8] = 9.0
    r = reqs(3, temperature=0.0, min_tokens=2, stop_token_ids=[7, 8, VOCAB, VOCAB + 5, 2**40])
    r[1].output_token_ids = [1, 1]  # this one may stop
    r[2].output_token_ids = [1]
    assert Sampler()(logits, r).token_ids == [logits[0, :7].argmax().item(), 7, logits[0, :7].argmax().item()]
    random_rows = reqs(3, temperature=1.0, min_tokens=2, stop_token_ids=[7, 8, VOCAB + 1])
    assert all(t not in (7, 8) for t in Sampler()(logits, random_rows).token_ids)


@pytest.mark.parametrize("k", [VOCAB, VOCAB + 1, 2**31, 2**63 - 1])
def test_top_k_at_or_above_the_vocabulary_keeps_everything(k):
    logits = logits_batch(4, seed=16)
    for seed in range(5):
        huge = Sampler()(logits, reqs(4, temperature=1.0, top_k=k, seed=seed)).token_ids
        off = Sampler()(logits, reqs(4, temperature=1.0, top_k=0, seed=seed)).token_ids
        assert huge == off


def test_out_of_range_history_does_not_fail_penalties():
    r = reqs(2, temperature=1.0, repetition_penalty=1.5, frequency_penalty=0.5)
    r[0].all_token_ids += [VOCAB, VOCAB + 100]
    r[0].output_token_ids = [VOCAB + 3, 4]
    assert len(Sampler()(logits_batch(2), r).token_ids) == 2


def test_broken_rows_do_not_fail_the_batch():
    logits = logits_batch(3, seed=17)
    logits[1] = float("nan")
    out = Sampler()(logits, reqs(3, temperature=1.0, top_p=0.9, top_k=5))
    assert all(0 <= t < VOCAB for t in out.token_ids)


def test_the_callers_logits_are_left_alone():
    logits = logits_batch(4, seed=18)
    before = logits.clone()
    r = reqs(4, temperature=0.7, top_k=3, top_p=0.5, min_p=0.1, repetition_penalty=1.3, min_tokens=3,
             stop_token_ids=[2])
    Sampler()(logits, r)
    Sampler()(logits, reqs(4, temperature=0.0, presence_penalty=1.0))
    assert torch.equal(logits, before)


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


def test_logprobs_of_random_rows_are_of_the_raw_distribution():
    logits = logits_batch(6, seed=19)
    r = reqs(6, temperature=0.5, top_k=4, logprobs=2, repetition_penalty=1.5)
    out = Sampler()(logits, r)
    raw = torch.log_softmax(logits, -1)
    for i, (t, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        assert lp.logprob == pytest.approx(float(raw[i, t]))
        assert lp.rank == int((raw[i] > raw[i, t]).sum()) + 1
        assert [tok for tok, _ in lp.top] == raw[i].topk(2).indices.tolist()


@pytest.mark.parametrize("top_p", [5e-324, 1e-300, 1e-12])
def test_a_vanishing_top_p_keeps_the_most_likely_token_and_ends(top_p):
    """top_p * total can underflow to 0: the loop must still end, on the most likely token."""
    logits = torch.tensor([[0.25, 0.3, 0.25, 0.2]] * 3).log()
    # min_p leaves 0.3 of the mass: top_p * 0.3 rounds to 0 for the smallest top_p.
    requests = [Request(f"r{s}", [1, 2, 3], SamplingParams(temperature=1.0, top_p=top_p, min_p=0.9, seed=s),
                        max_model_len=1000) for s in (None, 1, 2)]
    for _ in range(20):
        assert Sampler(0)(logits, requests).token_ids == [1, 1, 1]
