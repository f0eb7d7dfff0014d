"""A budget's verdict (``workers.certify.verdict``): refuted by the exact test at a planned look or by the anytime-valid
betting test (half of alpha each for right/wrong scores), never by a look the confirmation did not reach; certified
and refuted never together; the error of the whole refutation procedure, union over looks and the betting test, held
to alpha by exact enumeration of every outcome sequence at small n."""

from __future__ import annotations

import itertools
import math

import pytest

from workers.certify.decide import Certificate
from workers.certify.sequential import look_plan
from workers.certify.verdict import (
    CERTIFIED,
    GATE_EXIT,
    REFUTED,
    UNDECIDED,
    futility_level,
    refutation,
    verdict_of,
)


def test_a_candidate_that_loses_every_item_is_refuted_by_the_exact_test():
    plan = look_plan(40, 1, 0.05)
    got = refutation([1.0] * 40, [0.0] * 40, plan, 0.05, 0.05)
    assert got.refuted and got.method == "exact-unconditional" and got.look == 1 and got.n == 40
    assert got.level == pytest.approx(0.025) and got.p_value <= got.level
    assert got.reason.startswith("refuted: exact test of drop <= 0.05") and "40 lost / 0 won of the first 40 items, as observed" in got.reason


def test_ties_refute_nothing_and_a_gain_refutes_nothing():
    plan = look_plan(60, 3, 0.05)
    assert not refutation([1.0] * 60, [1.0] * 60, plan, 0.02, 0.05).refuted
    assert not refutation([0.0] * 60, [1.0] * 60, plan, 0.02, 0.05).refuted


def test_a_confirmation_cut_short_by_futility_is_refuted_by_the_anytime_valid_test_alone():
    # 2 looks over 100 items (the first at 50): futility stopped it after 24 items, before any look
    plan = look_plan(100, 2, 0.05)
    got = refutation([1.0] * 24, [0.0] * 24, plan, 0.05, 0.05)
    assert got.refuted and got.method == "betting" and got.look == 0 and got.n <= 24
    assert got.level == pytest.approx(0.025)  # the other half of alpha
    few = refutation([1.0] * 3, [0.0] * 3, plan, 0.05, 0.05)
    assert not few.refuted and few.reason.startswith("not refuted") and math.isnan(few.p_value)


def test_graded_scores_go_to_the_betting_test_at_the_futility_stops_level():
    """No exact test for bounded scores: the betting test alone, at the half of alpha the futility stop runs at
    (so the stop and the refutation stay one test); the other half is unspent."""
    plan = look_plan(80, 1, 0.05)
    got = refutation([0.9] * 80, [0.1] * 80, plan, 0.2, 0.05)
    assert got.refuted and got.method == "betting" and got.level == pytest.approx(futility_level(0.05)) == 0.025


def test_verdicts_and_the_gate_codes():
    plan = look_plan(40, 1, 0.05)
    lost = refutation([1.0] * 40, [0.0] * 40, plan, 0.05, 0.05)
    kept = refutation([1.0] * 40, [1.0] * 40, plan, 0.05, 0.05)
    assert verdict_of(True, None) == CERTIFIED and verdict_of(False, lost) == REFUTED
    assert verdict_of(False, kept) == UNDECIDED and verdict_of(False, None) == UNDECIDED
    assert GATE_EXIT == {CERTIFIED: 0, REFUTED: 10, UNDECIDED: 11}
    cert = Certificate(0.05, 0.05, False, None, None, [], None, "not certified", lost)
    assert cert.verdict == REFUTED and cert.to_dict()["refutation"]["refuted"] is True
    assert cert.to_dict()["verdict"] == "refuted"


def test_bad_input_names_the_problem():
    plan = look_plan(10, 1, 0.05)
    with pytest.raises(ValueError, match="budget must be in"):
        refutation([1.0], [0.0], plan, 1.5, 0.05)
    with pytest.raises(ValueError, match="alpha must be in"):
        refutation([1.0], [0.0], plan, 0.05, 0.0)
    with pytest.raises(ValueError, match="paired"):
        refutation([1.0, 1.0], [0.0], plan, 0.05, 0.05)


