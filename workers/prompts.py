"""Turning chat messages into prompt token ids: through the pair's chat template (transformers 5 returns
a BatchEncoding from ``apply_chat_template(tokenize=True)``; render text, then encode), or, for a base
model without one, as a plain prompt."""

from __future__ import annotations

from typing import Any


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def plain_prompt(messages: list[dict[str, str]]) -> str:
    """A base model's prompt (lm-evaluation-harness's layout): the system text, then each earlier turn as
    ``question answer`` followed by a blank line, then the last user turn, which the answer continues."""
    parts, system = [], [m["content"] for m in messages if m["role"] == "system"]
    turns = [m for m in messages if m["role"] != "system"]
    if system:
        parts.append("\n".join(system) + "\n\n")
    for m in turns[:-1]:
        parts.append(m["content"] + (" " if m["role"] == "user" else "\n\n"))
    if turns:
        parts.append(turns[-1]["content"])
    return "".join(parts)


def encode_chat(tokenizer: Any, messages: list[dict[str, str]], chat: bool | None = None) -> list[int]:
    """``chat`` True: the chat template (ValueError naming the fix when the tokenizer has none); False: the
    plain prompt; None (auto): the template when the tokenizer has one, else the plain prompt."""
    use = has_chat_template(tokenizer) if chat is None else chat
    if use:
        if not has_chat_template(tokenizer):
            raise ValueError("the tokenizer has no chat template (a base model): use the plain prompt "
                             "(a task file's chat: false or auto)")
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(tokenizer.encode(plain_prompt(messages), add_special_tokens=True))
