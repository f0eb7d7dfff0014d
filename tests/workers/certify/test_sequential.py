"""Group-sequential confirmation: the looks' levels hold the whole procedure's type-I error to alpha
(exact enumeration over a dense nuisance grid), one look is the fixed-n test, the decision stops at the
first look that passes and reads only that look's items, and the design saves items against a fixed-n
design of the same power."""

from __future__ import annotations

import numpy as np
import pytest

from workers.certify.decide import certifies, drop_bound, passes, sequential_bound
from workers.certify.exact import METHOD as EXACT
from workers.certify.exact import exact_plan, exact_power
from workers.certify.sequential import LookPlan, crossing, look_plan, sequential_power


def _worst(plan: LookPlan, budget: float, points: int = 201) -> float:
    """The procedure's largest P(certified) at drop = budget over a dense uniform nuisance grid (and both ends)."""
    grid = np.unique(np.r_[np.linspace(0.0, (1 - budget) / 2, points), np.geomspace(1e-6, 0.02, 12)])
    return max(sequential_power(plan, budget, 2 * pw + budget, budget)[0] for pw in grid)


def test_looks_fall_at_equal_steps_and_spend_alpha_along_the_power_family():
    plan = look_plan(240, 2, 0.05)
    assert plan.sizes == (120, 240)
    assert plan.spent == pytest.approx((0.05 / 4, 0.05))
    assert plan.alphas == pytest.approx((0.0125, 0.0375)), "without a budget: the union bound's increments"
    assert look_plan(3, 5, 0.05).sizes == (1, 2, 3), "never more looks than items"
    assert look_plan(50, 1, 0.05, budget=0.05).alphas == (0.05,), "one look: the fixed-n test at alpha"
    for bad in ({"n": 0}, {"looks": 0}, {"alpha": 0.0}, {"rho": 0.0}):
        with pytest.raises(ValueError):
            look_plan(**{"n": 10, "looks": 2, "alpha": 0.05, **bad})


@pytest.mark.parametrize("n", [30, 100])
def test_one_look_is_the_fixed_n_exact_test(n):
    got, expected = sequential_power(look_plan(n, 1, 0.05), 0.05, 0.1, 0.0)
    assert got == pytest.approx(exact_power(n, 0.05, 0.05, 0.1, 0.0), abs=1e-9)
    assert expected == pytest.approx(n)


@pytest.mark.slow
# the last three once exceeded alpha (0.0502-0.0526) when looks decided by p <= nominal level
@pytest.mark.parametrize(("n", "looks", "budget"), [(5, 2, 0.2), (31, 3, 0.05), (60, 4, 0.1), (100, 2, 0.05),
                                                    (70, 5, 0.05), (40, 2, 0.05), (70, 4, 0.02)])
def test_calibrated_looks_hold_the_type_one_error_over_the_nuisance(n, looks, budget):
    plan = look_plan(n, looks, 0.05, budget=budget)
    assert plan.budget == budget and plan.thresholds is not None, "small enough to calibrate exactly"
    assert _worst(plan, budget) <= 0.05
    worst = np.zeros(len(plan.sizes))
    for pw in np.linspace(0.0, (1 - budget) / 2, 1201):  # denser than the grid the calibration was checked on
        worst = np.maximum(worst, crossing(plan.sizes, plan.thresholds, budget, float(pw)))
    assert all(w <= s + 1e-12 for w, s in zip(worst, plan.spent, strict=True)), \
        ("by every look no more than its spending", worst, plan.spent)


def test_the_decision_is_exactly_the_calibrated_region():
    """Every outcome at every look: sequential_bound certifies iff Z_b <= the look's threshold (a decision by
    p <= the nominal level once admitted outcomes the calibration had left out)."""
    from workers.certify.exact import score_z

    budget = 0.2
    plan = look_plan(20, 2, 0.05, budget=budget)
    for k, n in enumerate(plan.sizes):
        for lost in range(n + 1):
            for won in range(n + 1 - lost):
                ref = [1.0] * lost + [0.0] * won + [1.0] * (n - lost - won)
                cand = [0.0] * lost + [1.0] * won + [1.0] * (n - lost - won)
                got = sequential_bound(ref, cand, LookPlan(plan.sizes[: k + 1], plan.alphas[: k + 1], 0.05,
                                                           spent=plan.spent[: k + 1], budget=budget,
                                                           thresholds=plan.thresholds[: k + 1]), budget)
                if got.look == k + 1:
                    assert certifies(got) == (score_z(lost, won, n, budget) <= plan.thresholds[k]), (n, lost, won)


def test_alpha_at_every_look_would_not_hold_its_level():
    """The check above can fail: testing each look at the full alpha exceeds it."""
    plan = look_plan(60, 4, 0.05, budget=0.1)
    naive = LookPlan(plan.sizes, (0.05,) * len(plan.sizes), 0.05)
    assert _worst(naive, 0.1, points=61) > 0.06


def test_the_union_bound_plan_is_valid_for_a_budget_it_was_not_calibrated_for():
    assert _worst(look_plan(60, 3, 0.05), 0.1, points=61) <= 0.05


