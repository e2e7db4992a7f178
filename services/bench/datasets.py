"""Request sets, all seeded: the same arguments give the same prompts on every run.

- random: prompts of a given token length (+- a range ratio), optionally behind one shared prefix.
- lognormal: random prompts whose prompt and output lengths follow log-normal distributions (long
  tails, as real chat traffic has), around the given medians.
- sharegpt: real conversations from a ShareGPT JSON file (`--dataset-path`), sampled as
  `vllm bench serve` does: conversations with at least two turns, shuffled with the seed; the first
  turn is the prompt and the second's token count the output length (or `sharegpt_output_len`); pairs
  with fewer than 4 tokens on a side, a prompt over 1024 tokens or over 2048 together are skipped;
  drawn again at random when the file has too few (unless `oversample` is off: fewer requests then).
- multi-turn: conversations whose every turn resends the whole history (a long opening document,
  then short user turns with the server's real replies in between): growing shared prefixes.
- image: a text prompt with generated PNG images as `data:` URLs (chat endpoint).

Prompt text comes from a tokenizer when one is given (random token ids, decoded and re-encoded until
the length is exact, as vLLM does) and otherwise from plain random words (about one token each; the
server's usage then reports the true prompt length).
"""
from __future__ import annotations

import base64
import functools
import io
import json
import random
from dataclasses import dataclass, replace

import numpy as np

DATASETS = ("random", "lognormal", "sharegpt", "multi-turn", "image")
CHAT_ONLY = ("multi-turn", "image")

_WORDS = (
    "time year people way day man thing woman life child world school state family student group country "
    "problem hand part place case week company system program question work government number night point "
    "home water room mother area money story fact month lot right study book eye job word business issue "
    "side kind head house service friend father power hour game line end member law car city community name "
    "president team minute idea kid body information back parent face others level office door health person "
    "art war history party result change morning reason research girl guy moment air teacher force education "
    "river garden stone light music paper window summer winter market table bridge letter forest engine "
    "signal station island valley harbor castle planet silver orange yellow purple quiet rapid gentle "
    "ancient modern simple careful bright narrow distant hidden golden frozen wooden"
).split()


@dataclass(slots=True)
class SampleRequest:
    """One request to send. `messages` makes it a chat request; otherwise `prompt` is the completion prompt.

    Multi-turn samples carry only their turn's new messages: the runner prepends the conversation so far
    (earlier turns and the server's replies), so `prompt_len` is the dataset's estimate of the full prompt.
    """

    prompt: str | None
    prompt_len: int
    expected_output_len: int
    messages: list[dict] | None = None
    conversation_id: int | None = None
    turn: int | None = None
    num_images: int = 0


class TextSource:
    """Text of a given token length, from a tokenizer (exact) or from random words (approximate)."""

    def __init__(self, tokenizer=None) -> None:
        self.tokenizer = tokenizer
        if tokenizer is not None:
            special = set(tokenizer.all_special_ids)
            self.vocab = np.array([i for i in range(len(tokenizer)) if i not in special])

    def count(self, text: str) -> int:
        if self.tokenizer is None:
            return len(text.split())
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def text(self, num_tokens: int, rng: np.random.Generator) -> tuple[str, int]:
        """(text, its token count); the count equals `num_tokens` with a tokenizer, up to a rare near miss."""
        if num_tokens <= 0:
            return "", 0
        if self.tokenizer is None:
            return " ".join(rng.choice(_WORDS, num_tokens)), num_tokens
        ids = self.vocab[rng.integers(0, len(self.vocab), num_tokens)].tolist()
        for _ in range(10):  # decode/encode does not round-trip random ids: trim or top up, then retry
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            again = self.tokenizer.encode(text, add_special_tokens=False)
            if len(again) == num_tokens:
                return text, num_tokens
            if len(again) > num_tokens:
                ids = again[:num_tokens]
            else:
                ids = again + self.vocab[rng.integers(0, len(self.vocab), num_tokens - len(again))].tolist()
        return text, len(again)


