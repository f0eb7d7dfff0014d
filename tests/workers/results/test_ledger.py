"""The certificate ledger: one attempt per item, whatever the budget, alpha, dtype, seed, runs root or
spelling of the pair; resuming the same attempt is allowed; --new-items takes items no attempt used."""

from __future__ import annotations

import json

import pytest

from workers.results.ledger import KNOWN, AttemptLedger, LedgerRefusal, Plan

POOL = [f"gsm8k/test/{i:04d}" for i in range(300)]


def plan(study="s1", budgets=(0.05,), alpha=0.05, keys=("k1",), n=100, looks=1) -> Plan:
    return Plan(study, tuple(budgets), tuple(alpha for _ in budgets), tuple(tuple(keys) for _ in budgets), looks, n)


def test_an_attempt_is_opened_before_anything_is_decided_and_survives_a_kill(tmp_path):
    ledger = AttemptLedger("gsm8k", "pair:abc", tmp_path)
    aid, items, earlier = ledger.open(plan(), POOL, False, pair="p", dtype="fp32")
    assert items == POOL[:100] and earlier == []
    # killed here, before any decision: the row is on disk and every planned item counts as used
    assert set(AttemptLedger("gsm8k", "pair:abc", tmp_path).used()) == set(POOL[:100])
    # the same attempt resumed: allowed, the same items, nothing new written
    again, items2, _ = ledger.open(plan(), POOL, False, pair="p", dtype="fp32")
    assert (again, items2) == (aid, items) and len(ledger.rows()) == 1


@pytest.mark.parametrize("change", [
    dict(budgets=(0.0501,)), dict(budgets=(0.05000000001,)), dict(alpha=0.1), dict(keys=("k2", "k1")),
    dict(study="another-seed-or-dtype-or-runs-root"), dict(n=40), dict(looks=2),
])
def test_any_other_attempt_on_used_items_is_refused_naming_the_first(tmp_path, change):
    ledger = AttemptLedger("gsm8k", "pair:abc", tmp_path)
    aid, _, _ = ledger.open(plan(), POOL, False, pair="p", dtype="fp32")
    ledger.decide(aid, 0.05, False, "not certified", 100)
    with pytest.raises(LedgerRefusal, match=r"already used: .* by attempt " + aid + r".*--new-items"):
        ledger.open(plan(**change), POOL, False, pair="other spelling", dtype="bf16")


def test_new_items_skips_every_used_item_and_lists_the_earlier_attempts(tmp_path):
    ledger = AttemptLedger("gsm8k", "pair:abc", tmp_path)
    first, _, _ = ledger.open(plan(n=100), POOL, False, pair="p", dtype="fp32")
    second, items, earlier = ledger.open(plan(budgets=(0.0501,), n=50), POOL, True, pair="p", dtype="fp32")
    assert items == POOL[100:150] and [a["attempt"] for a in earlier] == [first]
    # resuming the --new-items attempt keeps its own items (its own are not "earlier")
    assert ledger.open(plan(budgets=(0.0501,), n=50), POOL, True, pair="p", dtype="fp32")[:2] == (second, items)
    with pytest.raises(LedgerRefusal, match="fewer than the 200 planned"):
        ledger.open(plan(study="s3", n=200), POOL, True, pair="p", dtype="fp32")


def test_a_group_sequential_attempt_that_stopped_early_frees_the_items_it_never_evaluated(tmp_path):
    ledger = AttemptLedger("gsm8k", "pair:abc", tmp_path)
    aid, _, _ = ledger.open(plan(budgets=(0.05, 0.1), n=200, looks=2), POOL, False, pair="p", dtype="fp32")
    ledger.decide(aid, 0.05, True, "certified at look 1", 100)
    assert len(ledger.used()) == 200, "a budget still open: every planned item is used"
    ledger.decide(aid, 0.1, True, "certified at look 1", 100)
    ledger.decide(aid, 0.1, True, "decided again on a resume", 100)
    assert set(ledger.used()) == set(POOL[:100]) and len(ledger.rows()) == 3


