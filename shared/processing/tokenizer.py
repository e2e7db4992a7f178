"""The tokenizer side of a model folder: encode, chat template, the fast tokenizer for streaming decode."""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as FastTokenizer

from epdserve.shared.processing.tool_prompt import (messages_for_tool_template, messages_with_inline_tools,
                                                    template_reads_tools)


class Tokenizer:
    """Wraps the HF tokenizer of a model folder; loaded once per process."""

    def __init__(self, hf_tokenizer) -> None:
        self.hf = hf_tokenizer
        self.fast: FastTokenizer = hf_tokenizer._tokenizer
        self.eos_token_id: int | None = hf_tokenizer.eos_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, **kwargs) -> str:
        """The prompt text. Tools and tool-call history are rendered by the template when it reads
        `tools`, else written into the turns (see `tool_prompt`)."""
        template = getattr(self.hf, "chat_template", None)
        if not template:
            raise ValueError("this model's tokenizer has no chat template")
        if template_reads_tools(template):
            messages = messages_for_tool_template(messages)
            if tools:
                kwargs["tools"] = tools
        else:
            messages = messages_with_inline_tools(messages, tools)
        return self.hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                           tokenize=False, **kwargs)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> list[int]:
        # The template writes the special tokens itself; encoding must not add a second BOS.
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **kwargs),
                           add_special_tokens=False)


def load_tokenizer(model_path: str | Path) -> Tokenizer | None:
    """The folder's tokenizer, or None when it has none (then prompts must be token ids).

    Its class is the one its tokenizer_config.json names, as AutoTokenizer would pick it, but found by name:
    AutoTokenizer imports transformers' config machinery, and with it torch, which the proxy does without."""
    folder = Path(model_path)
    if not any((folder / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json")):
        return None
    import transformers

    config_file = folder / "tokenizer_config.json"
    name = json.loads(config_file.read_text()).get("tokenizer_class") if config_file.is_file() else None
    cls = getattr(transformers, name, None) if isinstance(name, str) else None
    return Tokenizer((cls or transformers.PreTrainedTokenizerFast).from_pretrained(str(folder)))