@dataclass(frozen=True, slots=True)
class DatasetConfig:
    name: str = "random"
    num_prompts: int = 100
    seed: int = 0
    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0  # random: lengths uniform in [len * (1 - r), len * (1 + r)]
    prefix_len: int = 0  # random: tokens of one prefix shared by every prompt
    lognormal_sigma: float = 0.8  # lognormal: spread; input_len/output_len are the medians
    lognormal_max_len: int = 2048
    dataset_path: str | None = None  # sharegpt: the JSON file
    sharegpt_output_len: int | None = None  # sharegpt: every request's output length (None: the reply's)
    shuffle: bool = True  # sharegpt: conversations in seeded random order (False: file order)
    oversample: bool = True  # sharegpt: too few usable conversations are drawn again up to num_prompts
    turns: int = 4  # multi-turn: requests per conversation; input_len is each user turn's length
    conversation_prefix_len: int = 1024  # multi-turn: the opening document of each conversation
    image_width: int = 224
    image_height: int = 224
    images_per_request: int = 1


def check(config: DatasetConfig) -> None:
    """ValueError for a config no tokenizer or file can make right, before anything is loaded or asked."""
    if config.name not in DATASETS:
        raise ValueError(f"unknown dataset {config.name!r}; choose one of {DATASETS}")
    if not 0 <= config.range_ratio < 1:
        raise ValueError(f"--random-range-ratio {config.range_ratio} must be in [0, 1) (as vLLM's): lengths are "
                         "drawn from len * (1 - r) to len * (1 + r)")
    if config.name == "sharegpt" and not config.dataset_path:
        raise ValueError("the sharegpt dataset reads a ShareGPT JSON file: give --dataset-path (for example "
                         "ShareGPT_V3_unfiltered_cleaned_split.json); --dataset-name lognormal is a synthetic "
                         "length mix")


def sample_requests(config: DatasetConfig, text: TextSource) -> list[SampleRequest]:
    """The dataset's requests in the order they are sent."""
    check(config)
    rng = np.random.default_rng(config.seed)
    sample = {"random": _random, "lognormal": _lognormal, "sharegpt": _sharegpt, "multi-turn": _multi_turn,
              "image": _image}[config.name]
    return sample(config, text, rng)


def warmup_requests(config: DatasetConfig, text: TextSource, count: int) -> list[SampleRequest]:
    """Requests shaped like the dataset's first one but with unrelated text (no prefix-cache hits later)."""
    rng = np.random.default_rng(config.seed + 1_000_003)
    out = []
    for _ in range(count):
        prompt, n = text.text(min(config.input_len, 256), rng)
        chat = config.name in CHAT_ONLY
        out.append(SampleRequest(None if chat else prompt, n, min(config.output_len, 16),
                                 [{"role": "user", "content": prompt}] if chat else None))
    return out


def _lengths(rng: np.random.Generator, n: int, length: int, ratio: float) -> np.ndarray:
    low, high = max(int(length * (1 - ratio)), 1), max(int(length * (1 + ratio)), 1)
    return rng.integers(low, high + 1, n)


def _random(config: DatasetConfig, text: TextSource, rng: np.random.Generator) -> list[SampleRequest]:
    prefix, prefix_len = text.text(config.prefix_len, rng)
    inputs = _lengths(rng, config.num_prompts, config.input_len, config.range_ratio)
    outputs = _lengths(rng, config.num_prompts, config.output_len, config.range_ratio)
    samples = []
    for n_in, n_out in zip(inputs.tolist(), outputs.tolist()):
        body, n = text.text(n_in, rng)
        prompt = f"{prefix} {body}" if prefix else body
        samples.append(SampleRequest(prompt, prefix_len + n, n_out))
    return samples


def _lognormal(config: DatasetConfig, text: TextSource, rng: np.random.Generator) -> list[SampleRequest]:
    def lognormal(median: int) -> np.ndarray:
        values = rng.lognormal(np.log(max(median, 1)), config.lognormal_sigma, config.num_prompts)
        return np.clip(np.rint(values), 4, config.lognormal_max_len).astype(int)

    inputs, outputs = lognormal(config.input_len), lognormal(config.output_len)
    samples = []
    for n_in, n_out in zip(inputs.tolist(), outputs.tolist()):
        prompt, n = text.text(n_in, rng)
        samples.append(SampleRequest(prompt, n, n_out))
    return samples


