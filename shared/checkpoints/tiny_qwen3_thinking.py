"""A tiny random Qwen3 checkpoint that writes its reasoning as Qwen3 does, for the reasoning parser's tests.

tiny_models.py's qwen3 (the same config and seed) with the default model's tokenizer plus Qwen3's `<think>`
and `</think>` (added tokens, not special ones: decoded text keeps them, as with Qwen3's own tokenizer) and a
chat template in Qwen3's format: `<|im_start|>role ... <|im_end|>` turns, an assistant turn after the last
user message written with its `reasoning_content` as a `<think>` block, and `enable_thinking: false` closing
an empty block after the generation prompt. Its weights are random: tests force what it writes with a
structured output.
"""
from __future__ import annotations

from pathlib import Path

from epdserve.shared.checkpoints.model_folder import write_whole
from epdserve.shared.checkpoints.tiny_models import TOKENIZER_FILES, build_tiny_model

THINK_TOKENS = ("<think>", "</think>")

CHAT_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for message in messages %}{%- if message['role'] == 'user' %}{%- set ns.last_user = loop.index0 %}"
    "{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\n' }}"
    "{%- if message['role'] == 'assistant' and message.get('reasoning_content') and loop.index0 > ns.last_user %}"
    "{{- '<think>\n' + message['reasoning_content'].strip('\n') + '\n</think>\n\n' }}"
    "{%- endif %}"
    "{{- (message['content'] or '') + '<|im_end|>\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}"
    "{%- endif %}"
)


def build_tiny_qwen3_thinking(out: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """Write the checkpoint to `out`; the same seed gives the same checkpoint. `out` is replaced as a whole,
    never left half-written."""
    from transformers import AutoTokenizer

    out, tokenizer_dir = Path(out), Path(tokenizer_dir)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    vocab = len(tokenizer)
    tokenizer.add_tokens(list(THINK_TOKENS), special_tokens=False)
    if sorted(tokenizer.convert_tokens_to_ids(list(THINK_TOKENS))) != [vocab, vocab + 1]:
        raise ValueError("<think> and </think> did not become new tokens at the end of the vocabulary")
    tokenizer.chat_template = CHAT_TEMPLATE

    def build(tmp: Path) -> None:
        build_tiny_model("qwen3", tmp, tokenizer_dir, seed, vocab_size=len(tokenizer))
        for name in TOKENIZER_FILES:  # the default model's, copied with the weights: replaced as a whole
            (tmp / name).unlink(missing_ok=True)
        tokenizer.save_pretrained(tmp)

    return write_whole(out, build)
