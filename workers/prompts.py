"""Turning chat messages into prompt token ids with a pair's chat template (transformers 5 returns
a BatchEncoding from ``apply_chat_template(tokenize=True)``; render text, then encode)."""

from __future__ import annotations

from typing import Any


def encode_chat(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))
