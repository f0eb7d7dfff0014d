"""The replay audit of a certificate (``sweep.audit``): m, the fewest hidden losses that overturn it; the exact
power of a uniform sample against m errors placed anywhere; the draw recomputed from the evidence alone; and a
certificate withheld where the audit falls short of its power, was lost, or found a replayed record that differs."""

from __future__ import annotations

import csv
import itertools
import math
from dataclasses import replace
from fractions import Fraction
from types import SimpleNamespace

import pytest

import sweep.audit as audit
from sweep.audit import (
    POWER,
    audit_matches,
    audit_pending,
    audit_plan,
    audit_replayed,
    audit_withholds,
    catch_probability,
    draw,
    overturn_count,
    records_hash,
    sample_size,
)
from tests.workers.metrics.test_trial import rec
from workers.benchmarks.base import Item
from workers.certify.decide import certifies, sequential_bound
from workers.certify.sequential import look_plan
from workers.results.evidence import confirmation_rows, write_evidence


def evidence(n: int = 100, right: int = 60, diverged: tuple[int, ...] = (3, 11, 40), full: tuple[int, ...] = (0, 1, 2),
             lost: tuple[int, ...] = ()):
    """A candidate on n items that ties the reference everywhere (but at ``lost``, items the reference got right
    and it got wrong): replayed ``exact`` but at ``diverged`` (replayed, decoded live from a divergence: another
    output, the same score) and ``full`` (decoded in full). The reference is right on the first ``right`` items."""
    order = [f"i{k:03d}" for k in range(n)]
    reference = {k: rec(k, 1.0 if j < right else 0.0, ids=[[1, 2, 3]]) for j, k in enumerate(order)}
    records = {}
    for j, k in enumerate(order):
        r = rec(k, 0.0 if j in lost else reference[k].score, ids=[[1, 2, 3]])
        if j in diverged or j in lost:
            r = replace(r, replay="diverged@1", output_token_ids=[[1, 9, 9]])
        elif j not in full:
            r = replace(r, replay="exact")
        records[k] = r
    rows, _ = confirmation_rows(order, reference, records)
    return order, reference, records, rows


def scores(rows):
    return [r["reference_score"] for r in rows], [r["candidate_score"] for r in rows]


@pytest.fixture(scope="module")
def one_look():
    return look_plan(100, 1, 0.05)


def test_m_is_the_fewest_hidden_losses_that_overturn_a_certificate(one_look):
    """0 lost / 0 won of 100 at 10%: flipping m of the replayed ties to losses fails the test, m - 1 does not; and
    so at the deciding look of a group-sequential plan."""
    _, _, _, rows = evidence()
    ref, cand = scores(rows)
    pool = [i for i, r in enumerate(rows) if audit.could_hide_loss(r)]
    assert len(pool) == 60 - 3 - 3, "the reference's right ones, less the diverged and the decoded in full"
    m = overturn_count(ref, cand, one_look, 0.1, pool)
    assert m is not None and m > 1

    def certified_with(flips: int, where=pool) -> bool:
        flipped = list(cand)
        for i in where[:flips]:
            flipped[i] = 0.0
        return certifies(sequential_bound(ref, flipped, one_look, 0.1))

    assert not certified_with(m) and certified_with(m - 1)
    assert not certified_with(m, pool[::-1]) and certified_with(m - 1, pool[::-1]), "which ones does not matter"
    assert overturn_count(ref, cand, one_look, 0.1, pool[: m - 1]) is None, "too few ties to hide m losses"
    # a visible loss already spends some of the slack: one fewer hidden loss overturns it
    _, _, _, rows1 = evidence(lost=(5,))
    ref1, cand1 = scores(rows1)
    pool1 = [i for i, r in enumerate(rows1) if audit.could_hide_loss(r)]
    assert overturn_count(ref1, cand1, one_look, 0.1, pool1) == m - 1
    # two looks (calibrated): at the look it certified at, with that look's threshold
    plan = look_plan(100, 2, 0.05, budget=0.2)
    assert sequential_bound(ref[:50], cand[:50], plan, 0.2).look == 1
    half = [i for i in pool if i < 50]
    m2 = overturn_count(ref[:50], cand[:50], plan, 0.2, half)
    flipped = list(cand[:50])
    for i in half[:m2]:
        flipped[i] = 0.0
    assert not certifies(sequential_bound(ref[:50], flipped, plan, 0.2))
    flipped[half[m2 - 1]] = 1.0
    assert certifies(sequential_bound(ref[:50], flipped, plan, 0.2))