@functools.lru_cache(maxsize=1)
def load_sharegpt(path: str) -> tuple[dict, ...]:
    """The file's conversations with at least two turns, in file order (read once per path)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as exc:
        raise ValueError(f"--dataset-path {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"--dataset-path {path} is not JSON: {exc}") from None
    if not isinstance(data, list):
        raise ValueError(f"--dataset-path {path}: expected a JSON list of {{\"conversations\": [...]}} entries")
    return tuple(e for e in data if isinstance(e, dict) and len(e.get("conversations") or ()) >= 2)


def _is_valid_pair(prompt_len: int, output_len: int, check_output: bool) -> bool:
    """vLLM's `is_valid_sequence` with its defaults."""
    too_short = prompt_len < 4 or (check_output and output_len < 4)
    return not too_short and prompt_len <= 1024 and prompt_len + output_len <= 2048


def _sharegpt(config: DatasetConfig, text: TextSource, rng: np.random.Generator) -> list[SampleRequest]:
    if text.tokenizer is None:
        raise ValueError("the sharegpt dataset counts tokens: give --tokenizer (or --model as a local folder)")
    entries = list(load_sharegpt(config.dataset_path))
    if config.shuffle:
        random.Random(config.seed).shuffle(entries)  # as vLLM's random.seed(seed) then random.shuffle
    tokenize = lambda s: len(text.tokenizer(s).input_ids)  # noqa: E731 - with special tokens, as vLLM counts
    samples = []
    for entry in entries:
        if len(samples) >= config.num_prompts:
            break
        prompt, completion = (str(turn.get("value", "")) for turn in entry["conversations"][:2])
        prompt_len = tokenize(prompt)
        output_len = tokenize(completion) if config.sharegpt_output_len is None else config.sharegpt_output_len
        if _is_valid_pair(prompt_len, output_len, config.sharegpt_output_len is None):
            samples.append(SampleRequest(prompt, prompt_len, output_len))
    if not samples:
        raise ValueError(f"--dataset-path {config.dataset_path}: no conversation has a usable first exchange")
    if config.oversample:
        drawer = random.Random(config.seed)  # too few: draw again, as vLLM oversamples
        samples += [replace(drawer.choice(samples)) for _ in range(config.num_prompts - len(samples))]
    return samples


def _multi_turn(config: DatasetConfig, text: TextSource, rng: np.random.Generator) -> list[SampleRequest]:
    turns = max(config.turns, 1)
    num_conversations = max(-(-config.num_prompts // turns), 1)
    per_conversation: list[list[SampleRequest]] = []
    for c in range(num_conversations):
        document, doc_len = text.text(config.conversation_prefix_len, rng)
        history = doc_len
        samples = []
        for t in range(min(turns, config.num_prompts - c * turns)):
            question, n = text.text(config.input_len, rng)
            messages = [{"role": "user", "content": question}]
            if t == 0 and document:
                messages.insert(0, {"role": "system", "content": document})
            history += n
            samples.append(SampleRequest(None, history, config.output_len, messages, c, t))
            history += config.output_len
        per_conversation.append(samples)
    # Round-robin by turn: every conversation's first turn, then every second turn, ...
    return [conv[t] for t in range(turns) for conv in per_conversation if t < len(conv)]


def _image(config: DatasetConfig, text: TextSource, rng: np.random.Generator) -> list[SampleRequest]:
    samples = []
    for _ in range(config.num_prompts):
        prompt, n = text.text(config.input_len, rng)
        parts: list[dict] = [{"type": "image_url", "image_url": {"url": png_data_url(rng, config.image_width,
                                                                                     config.image_height)}}
                             for _ in range(config.images_per_request)]
        parts.append({"type": "text", "text": prompt})
        samples.append(SampleRequest(None, n, config.output_len, [{"role": "user", "content": parts}],
                                     num_images=config.images_per_request))
    return samples


def png_data_url(rng: np.random.Generator, width: int, height: int) -> str:
    """A smooth random picture (PNG-compressible, unlike noise) as a base64 `data:` URL."""
    from PIL import Image

    y, x = np.mgrid[0:height, 0:width] / max(width, height)
    freq = rng.uniform(2, 9, size=(3, 2))
    phase = rng.uniform(0, 2 * np.pi, size=3)
    rgb = np.stack([np.sin(x * fx + p) * np.cos(y * fy) for (fx, fy), p in zip(freq, phase)], axis=-1)
    buf = io.BytesIO()
    Image.fromarray(((rgb + 1) * 127.5).astype(np.uint8)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
