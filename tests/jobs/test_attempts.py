"""The attempts ledger: a budget is never tested twice on the same confirmation items."""

from __future__ import annotations

from jobs.attempts import AttemptLedger, attempt_of

ITEMS = [f"gsm8k/test/{i:04d}" for i in range(200)]


def test_the_same_attempt_resumed_is_allowed_and_recorded_once(tmp_path):
    ledger = AttemptLedger(tmp_path, "gsm8k", "pair", "fp32")
    a = attempt_of("study-1", 0.05, 0.05, ["k1", "k2"], ITEMS)
    assert ledger.check(a) == (False, None)
    ledger.record(a, False, "bound above the budget")
    assert ledger.check(attempt_of("study-1", 0.05, 0.05, ["k1", "k2"], list(ITEMS))) == (True, None)
    assert len(ledger.rows()) == 1


def test_another_attempt_on_overlapping_items_is_refused_naming_the_first(tmp_path):
    ledger = AttemptLedger(tmp_path, "gsm8k", "pair", "fp32")
    ledger.record(attempt_of("study-1", 0.02, 0.05, ["k1"], ITEMS[:100]), False, "not certified")
    # more trials changed the candidates; a larger pool that contains the first 100 items
    recorded, refusal = ledger.check(attempt_of("study-1", 0.02, 0.05, ["k3", "k1"], ITEMS))
    assert not recorded and "already tested on 100 of these 200" in refusal and "study-1" in refusal
    assert "not certified" in refusal and "inflates the error" in refusal
    # another budget, or items no attempt has used: allowed
    assert ledger.check(attempt_of("study-2", 0.05, 0.05, ["k1"], ITEMS))[1] is None
    assert ledger.check(attempt_of("study-2", 0.02, 0.05, ["k1"], ITEMS[100:]))[1] is None


def test_ledgers_are_per_benchmark_pair_and_dtype_and_survive_a_torn_line(tmp_path):
    a = AttemptLedger(tmp_path, "gsm8k", "pair", "fp32")
    a.record(attempt_of("s", 0.05, 0.05, ["k"], ITEMS), True, "ok")
    with a.path.open("a") as fh:
        fh.write('{"study": "torn')
    assert len(a.rows()) == 1
    assert AttemptLedger(tmp_path, "mmlu", "pair", "fp32").check(attempt_of("s2", 0.05, 0.05, ["k"], ITEMS))[1] is None
