"""The certificate ledger: one attempt per item, whatever the budget, alpha, dtype, seed, runs root or
spelling of the pair; resuming the same attempt is allowed; --new-items takes items no attempt used."""

from __future__ import annotations

import json
from pathlib import Path

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


def test_ledgers_are_per_benchmark_and_pair_identity(tmp_path):
    a = AttemptLedger("gsm8k", "pair:abc", tmp_path)
    a.open(plan(), POOL, False, pair="p", dtype="fp32")
    assert len(a.rows()) == 1
    assert AttemptLedger("mmlu", "pair:abc", tmp_path).open(plan(), POOL, False, pair="p", dtype="fp32")[1] == POOL[:100]
    assert AttemptLedger("gsm8k", "pair:xyz", tmp_path).open(plan(), POOL, False, pair="p", dtype="fp32")[1] == POOL[:100]


def test_an_old_json_lines_ledger_in_the_folder_is_imported_once_and_a_torn_line_skipped(tmp_path):
    old = {"event": "opened", "attempt": "old1", "benchmark": "gsm8k", "pair_id": "pair:abc", "budgets": [0.05],
           "items": POOL[:10], "search_items": []}
    (tmp_path / "gsm8k-abc.jsonl").write_text(json.dumps(old) + '\n{"event": "opened", "torn')
    ledger = AttemptLedger("gsm8k", "pair:abc", tmp_path)
    assert list(ledger.attempts()) == ["old1"] and set(ledger.used()) == set(POOL[:10])
    assert ledger.attempts()["old1"]["number"] == 1  # numbered in its family when imported
    _, items, earlier = ledger.open(plan(n=5), POOL, True, pair="p", dtype="fp32")
    assert items == POOL[10:15] and [a["attempt"] for a in earlier] == ["old1"]
    assert len(AttemptLedger("gsm8k", "pair:abc", tmp_path).rows()) == 2, "imported once, however often opened"


def test_the_ledger_lives_outside_any_runs_root(tmp_path, monkeypatch):
    from workers.results.ledger import ledger_root

    monkeypatch.delenv("SPECTUNE_LEDGER")
    monkeypatch.setenv("SPECTUNE_CACHE", str(tmp_path / "cache"))
    assert ledger_root() == tmp_path / "cache" / "ledger"


def test_the_attempts_behind_committed_results_are_shipped_in_every_ledger(tmp_path):
    """The 2026-11-30 real-pair sweep (40 confirmation items), the 2026-12-01 KL-judge certificate (120 of its
    240 planned items used), the 2026-12-02 frontier's attempt and the 2026-12-04 int4+int8 frontier's (320 items,
    reconstructed from its exported folder) are in every ledger of the shipped pair on GSM8K, numbered 1 to 4 in
    their family: the committed certificate's items overlap the first attempt's on 19 items, which is why it is
    marked superseded."""
    ledger = AttemptLedger("gsm8k", "pair:160a47d7a09bd32b511d1dfcb7c21692", tmp_path)
    attempts = ledger.attempts()
    assert list(attempts) == ["known-2026-11-30", "known-2026-12-01", "467f0c67fa7e", "62cf91379d51"]
    assert [a["number"] for a in attempts.values()] == [1, 2, 3, 4] and ledger.next_number() == 5
    first, second = attempts["known-2026-11-30"], attempts["known-2026-12-01"]
    assert len(first["used"]) == 40 and len(second["used"]) == 120 and len(second["items"]) == 240
    assert len(set(first["used"]) & set(second["used"])) == 19
    assert len(set(first["search_items"]) & set(second["used"])) == 8
    # the 2026-12-02 frontier (docs/results/gsm8k-real-frontier): 64 items no earlier attempt used, all four
    # budgets decided (none certified), so no later attempt confirms on them
    frontier = attempts["467f0c67fa7e"]
    assert len(frontier["used"]) == 64 and not set(frontier["used"]) & (set(first["used"]) | set(second["used"]))
    assert sorted(float(b) for b in frontier["decided"]) == [0.01, 0.02, 0.05, 0.1]
    int4 = attempts["62cf91379d51"]
    assert int4["reconstructed"] and len(int4["used"]) == 320 and int4["decided"]["0.05"]["certified"]
    others = set().union(*(set(a["used"]) for k, a in attempts.items() if k != "62cf91379d51"))
    assert not set(int4["used"]) & others
    assert all(json.loads(line)["pair_id"] == ledger.pair_id for line in KNOWN.read_text().splitlines())
    # a fresh attempt with --new-items takes none of them
    pool = sorted({i for a in attempts.values() for i in a["used"]}) + [f"gsm8k/test/x{i}" for i in range(20)]
    _, items, earlier = ledger.open(plan(n=20), pool, True, pair="p", dtype="int8")
    assert items == pool[-20:] and len(earlier) == 4


