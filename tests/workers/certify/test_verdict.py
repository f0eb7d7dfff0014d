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
from workers.certify.verdict import CERTIFIED, GATE_EXIT, REFUTED, UNDECIDED, refutation, verdict_of


def test_a_candidate_that_loses_every_item_is_refuted_by_the_exact_test():
    plan = look_plan(40, 1, 0.05)
    got = refutation([1.0] * 40, [0.0] * 40, plan, 0.05, 0.05)
    assert got.refuted and got.method == "exact-unconditional" and got.look == 1 and got.n == 40
    assert got.level == pytest.approx(0.025) and got.p_value <= got.level
    assert got.reason.startswith("refuted: exact test of drop <= 0.05") and "40 lost / 0 won of 40" in got.reason


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


def test_graded_scores_go_to_the_betting_test_at_the_full_alpha():
    plan = look_plan(80, 1, 0.05)
    got = refutation([0.9] * 80, [0.1] * 80, plan, 0.2, 0.05)
    assert got.refuted and got.method == "betting" and got.level == pytest.approx(0.05)


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
    and at drops below, over a grid of the nuisance: P(refuted) <= alpha. The procedure as the sweep runs it, the
    exact test at every look and the betting test on the items in order, with nothing assumed of either."""
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