def test_the_power_is_exact_against_every_sample_and_every_placement():
    """1 - C(N - m, s) / C(N, s) is the share of the s-subsets of N that hold at least one of m given records, for
    every placement of the m (brute force, small N); s is the smallest that reaches the power."""
    for n in range(0, 8):
        for m in range(0, n + 1):
            for s in range(0, n + 1):
                subsets = list(itertools.combinations(range(n), s))
                for errors in {tuple(range(m)), tuple(range(n - m, n)), tuple(range(0, 2 * m, 2)) if 2 * m <= n else ()}:
                    if len(errors) != m:
                        continue
                    caught = Fraction(sum(bool(set(errors) & set(x)) for x in subsets), len(subsets))
                    assert catch_probability(n, m, s) == pytest.approx(float(caught), abs=1e-15), (n, m, s, errors)
    assert catch_probability(10, None, 0) == 1.0, "nothing to catch where no set of errors overturns it"
    assert sample_size(10, None) == 0 and sample_size(10, 0) == 10
    for n, m in ((119, 5), (173, 10), (40, 1), (7, 7)):
        s = sample_size(n, m)
        assert catch_probability(n, m, s) >= POWER and (s == 0 or catch_probability(n, m, s - 1) < POWER)
    assert sample_size(40, 1) == 38, "one hidden loss overturns it: nearly all of them"
    # the committed 5% certificate's figures (docs/results/gsm8k-int4-frontier: 0 / 0 of 214 at look 2 of 3, 119 ties)
    assert (sample_size(119, 5), round(catch_probability(119, 5, 53), 4)) == (53, 0.9511)
    with pytest.raises(ValueError):
        catch_probability(5, 6, 1)


def test_the_draw_is_fixed_by_the_records_and_recomputed_from_the_evidence_csv(tmp_path, one_look):
    _, _, _, rows = evidence()
    write_evidence(tmp_path / "e.csv", rows)
    with (tmp_path / "e.csv").open() as fh:
        read = list(csv.DictReader(fh))
    assert records_hash(read) == records_hash(rows), "the CSV holds what the seed hashes"
    planned = audit_plan(rows, one_look, 0.1)
    assert audit_plan(read, one_look, 0.1) == planned, "check recomputes the same audit from the CSV alone"
    assert planned["risk_ids"] == ["i003", "i011", "i040"] and planned["eligible"] == 54 and planned["n"] == 100
    assert planned["sample"] == sample_size(54, planned["overturn"]) == len(planned["sample_ids"])
    assert set(planned["sample_ids"]) <= {r["item_id"] for r in rows if audit.could_hide_loss(r)}
    assert planned["power"] >= POWER and planned["seed"] == records_hash(rows)
    # another record (one answer, one score) is another seed, and another draw
    other = [dict(r) for r in rows]
    other[70]["candidate_answer"] = "7"
    assert records_hash(other) != planned["seed"]
    assert draw(planned["sample_ids"], planned["seed"], 5) == draw(list(reversed(planned["sample_ids"])), planned["seed"], 5)
    ids = [f"x{k}" for k in range(30)]
    firsts = {draw(ids, f"seed{k}", 1)[0] for k in range(300)}
    assert len(firsts) > 20, "every id can come first"
    stated = {**planned, "audited": planned["risk"] + planned["sample"], "achieved": planned["power"]}
    assert audit_matches(stated, read, one_look, 0.1)
    assert not audit_matches({**stated, "sample_ids": stated["sample_ids"][1:] + ["i099"]}, read, one_look, 0.1)
    assert not audit_matches({**stated, "audited": stated["audited"] - 1}, read, one_look, 0.1)
    with pytest.raises(ValueError, match="do not certify"):
        audit_plan(rows, one_look, 0.001)


def test_a_certificate_short_of_its_audit_power_is_withheld_and_waits():
    records = {"a": rec("a", 1.0), "b": replace(rec("b", 1.0), replay="exact")}
    planned = {"overturn": 5, "risk": 2, "sample": 53, "target": POWER}
    done = {"items": 55, "replayed": 55, "replayed_differ": [], "full_differ": [], "audit_wanted": 55,
            "audit_done": 55, "audit": {**planned, "achieved": 0.951}}
    assert audit_withholds(done, records) is None
    short = {**done, "audit": {**planned, "achieved": 0.9}}
    reason = audit_withholds(short, records)
    assert reason and "0.900" in reason and "5 hidden losses" in reason and audit_pending(short, records)
    lost = {**done, "audit_done": 20, "audit": {**planned, "achieved": 0.0}}
    reason = audit_withholds(lost, records)
    assert reason and "20 of the 55" in reason and "lost" in reason and audit_pending(lost, records)
    differ = {**lost, "replayed_differ": ["candidate:b"]}
    assert "differs" in audit_withholds(differ, records) and not audit_pending(differ, records)
    # no set of hidden losses overturns it: nothing owed, nothing timed, and the certificate stands
    nothing = {"items": 0, "replayed": 0, "replayed_differ": [], "full_differ": [], "audit_wanted": 0, "audit_done": 0,
               "audit": {**planned, "overturn": None, "sample": 0, "risk": 0, "achieved": 1.0}}
    assert audit_withholds(nothing, records) is None