def test_ledgers_are_per_benchmark_and_pair_identity_and_survive_a_torn_line(tmp_path):
    a = AttemptLedger("gsm8k", "pair:abc", tmp_path)
    a.open(plan(), POOL, False, pair="p", dtype="fp32")
    with a.path.open("a") as fh:
        fh.write('{"event": "opened", "torn')
    assert len(a.rows()) == 1
    assert AttemptLedger("mmlu", "pair:abc", tmp_path).open(plan(), POOL, False, pair="p", dtype="fp32")[1] == POOL[:100]
    assert AttemptLedger("gsm8k", "pair:xyz", tmp_path).open(plan(), POOL, False, pair="p", dtype="fp32")[1] == POOL[:100]


def test_the_ledger_lives_outside_any_runs_root(tmp_path, monkeypatch):
    from workers.results.ledger import ledger_root

    monkeypatch.delenv("SPECTUNE_LEDGER")
    monkeypatch.setenv("SPECTUNE_CACHE", str(tmp_path / "cache"))
    assert ledger_root() == tmp_path / "cache" / "ledger"


def test_the_attempts_made_before_the_ledger_are_shipped_in_it():
    """The 2026-11-30 real-pair sweep (40 confirmation items), the 2026-12-01 KL-judge certificate (120 of its
    240 planned items used) and the 2026-12-02 frontier's attempt are in every ledger of the shipped pair on GSM8K: the committed certificate's items
    overlap the first attempt's on 19 items, which is why it is marked superseded."""
    from workers.models.identity import pair_fingerprint

    ledger = AttemptLedger("gsm8k", pair_fingerprint("qwen2.5-coder-0.5b+1.5b"), "/nonexistent")
    attempts = ledger.attempts()
    assert sorted(attempts) == ["467f0c67fa7e", "known-2026-11-30", "known-2026-12-01"]
    first, second = attempts["known-2026-11-30"], attempts["known-2026-12-01"]
    assert len(first["used"]) == 40 and len(second["used"]) == 120 and len(second["items"]) == 240
    assert len(set(first["used"]) & set(second["used"])) == 19
    assert len(set(first["search_items"]) & set(second["used"])) == 8
    # the 2026-12-02 frontier (docs/results/gsm8k-real-frontier): 64 items no earlier attempt used, all four
    # budgets decided (none certified), so no later attempt confirms on them
    frontier = attempts["467f0c67fa7e"]
    assert len(frontier["used"]) == 64 and not set(frontier["used"]) & (set(first["used"]) | set(second["used"]))
    assert sorted(float(b) for b in frontier["decided"]) == [0.01, 0.02, 0.05, 0.1]
    assert all(json.loads(line)["pair_id"] == ledger.pair_id for line in KNOWN.read_text().splitlines())


def test_a_torn_last_line_does_not_swallow_the_next_attempt(tmp_path):
    ledger = AttemptLedger("gsm8k", "pair:abc", tmp_path)
    ledger.open(plan(n=10), POOL, False, pair="p", dtype="fp32")
    with ledger.path.open("a") as fh:
        fh.write('{"event": "opened", "torn')  # a crash mid-write
    second, items, _ = ledger.open(plan(study="s2", n=10), POOL, True, pair="p", dtype="fp32")
    assert second in ledger.attempts() and set(items) <= set(ledger.used())


def test_a_resume_is_the_same_run_directory_and_earlier_search_items_are_never_confirmed_on(tmp_path):
    ledger = AttemptLedger("gsm8k", "pair:abc", tmp_path)
    here = Plan("s1", (0.05,), (0.05,), (("k1",),), 1, 20, "/runs/a")
    aid, items, _ = ledger.open(here, POOL, False, pair="p", dtype="fp32", search_items=POOL[30:40])
    assert ledger.open(here, POOL, False, pair="p", dtype="fp32")[0] == aid
    with pytest.raises(LedgerRefusal, match="already used"):  # the same study and plan in another run directory
        ledger.open(Plan("s1", (0.05,), (0.05,), (("k1",),), 1, 20, "/runs/b"), POOL, False, pair="p", dtype="fp32")
    # a later study's pool front skips the first study's search items as well as its confirmation items
    _, later, _ = ledger.open(plan(study="s2", n=30), POOL, True, pair="p", dtype="fp32")
    assert later == POOL[20:30] + POOL[40:60]
