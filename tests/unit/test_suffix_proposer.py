"""Suffix decoding's trees and proposals (suffix_proposer.py)."""
from __future__ import annotations

import random

import numpy as np
import pytest

from epdserve.shared.config import SpeculativeConfig
from epdserve.shared.engine.request import Request, RequestStatus
from epdserve.shared.engine.sampling_params import SamplingParams
from epdserve.shared.engine.suffix_proposer import SuffixProposer, SuffixTree, own_draft


def counts(tree: SuffixTree, tokens: list[int]) -> int:
    node = tree.node(tokens)
    return 0 if node is None else node[0]


def test_the_tree_counts_every_run_up_to_its_depth_and_takes_a_sequence_back():
    tree = SuffixTree(depth=3)
    tree.add([1, 2, 1, 2, 3])
    assert counts(tree, [1]) == 2 and counts(tree, [1, 2]) == 2 and counts(tree, [2, 1, 2]) == 1
    assert counts(tree, [1, 2, 3]) == 1 and counts(tree, [1, 2, 1, 2]) == 0  # deeper than 3: not kept
    tree.add([1, 2, 3])
    assert counts(tree, [1, 2, 3]) == 2
    tree.remove([1, 2, 1, 2, 3])
    assert counts(tree, [1, 2, 3]) == 1 and counts(tree, [2, 1]) == 0
    tree.remove([1, 2, 3])
    assert tree.root[1] == {}


def test_a_requests_own_tokens_draft_as_a_tree_of_them_would():
    rng = random.Random(3)
    for _ in range(200):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(2, 40))]
        tree = SuffixTree(depth=6)
        tree.add(tokens)
        context = tokens[-6:]
        for room, factor, min_prob in ((4, 1.0, 0.1), (6, 3.0, 0.0), (2, 1.0, 0.5)):
            want, want_score = tree.speculate(context, room, factor, min_prob)
            got, score = own_draft(np.array(tokens), 6, room, factor, min_prob)
            assert got == want and score == pytest.approx(want_score)


def test_the_draft_follows_the_longest_match_and_grows_with_it():
    tree = SuffixTree(depth=16)
    tree.add([10, 11, 12, 13, 14, 15, 16, 17, 99, 10, 11, 12])
    # "10 11 12" matched (3 tokens) -> up to 3 tokens of what followed it: 13 14 15.
    draft, score = tree.speculate([10, 11, 12], max_tokens=8, spec_factor=1.0, min_prob=0.1)
    assert draft == [13, 14, 15] and score == pytest.approx(3.0)
    draft, _ = tree.speculate([10, 11, 12], max_tokens=8, spec_factor=2.0, min_prob=0.1)
    assert draft == [13, 14, 15, 16, 17, 99]
    assert tree.speculate([42], max_tokens=8, spec_factor=1.0, min_prob=0.1) == ([], 0.0)


def test_the_draft_takes_the_likeliest_token_and_stops_where_the_tree_is_unsure():
    tree = SuffixTree(depth=8)
    tree.add([1, 2, 3, 7, 1, 2, 3, 7, 1, 2, 3, 8, 1, 2, 4])
    draft, score = tree.speculate([1, 2], max_tokens=4, spec_factor=4.0, min_prob=0.1)
    # After "1 2": 3 three times of four, then 7 two times of three: 0.75, 0.5, ...
    assert draft[:2] == [3, 7] and score > 1.25
    assert tree.speculate([1, 2], max_tokens=4, spec_factor=4.0, min_prob=0.8) == ([], 0.0)


def request(name: str, prompt: list[int], max_tokens: int = 50, stop: list[int] | None = None) -> Request:
    return Request(name, prompt, SamplingParams(max_tokens=max_tokens, stop_token_ids=stop), max_model_len=4096)


def proposer(**keys) -> SuffixProposer:
    return SuffixProposer(SpeculativeConfig.parse({"method": "suffix", "num_speculative_tokens": 6, **keys}))


def test_a_request_is_drafted_from_its_own_tokens_as_they_grow():
    p = proposer()
    r = request("a", [1, 2, 3, 4, 5, 6, 7, 1, 2, 3])
    assert p.propose(r) == [4, 5, 6]
    r.append_output_token(4)
    assert p.propose(r) == [5, 6, 7, 1]


def test_a_draft_never_holds_a_stop_token_nor_reaches_max_tokens():
    p = proposer()
    assert p.propose(request("a", [1, 2, 3, 4, 5, 1, 2, 3], stop=[5])) == [4]
    assert p.propose(request("b", [1, 2, 3, 4, 5, 1, 2, 3], max_tokens=2)) == [4]


def test_finished_outputs_draft_for_later_requests_and_the_oldest_leave_the_cache():
    p = proposer(suffix_decoding_max_cached_requests=1)
    first = request("first", [9, 9])
    p.propose(first)
    for token in [20, 21, 22, 23, 24, 25]:
        first.append_output_token(token)
    first.status = RequestStatus.FINISHED_STOPPED
    p.start_step()
    assert "first" not in p.requests
    assert p.propose(request("second", [7, 20, 21, 22])) == [23, 24, 25]
    aborted = request("aborted", [30, 31])
    p.propose(aborted)
    aborted.append_output_token(32)
    aborted.status = RequestStatus.FINISHED_ABORTED  # an aborted request's output is not kept
    p.start_step()
    assert p.propose(request("third", [7, 20, 21, 22])) == [23, 24, 25]
    done = request("done", [40])
    p.propose(done)
    for token in [41, 42, 43]:
        done.append_output_token(token)
    done.status = RequestStatus.FINISHED_LENGTH
    p.start_step()  # the cache holds one output: the first one's leaves it
    assert p.propose(request("fourth", [7, 20, 21, 22])) == []
    assert p.propose(request("fifth", [41, 42])) == [43]


@pytest.mark.parametrize("spec, message", [
    ({"method": "suffix", "suffix_decoding_max_tree_depth": 1}, "suffix_decoding_max_tree_depth"),
    ({"method": "suffix", "suffix_decoding_max_cached_requests": -1}, "suffix_decoding_max_cached_requests"),
    ({"method": "suffix", "suffix_decoding_max_spec_factor": 0}, "suffix_decoding_max_spec_factor"),
    ({"method": "suffix", "suffix_decoding_min_token_prob": 1.5}, "suffix_decoding_min_token_prob"),
    ({"method": "suffix", "prompt_lookup_max": 2}, "unsupported keys"),
    ({"method": "ngram", "num_speculative_tokens": 2, "suffix_decoding_max_tree_depth": 8}, "unsupported keys"),
])
def test_bad_suffix_configs_are_refused(spec, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(spec)


def test_suffix_drafts_are_as_long_as_the_tree_is_deep_unless_told():
    assert SpeculativeConfig.parse({"method": "suffix"}).num_speculative_tokens == 24
    config = SpeculativeConfig.parse({"method": "suffix", "suffix_decoding_max_tree_depth": 8})
    assert (config.num_speculative_tokens, config.suffix_decoding_max_tree_depth) == (8, 8)
    assert SpeculativeConfig.parse({"method": "suffix", "num_speculative_tokens": 3}).num_speculative_tokens == 3