@pytest.mark.slow
def test_large_confirmations_are_calibrated_on_their_bands_and_hold_alpha_closely():
    """Above N ~ 554 the whole state no longer fits and the plan fell back to the union bound (exact level
    0.0426 at N 600, K 2, b 5%: alpha wasted, and a power cliff at 554 -> 555). The bands that carry mass are
    calibrated instead: the level is close to alpha, within it."""
    plan = look_plan(600, 2, 0.05, budget=0.05)
    assert plan.budget == 0.05 and plan.thresholds is not None and "exact" in plan.to_dict()["spending"]
    level = _worst(plan, 0.05, points=81)
    assert 0.045 < level <= 0.05, level
    union = look_plan(600, 2, 0.05)
    assert sequential_power(plan, 0.05, 0.1, 0.0)[0] > sequential_power(union, 0.05, 0.1, 0.0)[0]


def test_the_banded_calibration_finds_the_whole_states_thresholds():
    """No cliff at the switch: where both fit, carrying only the bands gives the same thresholds."""
    from workers.certify.sequential import _sizes, calibrate

    sizes, spent = _sizes(120, 2, 0.05, 2.0)
    whole, banded = calibrate(sizes, spent, 0.05, False), calibrate(sizes, spent, 0.05, True)
    assert whole is not None and banded is not None and whole[1] == banded[1]


def test_large_confirmations_fall_back_to_the_union_bound():
    plan = look_plan(5000, 4, 0.05, budget=0.02)
    assert plan.budget is None and sum(plan.alphas) == pytest.approx(0.05)
    assert "union bound" in plan.to_dict()["spending"]


def test_the_decision_stops_at_the_first_look_that_passes_and_reads_only_its_items():
    plan = look_plan(200, 2, 0.05, budget=0.1)
    ref = [1.0] * 200
    clean = [1.0] * 100 + [0.0] * 100  # identical on look 1's items, hopeless after
    got = sequential_bound(ref, clean, plan, 0.1)
    assert certifies(got) and (got.look, got.looks, got.n) == (1, 2, 100)
    assert got.alpha == pytest.approx(plan.alphas[0])
    late = [0.0] * 8 + [1.0] * 192  # 8 lost in the first 100: not at look 1, yes at look 2
    got = sequential_bound(ref, late, plan, 0.1)
    assert (got.look, got.n) == (2, 200) and certifies(got)
    short = sequential_bound(ref[:40], clean[:40], plan, 0.1)  # fewer items than the first look
    assert (short.look, short.n) == (1, 40) and short.alpha == pytest.approx(plan.alphas[0])


def test_graded_scores_take_the_betting_bound_at_each_looks_share_of_alpha_at_every_look():
    """The calibrated levels hold for the exact test only and sum to more than alpha; a betting bound at each look
    gets the alpha that look spends, and a right/wrong prefix does not switch a graded run back to the exact test."""
    plan = look_plan(120, 3, 0.05, budget=0.05)
    assert sum(plan.alphas) > 0.05  # what a union over betting looks at these levels could reach
    shares = [plan.spent[0], plan.spent[1] - plan.spent[0], plan.spent[2] - plan.spent[1]]
    assert sum(shares) == pytest.approx(0.05)
    ref = [1.0] * 120
    graded = [1.0] * 119 + [0.5]  # right/wrong on the first two looks' items, one graded score in the last
    got = sequential_bound(ref, graded, plan, 0.05)
    assert got.method == "betting" and got.alpha == pytest.approx(shares[got.look - 1])
    for k, n in enumerate(plan.sizes, start=1):  # every look of it, taken alone: the same bound at the same share
        at = sequential_bound(ref, graded, LookPlan(plan.sizes[:k], plan.alphas[:k], plan.alpha, plan.rho,
                                                    plan.spent[:k], plan.budget, plan.thresholds[:k]), 0.05)
        assert at.method == "betting" and at.alpha == pytest.approx(shares[at.look - 1]), (k, n)
    binary = sequential_bound(ref, [1.0] * 120, plan, 0.05)
    assert binary.method == EXACT and binary.alpha == pytest.approx(plan.alphas[binary.look - 1])


def test_one_look_decides_exactly_as_the_fixed_n_test():
    ref, cand = [1.0] * 60, [1.0] * 57 + [0.0] * 3
    one = sequential_bound(ref, cand, look_plan(60, 1, 0.05, budget=0.2), 0.2)
    fixed = passes(drop_bound(ref, cand, 0.05), 0.2)
    assert (one.p_value, certifies(one), one.n) == (fixed.p_value, certifies(fixed), 60)


def test_a_safe_candidate_uses_fewer_items_than_a_fixed_design_of_the_same_power():
    fixed80 = exact_plan(0.05, 0.05)  # 161
    plan = look_plan(2 * fixed80, 4, 0.05, rho=1.0, budget=0.05)
    power, expected = sequential_power(plan, 0.05, 0.05, 0.0)
    same = exact_plan(0.05, 0.05, power=power)
    assert power >= 0.9 and expected <= 0.8 * same, (power, expected, same)
