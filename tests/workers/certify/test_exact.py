"""The exact test that decides right/wrong certificates: its type-I error is at most alpha at every n.

Nothing here is sampled: probabilities are sums over every (lost, won) outcome of n items, so a check
either holds or fails, with no Monte Carlo error. The n and budgets include the places where the old
decision (an exact bound up to n = 30, Tango's score bound above) certified too often: at n = 31 its
type-I error at the budget boundary was 0.055 / 0.057 / 0.068 (b = 5 / 10 / 20%;
`python -m jobs.bench.certify_level` prints it).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import multinomial

from workers.certify.decide import ALPHA, drop_bound_from_counts, fixed_sequence, items_needed
from workers.certify.exact import (
    _lost_limits,
    _outcomes,
    _tail,
    certify_paired,
    critical_z,
    exact_bound,
    exact_plan,
    exact_power,
    p_value,
    score_z,
    type_one_error,
)

BUDGETS = [0.01, 0.02, 0.05, 0.1, 0.2]


def brute_tail(n: int, budget: float, z: float, p_won: float, drop: float) -> float:
    """P(Z_b <= z) by summing the trinomial over every outcome (no conditioning, no windows)."""
    lost, won = _outcomes(n)
    region = score_z(lost, won, n, budget) <= z
    if not region.any():
        return 0.0
    counts = np.stack([lost[region], won[region], n - lost[region] - won[region]], axis=1)
    return float(multinomial.pmf(counts, n, [p_won + drop, p_won, max(0.0, 1.0 - 2 * p_won - drop)]).sum())


@pytest.mark.parametrize("n", [1, 7, 25, 60])
def test_the_conditional_tail_equals_the_trinomial_sum(n):
    rng = np.random.default_rng(n)
    for _ in range(12):
        budget = float(rng.choice(BUDGETS))
        z = float(rng.uniform(-4, 2))
        p_won = float(rng.uniform(0, (1 - budget) / 2))
        fast = float(_tail(n, budget, _lost_limits(n, budget, z), np.array([p_won]))[0])
        assert fast == pytest.approx(brute_tail(n, budget, z, p_won, budget), abs=1e-12), (n, budget, z, p_won)


@pytest.mark.parametrize("n", [5, 31, 300])
def test_the_score_rises_with_lost_at_every_discordant_count(n):
    """What lets the tail be one binomial CDF per discordant count."""
    for budget in BUDGETS:
        for m in range(n + 1):
            lost = np.arange(m + 1)
            assert np.all(np.diff(score_z(lost, m - lost, n, budget)) > 0), (n, budget, m)


@pytest.mark.slow
@pytest.mark.parametrize("n", [1, 5, 30, 31, 50, 100, 300])
def test_type_one_error_at_the_budget_is_at_most_alpha_over_the_whole_nuisance_range(n):
    for budget in BUDGETS:
        grid = np.linspace(0.0, (1 - budget) / 2, 20001)  # far denser than the test's own grid
        worst = type_one_error(n, budget, ALPHA, grid)
        assert worst.max() <= ALPHA + 1e-12, (
            f"n={n}, b={budget}: P(certified | drop = b) = {worst.max():.5f} > alpha at p_won = "
            f"{grid[worst.argmax()]:.5f} (exact sum over every outcome)")


@pytest.mark.parametrize("n,budget", [(128, 0.05), (261, 0.01)])
def test_the_level_holds_between_the_grid_points_too(n, budget):
    """A fixed nuisance grid missed the sup between its points: at n = 128 (5%) and n = 261 (1%) the level was
    0.0500046 and 0.0500088 (lost 11 / won 13 of 128 got p = 0.049997 and was certified). The sup is now refined
    in the cells around the grid's best points."""
    grid = np.linspace(0.0, (1 - budget) / 2, 20001)
    worst = type_one_error(n, budget, ALPHA, grid)
    assert worst.max() <= ALPHA + 1e-12, (n, budget, worst.max(), grid[worst.argmax()])
    if n == 128:
        test = certify_paired(11, 13, 128, 0.05, ALPHA)
        assert test.p_value > ALPHA and not test.certified, test


@pytest.mark.parametrize("n", [5, 31, 50])
def test_larger_drops_are_certified_even_less_often(n):
    for budget in (0.05, 0.2):
        for drop in (budget + 0.01, budget + 0.05, min(budget + 0.3, 0.9)):
            grid = np.linspace(0.0, (1 - drop) / 2, 41)
            worst = type_one_error(n, budget, ALPHA, grid, drop=drop)
            assert worst.max() <= ALPHA + 1e-12, (n, budget, drop, worst.max())


@pytest.mark.parametrize("n,budget", [(5, 0.2), (31, 0.05), (31, 0.1)])
def test_certify_paired_decides_exactly_the_critical_region(n, budget):
    z = critical_z(n, budget, ALPHA)
    for lost, won in zip(*_outcomes(n), strict=True):
        test = certify_paired(int(lost), int(won), n, budget, ALPHA)
        assert test.certified == (float(score_z(lost, won, n, budget)) <= z), (lost, won)
        assert test.certified == (test.p_value <= ALPHA)


