"""Prompt lookup: the longest suffix match, its latest occurrence with room for k tokens, and drafts that never
hold a stop token nor reach max_tokens."""
import numpy as np
import pytest

from epdserve.shared.config import SpeculativeConfig
from epdserve.shared.engine.ngram_proposer import NgramProposer
from epdserve.shared.engine.request import Request
from epdserve.shared.engine.sampling_params import SamplingParams


def proposal(prompt, output=(), k=3, low=1, high=3, **params):
    request = Request("r", list(prompt), SamplingParams(**{"max_tokens": 100, **params}), max_model_len=4096)
    for token_id in output:
        request.append_output_token(token_id)
    return NgramProposer(SpeculativeConfig("ngram", k, low, high)).propose(request)


def test_the_longest_suffix_match_wins():
    # Suffix (8, 9) occurs once, followed by 30; suffix (9,) also after 50 (later) but is shorter.
    assert proposal([1, 8, 9, 30, 31, 32, 9, 50, 51, 52, 8, 9]) == [30, 31, 32]


def test_the_latest_occurrence_with_k_tokens_after_it_is_taken():
    assert proposal([5, 1, 2, 5, 3, 4, 0, 5], k=2, low=1, high=1) == [3, 4]
    # A loop that has just begun: the latest occurrence of (7,) is followed by one token only.
    assert proposal([7, 7, 7], k=3, low=1, high=1) == [7, 7]


def test_no_match_below_min_gives_nothing():
    assert proposal([1, 2, 3, 4], low=2, high=3) == []
    assert proposal([4]) == []


def reference_proposal(tokens: list[int], k: int, low: int, high: int) -> list[int]:
    """The rule as written: for n from high down to low, every earlier window equal to the last n tokens."""
    for n in range(min(high, len(tokens) - 1), low - 1, -1):
        starts = [i for i in range(len(tokens) - n) if tokens[i:i + n] == tokens[-n:]]
        if starts:
            full = [i for i in starts if i + n + k <= len(tokens)]
            start = (full[-1] if full else starts[0]) + n
            return tokens[start:start + k]
    return []


def test_proposals_follow_the_rule_on_random_token_runs():
    rng = np.random.default_rng(0)
    for trial in range(400):
        tokens = rng.integers(0, 1 + trial % 6, size=int(rng.integers(1, 60))).tolist()
        k, low = int(rng.integers(1, 6)), int(rng.integers(1, 4))
        high = low + int(rng.integers(0, 4))
        assert proposal(tokens, k=k, low=low, high=high) == reference_proposal(tokens, k, low, high), (tokens, k, low, high)


def test_output_tokens_count_and_drafts_stop_before_stop_tokens_and_max_tokens():
    assert proposal([1, 2, 3, 4, 5], output=[1, 2], k=3) == [3, 4, 5]
    assert proposal([1, 2, 3, 4, 5], output=[1, 2], k=3, stop_token_ids=[4]) == [3]
    assert proposal([1, 2, 3, 4, 5], output=[1, 2], k=3, max_tokens=4) == [3]
    assert proposal([1, 2, 3, 4, 5], output=[1, 2], k=3, max_tokens=3) == []


@pytest.mark.parametrize("spec, expected", [
    ({"method": "ngram", "num_speculative_tokens": 2}, (5, 5)),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, (3, 3)),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2}, (2, 2)),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 4}', (1, 4)),
])
def test_vllm_spelling_and_defaults(spec, expected):
    config = SpeculativeConfig.parse(spec)
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == expected and config.num_speculative_tokens == 2


@pytest.mark.parametrize("spec, field", [
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "draft_model", "num_speculative_tokens": False, "model": "/m"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2.0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": True}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": True},
     "prompt_lookup_max"),
    ({"method": ["ngram"], "num_speculative_tokens": 2}, "speculative method"),
])
def test_a_bool_or_other_non_integer_is_refused_naming_the_field(spec, field):
    """JSON's true would pass as 1 where Python checks for an int: refused, with the field's name."""
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.parse(spec)
