"""`epdserve bench serve` datasets: ShareGPT read from its JSON file as `vllm bench serve` samples it, the
synthetic length mix under its own name, and help that states each default once."""
import json
import random
import re
from types import SimpleNamespace

import pytest

from epdserve.services.bench import datasets
from epdserve.services.cli.main import build_parser


class WordTokenizer:
    """One token per word, plus a BOS: as vLLM counts, with special tokens."""

    all_special_ids = [0]

    def __len__(self):
        return 100

    def __call__(self, text):
        return SimpleNamespace(input_ids=[0] + text.split())


def conversation(prompt_words: int, reply_words: int, tag: str, turns: int = 2) -> dict:
    values = [" ".join([tag] * prompt_words), " ".join(["ok"] * reply_words)] + ["more"] * (turns - 2)
    return {"id": tag, "conversations": [{"from": "human" if i % 2 == 0 else "gpt", "value": v}
                                          for i, v in enumerate(values[:turns])]}


@pytest.fixture
def sharegpt_file(tmp_path):
    entries = [conversation(5, 7, f"c{i}") for i in range(8)]
    entries += [
        conversation(5, 7, "one-turn", turns=1),  # dropped before shuffling: fewer than two turns
        conversation(2, 7, "short-prompt"),  # 3 tokens with BOS: under 4
        conversation(5, 2, "short-reply"),
        conversation(1100, 7, "long-prompt"),  # over 1024
        conversation(1000, 1100, "long-pair"),  # over 2048 together
        {"id": "no-conversations"},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(entries))
    return path, entries


def sample(path, **kwargs):
    config = datasets.DatasetConfig("sharegpt", dataset_path=str(path), **kwargs)
    return datasets.sample_requests(config, datasets.TextSource(WordTokenizer()))


def test_sharegpt_samples_the_first_exchange_in_vllms_order(sharegpt_file):
    path, entries = sharegpt_file
    datasets.load_sharegpt.cache_clear()
    samples = sample(path, num_prompts=6, seed=3)
    # vLLM: keep entries with two turns or more, random.seed(seed); random.shuffle; first valid ones.
    kept = [e for e in entries if len(e.get("conversations", [])) >= 2]
    random.Random(3).shuffle(kept)
    valid = [e["id"] for e in kept if e["id"].startswith("c")][:6]
    assert [s.prompt.split()[0] for s in samples] == valid
    assert {(s.prompt_len, s.expected_output_len) for s in samples} == {(6, 8)}  # words + BOS


def test_sharegpt_output_len_overrides_the_reply_and_too_few_are_drawn_again(sharegpt_file):
    path, _ = sharegpt_file
    samples = sample(path, num_prompts=12, sharegpt_output_len=3)
    assert len(samples) == 12 and {s.expected_output_len for s in samples} == {3}
    # With the output length given, a short reply no longer disqualifies its conversation.
    assert "short-reply" in {s.prompt.split()[0] for s in samples}
    assert len({id(s) for s in samples}) == 12  # drawn again as copies, not the same object twice


def test_sharegpt_in_file_order_and_without_drawing_again(sharegpt_file):
    path, _ = sharegpt_file
    datasets.load_sharegpt.cache_clear()
    samples = sample(path, num_prompts=12, shuffle=False, oversample=False)  # --disable-shuffle --no-oversample
    assert [s.prompt.split()[0] for s in samples] == [f"c{i}" for i in range(8)]  # the 8 usable ones, in order


def test_random_range_ratio_is_below_one_as_in_vllm():
    with pytest.raises(ValueError, match=re.escape("must be in [0, 1)")):
        datasets.sample_requests(datasets.DatasetConfig(range_ratio=1.0), datasets.TextSource())
    samples = datasets.sample_requests(datasets.DatasetConfig(num_prompts=50, input_len=20, output_len=10,
                                                              range_ratio=0.5), datasets.TextSource())
    assert {s.prompt_len for s in samples} <= set(range(10, 31)) and len({s.prompt_len for s in samples}) > 1


@pytest.mark.parametrize("kwargs, content, message", [
    ({"dataset_path": None}, None, "give --dataset-path"),
    ({}, "{not json", "is not JSON"),
    ({}, json.dumps({"a": 1}), "expected a JSON list"),
    ({}, json.dumps([conversation(1, 1, "x")]), "no conversation has a usable first exchange"),
])
def test_sharegpt_mistakes_are_one_line(tmp_path, kwargs, content, message):
    path = tmp_path / "data.json"
    if content is not None:
        path.write_text(content)
    datasets.load_sharegpt.cache_clear()
    config = datasets.DatasetConfig("sharegpt", **({"dataset_path": str(path)} | kwargs))
    with pytest.raises(ValueError, match=re.escape(message)):
        datasets.sample_requests(config, datasets.TextSource(WordTokenizer()))


def test_sharegpt_needs_a_tokenizer_and_an_existing_file(tmp_path):
    with pytest.raises(ValueError, match="give --tokenizer"):
        datasets.sample_requests(datasets.DatasetConfig("sharegpt", dataset_path="x.json"), datasets.TextSource())
    with pytest.raises(ValueError, match="No such file"):
        sample(tmp_path / "missing.json")


def test_the_synthetic_length_mix_is_called_lognormal():
    samples = datasets.sample_requests(datasets.DatasetConfig("lognormal", num_prompts=200, input_len=50,
                                                              output_len=20, lognormal_max_len=400),
                                       datasets.TextSource())
    inputs = sorted(s.prompt_len for s in samples)
    assert 35 < inputs[100] < 70 and inputs[-1] <= 400 and inputs[0] >= 4  # median near 50, long tail capped


def bench_serve_help() -> str:
    parser = build_parser()
    bench = parser._subparsers._group_actions[0].choices["bench"]
    return bench._subparsers._group_actions[0].choices["serve"].format_help()


def test_bench_help_states_each_default_once():
    text = bench_serve_help()
    options = re.split(r"\n  (?=-)", text.split("options:", 1)[1])
    for option in options:
        assert len(re.findall(r"default", option)) <= 1, option
    assert "(default: None)" not in text
    for option, default in [("--num-prompts", "(default: 1000)"), ("--seed", "(default: 0)"),
                            ("--request-rate", "(default: inf)"), ("--dataset-name", "(default: random)"),
                            ("--random-range-ratio", "(default: 0.0)")]:
        block = next(o for o in options if o.startswith(option))
        assert default in " ".join(block.split()), block