@pytest.mark.parametrize("n,budget", [(12, 0.1), (20, 0.2)])
def test_the_reported_bound_agrees_with_the_decision(n, budget):
    for lost, won in zip(*_outcomes(n), strict=True):
        test = certify_paired(int(lost), int(won), n, budget, ALPHA)
        if not test.certified:
            assert test.bound > budget, (lost, won, test)
        elif lost + won <= n / 2:  # nested at discordance <= 50%: certified exactly above the bound
            assert test.bound <= budget + 1e-4, (lost, won, test)


@pytest.mark.parametrize("lost,won,n,gap", [(30, 38, 120, (0.0511, 0.0520)), (10, 17, 31, (0.0591, 0.0620))])
def test_the_bound_is_the_smallest_budget_above_which_every_budget_is_certified(lost, won, n, gap):
    """Above 50% discordance the rejection region is not nested in b: lost 30 / won 38 of 120 is certified at 5%,
    not at 5.1-5.2%, and again above. The bound was 4.78% (a bisection), below budgets the test does not
    certify; it is now past the gap, and every budget above it (on a 3e-4 grid, 0.1 wide) is certified."""
    bound = exact_bound(lost, won, n, ALPHA)
    assert not certify_paired(lost, won, n, gap[0], ALPHA).certified and bound > gap[0]
    above = [bound + k * 3e-4 for k in range(1, 334)]
    assert all(certify_paired(lost, won, n, b, ALPHA).certified for b in above if b < 1)


def test_at_n_31_zero_discordance_no_longer_certifies_what_n_30_cannot():
    """The old decision switched at n = 30 -> 31 from an exact bound (0/0 lost/won: 0.0975) to Tango's
    (0.0803): a 9% budget was certified at n = 31 and not at n = 30. The exact test has no switch."""
    assert not certify_paired(0, 0, 30, 0.09, ALPHA).certified
    assert not certify_paired(0, 0, 31, 0.09, ALPHA).certified
    assert abs(exact_bound(0, 0, 30, ALPHA) - exact_bound(0, 0, 31, ALPHA)) < 0.005
    assert drop_bound_from_counts(0, 0, 31).method == "exact-unconditional"


def test_fixed_sequence_decides_with_the_exact_test_and_reports_its_p_value():
    bounds = {"a": drop_bound_from_counts(2, 1, 400), "b": drop_bound_from_counts(30, 2, 400)}
    from workers.certify.decide import Candidate

    cands = [Candidate("a", 1.2, 0.0, 0.01), Candidate("b", 1.5, 0.05, 0.08)]
    cert = fixed_sequence(cands, lambda c: bounds[c.key], 0.05)
    (key_a, tested_a, ok_a), (key_b, tested_b, ok_b) = cert.steps
    assert ok_a and not ok_b and cert.certified and cert.chosen.key == "a"
    assert tested_a.p_value == p_value(2, 1, 400, 0.05) <= ALPHA < tested_b.p_value
    assert tested_a.budget == 0.05 and "exact test p = " in cert.reason
    assert not math.isnan(tested_a.upper) and tested_a.upper <= 0.05


@pytest.mark.parametrize("call,message", [
    (lambda: certify_paired(3, 2, 4, 0.05, ALPHA), "lost + won <= n"),
    (lambda: certify_paired(0, 0, 0, 0.05, ALPHA), "n >= 1"),
    (lambda: certify_paired(0, 0, 10, 0.0, ALPHA), "budget must be in (0, 1)"),
    (lambda: certify_paired(0, 0, 10, 0.05, 1.5), "alpha must be in (0, 1)"),
])
def test_bad_input_names_the_problem(call, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        call()


@pytest.mark.parametrize("n,discordance,drop", [(12, 0.3, 0.0), (40, 0.1, 0.02), (40, 0.2, -0.05)])
def test_exact_power_is_the_sum_over_the_certified_outcomes(n, discordance, drop):
    budget = 0.2
    z = critical_z(n, budget, ALPHA)
    p_won = (discordance - drop) / 2
    assert exact_power(n, budget, ALPHA, discordance, drop) == pytest.approx(
        brute_tail(n, budget, z, p_won, drop), abs=1e-12)


def test_the_normal_plan_under_plans_and_the_exact_plan_does_not():
    """At d = 0.05, b = 5% the normal approximation's n certifies with 67% power, not the 80% it states."""
    normal = items_needed(0.05, 0.05)
    assert exact_power(normal, 0.05, ALPHA, 0.05) < 0.7
    n = exact_plan(0.05, 0.05)
    assert exact_power(n, 0.05, ALPHA, 0.05) >= 0.8 > exact_power(n - 1, 0.05, ALPHA, 0.05)


@pytest.mark.slow
def test_the_plan_is_the_smallest_n_that_reaches_the_power_scanning_up_from_below():
    """Exact power is not monotone in n: a bisection said 271 at discordance 0.1, 5%, where n = 265 already
    reaches 80%. The plan is the first n that passes, scanning up from a floor whose power is clearly short."""
    n = exact_plan(0.1, 0.05)
    assert n <= 265 and exact_power(n, 0.05, ALPHA, 0.1) >= 0.8
    assert all(exact_power(k, 0.05, ALPHA, 0.1) < 0.8 for k in range(int(0.8 * n), n))
