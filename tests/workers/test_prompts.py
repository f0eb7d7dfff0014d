"""Prompts: the chat template where the tokenizer has one, the plain prompt of a base model otherwise
(once, a base model without a template had every item recorded as a failure)."""

from __future__ import annotations

import copy

import pytest

from workers.models.pair import load_pair
from workers.prompts import encode_chat, plain_prompt

MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q: 1 + 1?\nA:"},
        {"role": "assistant", "content": "2"}, {"role": "user", "content": "Q: 2 + 2?\nA:"}]


@pytest.fixture(scope="module")
def tokenizers():
    import torch

    chat = load_pair("tiny-random", dtype=torch.float32).tokenizer
    base = copy.deepcopy(chat)
    base.chat_template = None
    return chat, base


def test_the_plain_prompt_lays_out_exemplars_then_the_question():
    assert plain_prompt(MSGS) == "Be brief.\n\nQ: 1 + 1?\nA: 2\n\nQ: 2 + 2?\nA:"


def test_auto_uses_the_template_when_there_is_one_and_the_plain_prompt_otherwise(tokenizers):
    chat, base = tokenizers
    assert encode_chat(chat, MSGS) == encode_chat(chat, MSGS, True)
    assert chat.decode(encode_chat(chat, MSGS)) != plain_prompt(MSGS), "a chat model gets its template"
    assert base.decode(encode_chat(base, MSGS)).endswith(plain_prompt(MSGS))
    assert encode_chat(chat, MSGS, False) == encode_chat(base, MSGS)
    with pytest.raises(ValueError, match="no chat template"):
        encode_chat(base, MSGS, True)