@pytest.fixture
def sweep_like(monkeypatch, one_look):
    """A fake sweep state whose actors decode by ``decode`` (the held record, or what a test puts there)."""
    order, reference, records, rows = evidence()
    items = [Item(k, j, ("q",), None) for j, k in enumerate(order)]
    state = SimpleNamespace(settings=SimpleNamespace(decode={}, bench=SimpleNamespace(ref="b")), workers=[])
    row = {"family": "top_k", "params": '{"k": 2}', "draft_len": 2}
    asked: list[list[str]] = []
    full: dict = {}

    def decode(state_, row_, todo, reference_):
        asked.append([it.id for it in todo])
        if full.get("lost"):
            return None
        return [replace(full.get(it.id, records[it.id]), replay="") for it in todo]

    monkeypatch.setattr(audit, "_decode", decode)
    bound = sequential_bound(*scores(rows), one_look, 0.1)
    return SimpleNamespace(state=state, items=items, row=row, records=records, reference=reference, rows=rows,
                           bound=bound, asked=asked, full=full)


def test_a_certificates_audit_decodes_the_risk_chosen_and_the_drawn_and_states_its_power(sweep_like, one_look):
    s = sweep_like
    timed = {"items": 2, "replayed": 2, "replayed_differ": [], "full_differ": [], "candidate_items": ["i005", "i003"],
             "status": "identical"}
    check = audit_replayed(s.state, s.items, s.row, s.records, s.reference, 100, timed, bound=s.bound, plan=one_look,
                           rows=s.rows)
    planned = audit_plan(s.rows, one_look, 0.1)
    owed = planned["risk_ids"] + planned["sample_ids"]
    assert s.asked == [[k for k in owed if k not in ("i005", "i003")]], "the timed ones are not decoded again"
    assert timed["candidate_items"] == ["i005", "i003"], "the timed check is left as it was"
    stated = check["audit"]
    assert {k: stated[k] for k in planned} == planned
    assert stated["audited"] == len(owed) == check["audit_wanted"] == check["audit_done"]
    assert stated["achieved"] == planned["power"] >= POWER and check["status"] == "identical"
    assert audit_withholds(check, s.records) is None
    assert audit_matches(stated, s.rows, one_look, 0.1)
    # a drawn record that its full decode contradicts: withheld, and decided (not pending)
    s.full[planned["sample_ids"][-1]] = rec(planned["sample_ids"][-1], 0.0, ids=[[1, 7]])
    contradicted = audit_replayed(s.state, s.items, s.row, s.records, s.reference, 100, {}, bound=s.bound,
                                  plan=one_look, rows=s.rows)
    assert contradicted["replayed_differ"] == [f"candidate:{planned['sample_ids'][-1]}"]
    assert "differs" in audit_withholds(contradicted, s.records) and not audit_pending(contradicted, s.records)
    # lost part-way (no actor left): short of its power, withheld and left pending for a rerun
    s.full["lost"] = True
    lost = audit_replayed(s.state, s.items, s.row, s.records, s.reference, 100, timed, bound=s.bound, plan=one_look,
                          rows=s.rows)
    assert lost["audit"]["achieved"] < POWER and lost["audit_done"] < lost["audit_wanted"]
    assert "lost" in audit_withholds(lost, s.records) and audit_pending(lost, s.records)


def test_a_refusal_keeps_the_cheap_audit(sweep_like):
    """A budget not certified needs no audit for its guarantee: the first max(30, 10%) replayed records, in order."""
    s = sweep_like
    check = audit_replayed(s.state, s.items, s.row, s.records, s.reference, 100,
                           {"candidate_items": ["i003"], "audit": {"budget": 0.05}})
    replayed = [it.id for it in s.items if not s.records[it.id].timed]
    assert s.asked == [[k for k in replayed if k != "i003"][:29]]
    assert "audit" not in check, "another budget's powered statement is not this one's"
    assert (check["audit_wanted"], check["audit_done"], check["extra_items"]) == (30, 30, 29)
    assert audit_withholds(check, s.records) is None
    assert math.isclose(audit.AUDIT_SHARE, 0.1) and audit.AUDIT_MIN == 30
