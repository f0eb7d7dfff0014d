"""The batched CPU engine on the real Qwen2.5-Coder pair (int4+int8, GSM8K 1-shot): every row's record is the one
batch 1 makes, token for token, with items joining a running batch (4 items, 3 rows), for target-only, a lossy rule
decoded in full and lossless replayed from the references; the rows share the few-shot prefix."""

from __future__ import annotations

import pytest

from workers.benchmarks import get_benchmark
from workers.cpu_engine import SpecDecoder
from workers.evaluation import TARGET_ONLY, DecodeSpec, evaluate_item, reference_payload
from workers.models.pair import load_pair

pytestmark = [pytest.mark.real, pytest.mark.slow]


@pytest.fixture(scope="module")
def engine() -> SpecDecoder:
    return SpecDecoder(load_pair("qwen2.5-coder-0.5b+1.5b", dtype="int4+int8"))


def test_real_pair_rows_equal_batch_1(engine):
    bench = get_benchmark("gsm8k")
    items = bench.items(limit=4)  # one more than the batch: the fourth joins a running batch
    # a shared 1-shot preamble (~120 tokens of ~200-240): each item's prefill at batch 1 is most of this test's time
    common = dict(max_new_tokens=16, shots=1)
    reference = DecodeSpec.make(TARGET_ONLY, **common)
    alone = [evaluate_item(engine, bench, item, reference) for item in items]
    batched = engine.evaluate_items(bench, items, reference, batch_size=3)
    assert [r.output_token_ids for r in batched] == [r.output_token_ids for r in alone]
    assert engine.batcher(3).stats.prefix_copies >= 2, "the few-shot preamble is copied between rows, not recomputed"
    refs = {r.item_id: reference_payload(r) for r in alone}
    for spec, given in ((DecodeSpec.make("kl_judge", {"threshold": 2.0}, 4, **common), {}),
                        (DecodeSpec.make("lossless", {}, 3, **common), refs)):
        want = [evaluate_item(engine, bench, item, spec, given.get(item.id)) for item in items]
        got = engine.evaluate_items(bench, items, spec, given, batch_size=3)
        assert [(r.output_token_ids, r.num_accepted_tokens, r.replay) for r in got] == \
            [(r.output_token_ids, r.num_accepted_tokens, r.replay) for r in want], spec.label()


def test_real_pair_coupled_lossless_equals_coupled_target_only_at_t_07(engine):
    """The coupled sampler on the int8 path, at Qwen2.5's recommended sampling (T 0.7, top-k 20, top-p 0.8): lossless
    speculative decoding outputs target-only's tokens for the same seed, token for token, item by item and as
    batched rows (the verify pass's int8 logits equal a single step's bit for bit: what the equality rests on)."""
    bench = get_benchmark("gsm8k")
    items = bench.items(limit=3)
    common = dict(max_new_tokens=24, shots=1, temperature=0.7, top_k=20, top_p=0.8, sampler="coupled", seed=3)
    reference = DecodeSpec.make(TARGET_ONLY, **common)
    lossless = DecodeSpec.make("lossless", {}, 4, **common)
    want = [evaluate_item(engine, bench, item, reference).output_token_ids for item in items]
    alone = [evaluate_item(engine, bench, item, lossless) for item in items]
    assert [r.output_token_ids for r in alone] == want
    assert sum(r.num_draft_tokens - r.num_accepted_tokens for r in alone) > 0, "some drafts were rejected"
    batched = engine.evaluate_items(bench, items, lossless, batch_size=3)
    assert [r.output_token_ids for r in batched] == want