@pytest.mark.parametrize("n, looks, budget", [(8, 1, 0.1), (10, 2, 0.1), (9, 3, 0.2), (10, 2, 0.3)])
def test_the_whole_procedure_refutes_falsely_at_most_alpha_by_exact_enumeration(n, looks, budget):
    """Every sequence of n paired outcomes (lost, won, tied: 3^n of them), weighted by its probability at drop = b
    and at drops below, over a grid of the nuisance: P(refuted) <= alpha. The procedure on a complete observed
    sequence: the exact test at every look and the betting test on the items in order, nothing assumed of either
    (what the sweep hands it, the observed prefix, is test_the_evidence_a_refutation_rests_on)."""
    alpha = 0.2  # large, so that small n can refute at all and the check has something to bite on
    plan = look_plan(n, looks, alpha)
    pairs = {"l": (1.0, 0.0), "w": (0.0, 1.0), "t": (1.0, 1.0)}
    refuted_sequences = []
    for seq in itertools.product("lwt", repeat=n):
        ref, tri = zip(*(pairs[s] for s in seq), strict=True)
        if refutation(ref, tri, plan, budget, alpha).refuted:
            refuted_sequences.append((seq.count("l"), seq.count("w")))
    assert refuted_sequences, "nothing refuted: the check would be empty"
    worst = 0.0
    for drop in (budget, budget - 0.05, 0.0):
        top = (1.0 - drop) / 2.0
        for k in range(41):
            p_won = max(0.0, -drop) + (top - max(0.0, -drop)) * k / 40
            p_lost, p_tie = p_won + drop, 1.0 - 2.0 * p_won - drop
            if p_lost < 0 or p_tie < -1e-12:
                continue
            prob = sum(p_lost ** lost * p_won ** won * max(p_tie, 0.0) ** (n - lost - won)
                       for lost, won in refuted_sequences)
            worst = max(worst, prob)
    assert worst <= alpha + 1e-12, worst


def test_the_evidence_a_refutation_rests_on():
    """Only the observed prefix, never certification's booked losses after a futility stop; a failed item counts
    against refutation (the reference wrong, the candidate right) and turns the betting test off."""
    from workers.evaluation import Record
    from workers.results.evidence import confirmation_rows, refutation_pairs

    def rec(item: str, score: float, failed: bool = False) -> Record:
        return Record(item_id=item, index=0, benchmark="b", spec_key="k", policy="p", params="{}", draft_len=0,
                      outputs=["x"], score=math.nan if failed else score, extracted=None, reason="", tokens=10,
                      num_drafts=10, num_draft_tokens=0, num_accepted_tokens=0, accepted_per_position=[],
                      target_forwards=10, draft_forwards=0, prefill_time_s=0.0, draft_time_s=0.0, verify_time_s=1.0,
                      policy_time_s=0.0, wall_time_s=1.0, finish_reasons=["length"], output_token_ids=[[1]],
                      error="boom" if failed else None)

    order = [f"i{k}" for k in range(10)]
    reference = {k: rec(k, 1.0) for k in order}
    trial = {k: rec(k, 0.0) for k in order[:4]}  # stopped after 4 items
    rows, counts = confirmation_rows(order, reference, trial)
    assert sum(r["candidate_score"] == 0.0 for r in rows) == 10  # certification books all 10 as lost
    ref, got, failed = refutation_pairs(order, reference, trial)
    assert (ref, got, failed) == ([1.0] * 4, [0.0] * 4, 0)  # a refutation sees the 4 observed
    trial["i1"] = rec("i1", 0.0, failed=True)
    reference["i2"] = rec("i2", 1.0, failed=True)
    ref, got, failed = refutation_pairs(order, reference, trial)
    assert ref == [1.0, 1.0, 0.0, 1.0] and got == [0.0, 1.0, 0.0, 0.0] and failed == 2
    plan = look_plan(100, 2, 0.05)
    assert refutation([1.0] * 30, [0.0] * 30, plan, 0.05, 0.05).method == "betting"
    off = refutation([1.0] * 30, [0.0] * 30, plan, 0.05, 0.05, imputed=1)
    assert not off.refuted and "the betting test not run (1 failed or missing item(s) among 30)" in off.reason