def test_each_attempt_gets_its_number_and_level_in_the_family_and_resumes_keep_theirs(tmp_path):
    ledger = AttemptLedger("gsm8k", "pair:abc", tmp_path)
    first, _, _ = ledger.open(plan(n=10), POOL, True, pair="p", dtype="fp32")
    second, _, _ = ledger.open(plan(study="s2", n=10), POOL, True, pair="p", dtype="fp32")
    got = ledger.attempts()
    assert (got[first]["number"], got[second]["number"]) == (1, 2)
    assert got[second]["family"]["levels"] == [0.05 / 4]
    assert ledger.open(plan(n=10), POOL, True, pair="p", dtype="fp32")[0] == first and ledger.next_number() == 3
    assert ledger.family(0.05) == {"number": 3, "spending": got[first]["family"]["spending"], "alpha": 0.05,
                                   "level": 0.05 / 8}


def test_an_attempt_that_stopped_early_releases_its_claims_on_the_items_it_never_used(tmp_path):
    ledger = AttemptLedger("gsm8k", "pair:abc", tmp_path)
    aid, _, _ = ledger.open(plan(n=100, looks=2), POOL, False, pair="p", dtype="fp32")
    assert set(ledger.store.claims("gsm8k", "pair:abc")) == set(POOL[:100])
    ledger.decide(aid, 0.05, True, "certified at look 1", 50)
    assert set(ledger.store.claims("gsm8k", "pair:abc")) == set(POOL[:50])
    _, items, _ = ledger.open(plan(study="s2", n=50), POOL, True, pair="p", dtype="fp32")
    assert items == POOL[50:100]


def _race(url: str, study: str, out: str) -> None:
    from workers.results.ledger import AttemptLedger as Ledger

    ledger = Ledger("gsm8k", "pair:race", url)
    got = [ledger.open(plan(study=f"{study}-{k}", n=7), POOL, True, pair="p", dtype="fp32") for k in range(4)]
    Path(out).write_text(json.dumps([[aid, items] for aid, items, _ in got]))


def race(url: str, processes: int, prefix: str, tmp_path: Path) -> list[list]:
    """``processes`` spawned processes, each opening four attempts on the ledger at ``url`` at once: every
    attempt's [id, items]."""
    import multiprocessing as mp

    AttemptLedger("gsm8k", "pair:race", url).rows()  # the tables exist before the race
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_race, args=(url, f"{prefix}{k}", str(tmp_path / f"out{k}.json")))
             for k in range(processes)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return [a for k in range(processes) for a in json.loads((tmp_path / f"out{k}.json").read_text())]


def test_attempts_racing_from_separate_processes_never_share_an_item(tmp_path):
    """Six processes open four attempts each on one sqlite ledger at once, every one asking for the first unused
    items of the same pool: the claims' uniqueness constraint hands every item to one attempt."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    attempts = race(url, 6, "p", tmp_path)
    items = [i for _, got in attempts for i in got]
    assert len(attempts) == 24 and len(items) == 24 * 7
    assert len(set(items)) == len(items), "two racing attempts took one item"
    assert set(items) == set(POOL[:24 * 7]), "each took the first items no other attempt had"
    numbers = [a["number"] for a in AttemptLedger("gsm8k", "pair:race", url).attempts().values()]
    assert sorted(numbers) == list(range(1, 25)), "each attempt its own place in the family"


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


def test_the_familys_alpha_is_fixed_by_its_first_attempt(tmp_path):
    """Stating alpha 0.05 x 2^k at attempt k would give every attempt 0.05: a later attempt is tested at the
    family's share of the smaller of its alpha and the first attempt's."""
    ledger = AttemptLedger("gsm8k", "pair:abc", tmp_path)
    ledger.open(plan(n=10), POOL, True, pair="p", dtype="fp32")
    aid, _, _ = ledger.open(plan(study="s2", n=10, alpha=0.2), POOL, True, pair="p", dtype="fp32")
    fam = ledger.attempts()[aid]["family"]
    assert fam["cap"] == 0.05 and fam["levels"] == [0.05 / 4]
    assert ledger.family(0.4) == {"number": 3, "spending": fam["spending"], "alpha": 0.05, "level": 0.05 / 8}
