"""Spec-Bench's equality check on the real Qwen2.5-Coder pair: lossless greedy speculative output
equals target-only greedy output token for token. fp32, because bf16 verify passes over 6 tokens
and 1-token steps round differently and flip near-ties (docs/assets.md)."""

from __future__ import annotations

import pytest
import torch

from policies import make_policy
from workers.cpu_engine import SpecDecoder
from workers.models.pair import load_pair
from workers.prompts import encode_chat

pytestmark = [pytest.mark.real, pytest.mark.slow]

QUESTIONS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How much did she earn?",
    "A robe takes 2 bolts of blue fiber and half that much white fiber. How many bolts in total does it take?",
]


@pytest.fixture(scope="module")
def engine() -> SpecDecoder:
    return SpecDecoder(load_pair("qwen2.5-coder-0.5b+1.5b", dtype=torch.float32))


@pytest.mark.parametrize("question", QUESTIONS)
def test_real_pair_lossless_greedy_equals_target_only(engine, question):
    ids = encode_chat(engine.pair.tokenizer, [{"role": "user", "content": question}])
    # 16 new tokens: several draft rounds of 5, with acceptances and rejections; each fp32 target step is most of the time
    ref = engine.autoregressive(ids, max_new_tokens=16)
    got = engine.generate(ids, "lossless", draft_len=5, max_new_tokens=16)
    assert got.token_ids == ref.token_ids
    assert got.stats.mean_acceptance_length > 1.5, "the 0.5B draft should agree with the 1.5B target often"


def test_real_pair_lossy_rule_off_equals_lossless(engine):
    ids = encode_chat(engine.pair.tokenizer, [{"role": "user", "content": QUESTIONS[0]}])
    want = engine.generate(ids, "lossless", draft_len=5, max_new_tokens=16)
    for name, off in (("kl_judge", {"threshold": 0.0}), ("dropmatch", {"p_drop": 0.0, "criterion": "naive"})):
        got = engine.generate(ids, make_policy(name, **off), draft_len=5, max_new_tokens=16)
        assert got.token_ids == want.token_ids, name
