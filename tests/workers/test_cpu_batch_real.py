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
