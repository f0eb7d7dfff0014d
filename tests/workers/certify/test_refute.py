"""Refutation, the mirror of certification: a budget is refuted when "the drop is at most b" is rejected at alpha.

Its level is checked the way certification's is, by exact enumeration: every (lost, won) outcome of n items, its
trinomial mass summed here (logs of the multinomial, nothing of the implementation's conditional tail), over a
nuisance grid far denser than the test's own, at every n up to 60 and a few above; at the budget, below it, and
through the looks of a plan by the union bound.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.special import gammaln

from workers.certify.exact import BOUND_FLOOR, _outcomes, certify_paired, score_z
from workers.certify.refute import (
    refute_bound,
    refute_critical_z,
    refute_p_value,
    refute_paired,
    refute_type_one_error,
)
from workers.certify.sequential import _carry, look_plan, refute_looks

BUDGETS = [0.01, 0.02, 0.05, 0.1]
ALPHAS = [0.025, 0.05]
SIZES = list(range(1, 61)) + [100, 150]


def nuisance(low: float, top: float, points: int = 2001) -> np.ndarray:
    """p_won from ``low`` to ``top``: uniform, and geometric towards both ends (where the tails bend fastest)."""
    near = np.geomspace(1e-9, 0.05, 60) * (top - low)
    return np.unique(np.clip(np.r_[np.linspace(low, top, points), low + near, top - near], low, top))


def trinomial_mass(n: int, lost: np.ndarray, won: np.ndarray, p_lost: np.ndarray, p_won: np.ndarray) -> np.ndarray:
    """sum over the outcomes (lost, won) of their trinomial probability, for each (p_lost, p_won) pair."""
    ties = n - lost - won
    log_choose = gammaln(n + 1.0) - gammaln(lost + 1.0) - gammaln(won + 1.0) - gammaln(ties + 1.0)
    p_tie = np.clip(1.0 - p_lost - p_won, 0.0, 1.0)

    def term(count: np.ndarray, p: np.ndarray) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(count[None, :] > 0, count[None, :] * np.log(p[:, None]), 0.0)

    return np.exp(log_choose[None, :] + term(lost, p_lost) + term(won, p_won) + term(ties, p_tie)).sum(axis=1)


def refuted_region(n: int, budget: float, alpha: float) -> tuple[np.ndarray, np.ndarray]:
    lost, won = _outcomes(n)
    region = score_z(lost, won, n, budget) >= refute_critical_z(n, budget, alpha)
    return lost[region], won[region]


def worst_level(n: int, budget: float, alpha: float, drop: float, points: int = 2001) -> tuple[float, float]:
    """The largest P(refuted | drop) over the nuisance, and the p_won where it is taken."""
    lost, won = refuted_region(n, budget, alpha)
    if not len(lost):
        return 0.0, math.nan
    grid = nuisance(max(0.0, -drop), (1.0 - drop) / 2.0, points)
    mass = trinomial_mass(n, lost, won, np.maximum(grid + drop, 0.0), grid)
    return float(mass.max()), float(grid[mass.argmax()])


def test_the_level_at_the_budget_is_at_most_alpha_at_every_n_by_enumeration():
    worst = {}
    for n in SIZES:
        for budget in BUDGETS:
            for alpha in ALPHAS:
                level, at = worst_level(n, budget, alpha, budget)
                assert level <= alpha + 1e-12, (
                    f"n={n}, b={budget}, alpha={alpha}: P(refuted | drop = b) = {level:.7f} at p_won = {at:.6f}")
                worst[alpha] = max(worst.get(alpha, 0.0), level)
    assert worst[0.05] > 0.049 and worst[0.025] > 0.024, ("the test spends its level somewhere", worst)


@pytest.mark.parametrize("n", [5, 20, 31, 60, 100])
def test_drops_below_the_budget_are_refuted_even_less_often(n):
    for budget in (0.02, 0.05, 0.1):
        for alpha in ALPHAS:
            for drop in (budget - 0.01, 0.0, -0.05, -0.2):
                level, at = worst_level(n, budget, alpha, drop, points=401)
                assert level <= alpha + 1e-12, (n, budget, alpha, drop, level, at)


@pytest.mark.parametrize("n,budget,drop", [(17, 0.05, 0.05), (40, 0.1, 0.1), (40, 0.1, 0.03), (25, 0.05, -0.1)])
def test_refute_type_one_error_is_the_sum_over_the_refuted_outcomes(n, budget, drop):
    grid = nuisance(max(0.0, -drop), (1.0 - drop) / 2.0, 21)
    lost, won = refuted_region(n, budget, 0.05)
    assert refute_type_one_error(n, budget, 0.05, grid, drop) == pytest.approx(
        trinomial_mass(n, lost, won, np.maximum(grid + drop, 0.0), grid), abs=1e-12)


@pytest.mark.parametrize("n,budget", [(6, 0.05), (12, 0.1), (31, 0.05), (20, 0.2)])
def test_refute_paired_decides_exactly_the_critical_region_and_never_with_certification(n, budget):
    z = refute_critical_z(n, budget, 0.05)
    refuted = 0
    for lost, won in zip(*_outcomes(n), strict=True):
        test = refute_paired(int(lost), int(won), n, budget, 0.05)
        assert test.refuted == (float(score_z(lost, won, n, budget)) >= z) == (test.p_value <= 0.05), (lost, won)
        assert not (test.refuted and certify_paired(int(lost), int(won), n, budget, 0.05).certified), (lost, won)
        refuted += test.refuted
    assert refuted > 0


def test_what_is_refuted_and_what_is_not():
    assert refute_paired(40, 2, 200, 0.05, 0.05).refuted, "a 19% observed drop shows more than 5%"
    assert not certify_paired(40, 2, 200, 0.05, 0.05).certified
    for n in (10, 100, 1000):
        assert not refute_paired(0, 0, n, 0.01, 0.05).refuted, "no item lost shows no drop"
        assert refute_p_value(0, 0, n, 0.01) > 0.99
    assert not refute_paired(3, 3, 100, 0.01, 0.05).refuted
    assert not refute_paired(2, 0, 100, 0.01, 0.05).refuted, "a 2% observed drop is not shown above 1% on 100 items"


@pytest.mark.parametrize("budget,alpha", [(0.05, 0.05), (0.1, 0.025), (0.01, 0.05)])
def test_too_few_items_refute_nothing(budget, alpha):
    """Every item lost is the largest Z_b, and P(all n lost | drop = b) reaches ((1 + b) / 2) ** n at the top of the
    nuisance range: nothing is refuted until that is at most alpha, and then the all-lost outcome is."""
    first = math.ceil(math.log(alpha) / math.log((1.0 + budget) / 2.0))
    for n in range(1, first):
        assert refute_critical_z(n, budget, alpha) > float(score_z(n, 0, n, budget)), n
    assert refute_paired(first, 0, first, budget, alpha).refuted
    assert refute_p_value(first, 0, first, budget) == pytest.approx(((1.0 + budget) / 2.0) ** first, rel=1e-6)


def test_the_reported_lower_bound_agrees_with_the_decision():
    """Every outcome: refuted exactly when the budget is at most the largest budget refuted (to the bisection's
    1e-4), where, as at this n, refutation is nested in b (no outcome of 10 or 20 items broke it on a 0.5% grid)."""
    n, budget = 12, 0.1
    for lost, won in zip(*_outcomes(n), strict=True):
        test = refute_paired(int(lost), int(won), n, budget, 0.05)
        if test.refuted:
            assert test.lower >= budget - 1e-4, (lost, won, test.lower)
        else:
            assert test.lower < budget, (lost, won, test.lower)
    assert refute_bound(0, 0, n, 0.05) == 0.0
    assert refute_paired(40, 2, 200, 0.05, 0.05).to_dict()["lower"] > 0.1 > BOUND_FLOOR


@pytest.mark.parametrize("lost,won,gap,again", [(18, 2, (0.147, 0.153), 0.155), (33, 11, (0.175, 0.18), 0.1825)])
def test_the_lower_bound_lies_below_every_budget_not_refuted(lost, won, gap, again):
    """Refutation is not nested in b: Z_b reorders the outcomes as b moves and the p-value jumps. Lost 18 / won 2
    of 60 is refuted at 14.5% and at 15.5%, not at 14.7-15.3%; a bisection alone put the bound at 14.69%, below the
    gap by luck. The bound is now below the first budget not refuted, and every budget below it (a 3e-4 grid, 0.1
    wide) is refuted."""
    n = 60
    assert refute_paired(lost, won, n, gap[0] - 0.002, 0.05).refuted
    assert not any(refute_paired(lost, won, n, b, 0.05).refuted for b in np.linspace(*gap, 5))
    assert refute_paired(lost, won, n, again, 0.05).refuted, "refuted again above the gap"
    bound = refute_bound(lost, won, n, 0.05)
    assert bound < gap[0]
    assert all(refute_paired(lost, won, n, bound - k * 3e-4, 0.05).refuted for k in range(334) if bound - k * 3e-4 > 1e-4)


def _refuted_through_looks(plan, budget: float, p_won: float, drop: float) -> float:
    """P(refuted at some look), each look refuting Z_b >= refute_critical_z at the alpha it spends: the (lost, won)
    distribution of the runs not yet refuted is carried from look to look."""
    state, refuted, prev = np.ones((1, 1)), 0.0, 0
    for n, share in zip(plan.sizes, plan.shares, strict=True):
        state = _carry(state, n - prev, p_won + drop, p_won, n)
        lost, won = np.meshgrid(np.arange(n + 1), np.arange(n + 1), indexing="ij")
        valid = lost + won <= n
        z = np.where(valid, score_z(lost, np.where(valid, won, 0), n, budget), -np.inf)
        passed = z >= refute_critical_z(n, budget, share)
        refuted += float(state[passed].sum())
        state = np.where(passed, 0.0, state)
        prev = n
    return refuted


@pytest.mark.parametrize("n,budget,calibrated", [(30, 0.05, False), (60, 0.05, True), (60, 0.1, False)])
def test_the_union_bound_over_looks_holds_the_level_by_enumeration(n, budget, calibrated):
    alpha = 0.05
    plan = look_plan(n, 3, alpha, budget=budget if calibrated else None)
    assert len(plan.sizes) == 3 and sum(plan.shares) == pytest.approx(alpha)
    for drop in (budget, budget - 0.03):
        grid = nuisance(max(0.0, -drop), (1.0 - drop) / 2.0, 201)
        worst = max(_refuted_through_looks(plan, budget, float(pw), drop) for pw in grid)
        assert worst <= alpha + 1e-12, (n, budget, drop, worst)


def test_refute_looks_refutes_at_the_first_look_in_its_region():
    budget, alpha = 0.1, 0.05
    plan = look_plan(24, 3, alpha)
    crit = [refute_critical_z(n, budget, s) for n, s in zip(plan.sizes, plan.shares, strict=True)]
    rng = np.random.default_rng(3)
    for _ in range(300):
        p_won = rng.uniform(0.0, 0.2)
        p_lost = rng.uniform(0.0, 0.6)
        steps = rng.choice(3, size=plan.n, p=[p_lost, p_won, 1.0 - p_lost - p_won])
        counts = [(int((steps[:n] == 0).sum()), int((steps[:n] == 1).sum())) for n in plan.sizes]
        reached = int(rng.integers(0, 4))
        got = refute_looks(counts[:reached], plan, budget)
        first = next((k + 1 for k, ((lo, wo), n) in enumerate(zip(counts[:reached], plan.sizes, strict=False))
                      if float(score_z(lo, wo, n, budget)) >= crit[k]), None)
        assert got.refuted == (first is not None) and got.looks == 3, (counts, reached, got)
        assert got.look == (first if first is not None else reached)
        if first is not None:
            assert got.tests[-1].refuted and got.tests[-1].alpha == pytest.approx(plan.shares[first - 1])
    assert refute_looks([(8, 0), (16, 0), (20, 0)], plan, budget).look == 2, "8 of 8 lost is not enough at 0.56%"
    assert refute_looks([], plan, budget).to_dict() == {"refuted": False, "look": 0, "looks": 3, "tests": []}


@pytest.mark.parametrize("call,message", [
    (lambda: refute_paired(-1, 0, 10, 0.05, 0.05), "0 <= lost + won <= n"),
    (lambda: refute_paired(0, -2, 10, 0.05, 0.05), "0 <= lost + won <= n"),
    (lambda: refute_paired(6, 5, 10, 0.05, 0.05), "lost + won <= n"),
    (lambda: refute_paired(0, 0, 0, 0.05, 0.05), "n >= 1"),
    (lambda: refute_paired(0, 0, 10, 0.0, 0.05), "budget must be in (0, 1)"),
    (lambda: refute_paired(0, 0, 10, 1.0, 0.05), "budget must be in (0, 1)"),
    (lambda: refute_paired(0, 0, 10, 0.05, 0.0), "alpha must be in (0, 1)"),
    (lambda: refute_paired(0, 0, 10, 0.05, 1.0), "alpha must be in (0, 1)"),
    (lambda: refute_p_value(0, 0, 10, -0.1), "budget must be in (0, 1)"),
    (lambda: refute_critical_z(10, 0.05, 1.5), "alpha must be in (0, 1)"),
    (lambda: refute_type_one_error(10, 0.05, 0.05, [0.6]), "p_won must lie in"),
    (lambda: refute_looks([(1, 0)] * 4, look_plan(30, 3, 0.05), 0.05), "for a plan of 3 looks"),
    (lambda: refute_looks([(3, 1), (2, 1)], look_plan(30, 3, 0.05), 0.05), "counts must accumulate"),
    (lambda: refute_looks([(3, 1), (14, 1)], look_plan(30, 3, 0.05), 0.05), "counts must accumulate"),
    (lambda: refute_looks([(-1, 0)], look_plan(30, 3, 0.05), 0.05), "0 <= lost + won <= n"),
    (lambda: refute_looks([], look_plan(30, 3, 0.05), 1.2), "budget must be in (0, 1)"),
])
def test_bad_input_names_the_problem(call, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        call()
