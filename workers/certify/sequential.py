"""Group-sequential confirmation: a few looks on the fixed item order, stopping early on success.

A confirmation of up to N items, in an order fixed before any outcome is seen, is looked at K times:
after the first n_1 < n_2 < ... < n_K = N items (``n_k = ceil(k N / K)``). At look k the exact test of
``workers.certify.exact`` runs on the first n_k items at level alpha_k, and the candidate is certified at
the first look that passes. The levels spend alpha along the power family ``alpha * (n_k / N) ** rho``
(Kim & DeMets; ``rho`` = 2 by default, between Pocock's flat and O'Brien-Fleming's late spending):

    alpha_k = alpha * ((n_k / N) ** rho - (n_{k-1} / N) ** rho),   sum_k alpha_k = alpha.

**Why the error stays <= alpha.** P(certified at some look | drop >= b) <= sum_k P(look k passes) <=
sum_k alpha_k = alpha (a union bound over looks, each an exact test valid at its n). It does not use the
looks' correlation, so it is conservative; the decision itself is ``decide.sequential_bound``; :func:`sequential_power` computes the procedure's exact
probability of certifying (joint enumeration over the looks), which the tests hold to alpha over the
nuisance and which shows how much the union bound gives away. One look (K = 1) is the fixed-n test.

A candidate may also stop for *futility* (``decide.prune_test``, anytime-valid): stopping to declare
failure only lowers the chance of certifying, so it keeps the error <= alpha.

Knows counts, budgets and alpha; nothing about records, trials or the sweep. numpy and scipy (imported
where used).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

RHO = 2.0  # power-family spending exponent
_CALIBRATION_GRID = 16  # x 4: the nuisance points calibration takes from ``exact``'s grid (both ends kept)
_CALIBRATION_CELLS = 25_000_000  # nuisance points x (N + 1)^2 states at most (memory): larger N, the union bound


@dataclass(frozen=True)
class LookPlan:
    """Where the looks fall, the alpha spent by each, and each look's nominal level."""

    sizes: tuple[int, ...]  # items at each look, increasing, the last = N
    alphas: tuple[float, ...]  # nominal level of each look's exact test (certify_paired at this level)
    alpha: float
    rho: float = RHO
    spent: tuple[float, ...] = ()  # the error spent by the end of each look: alpha * (n_k / N) ** rho
    budget: float | None = None  # the budget the levels were calibrated for (None: the union bound)

    @property
    def n(self) -> int:
        return self.sizes[-1]

    def to_dict(self) -> dict[str, Any]:
        how = ("exact: each look's level the largest whose cumulative P(certified) stays within the spent alpha "
               "over the nuisance" if self.budget is not None else "union bound over looks")
        return {"sizes": list(self.sizes), "alphas": list(self.alphas), "spent": list(self.spent),
                "alpha": self.alpha, "rho": self.rho, "budget": self.budget,
                "spending": f"alpha * t^{self.rho:g} (power family); {how}"}


def _sizes(n: int, looks: int, alpha: float, rho: float) -> tuple[tuple[int, ...], tuple[float, ...]]:
    if n < 1:
        raise ValueError(f"a confirmation needs n >= 1 items, got {n}")
    if looks < 1:
        raise ValueError(f"looks must be >= 1, got {looks}")
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    if not rho > 0:
        raise ValueError(f"rho must be > 0, got {rho}")
    sizes = sorted({math.ceil(k * n / looks) for k in range(1, looks + 1)})
    spent = [alpha * (s / n) ** rho for s in sizes]
    spent[-1] = alpha  # exactly alpha in all, whatever the rounding
    return tuple(sizes), tuple(spent)


def look_plan(n: int, looks: int, alpha: float, rho: float = RHO, budget: float | None = None) -> LookPlan:
    """K = ``looks`` looks over ``n`` items (fewer when n < K: every look adds at least one item).

    With ``budget``: each look's level is calibrated exactly (:func:`calibrate`), so the procedure's
    probability of certifying by look k is at most ``spent[k]`` at every nuisance value of the grid. Without:
    the union bound (level_k = spent_k - spent_{k-1}), valid for any budget but conservative. One look is
    the fixed-n test at ``alpha`` either way."""
    sizes, spent = _sizes(n, looks, alpha, rho)
    if len(sizes) == 1:
        return LookPlan(sizes, (float(alpha),), float(alpha), float(rho), spent, budget)
    if budget is not None and len(_calibration_grid(float(budget))) * (n + 1) ** 2 > _CALIBRATION_CELLS:
        budget = None  # too many states to carry here: the union bound (valid, more conservative)
    if budget is None:
        return LookPlan(sizes, (spent[0],) + tuple(b - a for a, b in zip(spent, spent[1:], strict=False)),
                        float(alpha), float(rho), spent, None)
    return LookPlan(sizes, calibrate(sizes, spent, float(budget)), float(alpha), float(rho), spent, float(budget))


def _state_z(n: int, budget: float) -> Any:
    """Tango's Z_b at every (lost, won) of n items (+inf where lost + won > n), shape (n + 1, n + 1)."""
    import numpy as np

    from workers.certify.exact import score_z

    lost, won = np.meshgrid(np.arange(n + 1), np.arange(n + 1), indexing="ij")
    valid = lost + won <= n
    return np.where(valid, score_z(lost, np.where(valid, won, 0), n, budget), np.inf)


def _calibration_grid(budget: float) -> Any:
    """A thinner copy of ``exact``'s nuisance grid (its first and last points kept)."""
    import numpy as np

    from workers.certify.exact import _nuisance_grid

    grid = _nuisance_grid(budget)
    step = max(1, len(grid) // (4 * _CALIBRATION_GRID))
    return np.unique(np.concatenate([grid[::step], grid[:3], grid[-3:]]))


@functools.lru_cache(maxsize=256)
def calibrate(sizes: tuple[int, ...], spent: tuple[float, ...], budget: float) -> tuple[float, ...]:
    """Nominal levels a_1..a_K for looks at ``sizes``: look k certifies when the exact test on the first n_k
    items has p <= a_k (Z_b <= z_k), each z_k the largest attainable value with

        max over the nuisance grid of P(certified at some look <= k | drop = budget) <= spent[k],

    computed exactly by carrying the distribution of (lost, won) of the candidates not yet certified from
    look to look (a 2-D convolution with the trinomial of the new items). Uses the looks' correlation,
    so the levels are larger than the union bound's and more candidates stop early at the same error."""
    import numpy as np
    from scipy.signal import fftconvolve

    from workers.certify.exact import _sup_tail

    grid = _calibration_grid(budget)
    states = [np.ones((1, 1)) for _ in grid]
    crossed = np.zeros(len(grid))
    levels, prev = [], 0
    for n, target in zip(sizes, spent, strict=True):
        z = _state_z(n, budget).ravel()
        order = np.argsort(z, kind="stable")
        zs = z[order]
        finite = np.isfinite(zs)
        ends = np.flatnonzero(np.r_[zs[1:] != zs[:-1], True] & finite)  # last index of each distinct finite Z
        best = len(ends) - 1
        grown = []
        for i, pw in enumerate(grid):
            state = np.clip(fftconvolve(states[i], _kernel(n - prev, pw + budget, pw)), 0.0, None)[: n + 1, : n + 1]
            grown.append(state)
            cum = np.cumsum(state.ravel()[order])[ends]
            # the largest group index j with crossed + cum[j] <= target (cum is nondecreasing)
            j = int(np.searchsorted(cum, target - crossed[i] + 1e-15, side="right")) - 1
            best = min(best, j)
        if best < 0:
            z_k = -np.inf  # nothing can be certified at this look within its spending
        else:
            z_k = float(zs[ends[best]])
        passed = _state_z(n, budget) <= z_k
        for i, state in enumerate(grown):
            crossed[i] += float(state[passed].sum())
            states[i] = np.where(passed, 0.0, state)
        levels.append(1e-12 if best < 0 else min(1.0, _sup_tail(n, budget, z_k)))  # 1e-12: nothing passes
        prev = n
    return tuple(levels)


def _kernel(m: int, p_lost: float, p_won: float) -> Any:
    """Trinomial pmf of (lost, won) over m items, as an (m + 1) x (m + 1) array (0 where lost + won > m)."""
    import numpy as np
    from scipy.special import gammaln, xlogy

    a, c = np.meshgrid(np.arange(m + 1), np.arange(m + 1), indexing="ij")
    t = m - a - c
    ok = t >= 0
    t = np.where(ok, t, 0)
    p_tie = max(0.0, 1.0 - p_lost - p_won)
    logp = (gammaln(m + 1.0) - gammaln(a + 1.0) - gammaln(c + 1.0) - gammaln(t + 1.0)
            + xlogy(a, p_lost) + xlogy(c, p_won) + (xlogy(t, p_tie) if p_tie > 0 else np.where(t > 0, -np.inf, 0.0)))
    return np.where(ok, np.exp(logp), 0.0)


def sequential_power(plan: LookPlan, budget: float, discordance: float, drop: float = 0.0) -> tuple[float, float]:
    """(P(certified at some look), expected items used) when the true discordance and drop are these, by
    exact enumeration of (lost, won) through the looks (a candidate stops at the look that certifies it;
    futility stops are not modelled: they only lower both figures). At drop = ``budget`` the first figure is
    the procedure's type-I error at that nuisance (the tests hold it to alpha)."""
    import numpy as np
    from scipy.signal import fftconvolve

    from workers.certify.exact import critical_z, score_z

    if not 0.0 <= abs(drop) <= discordance <= 1.0:
        raise ValueError(f"need |drop| <= discordance <= 1, got drop={drop}, discordance={discordance}")
    p_lost, p_won = (discordance + drop) / 2.0, (discordance - drop) / 2.0
    state = np.ones((1, 1))  # P(lost, won) among the candidates still running
    power, expected, prev = 0.0, 0.0, 0
    for n, a in zip(plan.sizes, plan.alphas, strict=True):
        state = np.clip(fftconvolve(state, _kernel(n - prev, p_lost, p_won)), 0.0, None)[: n + 1, : n + 1]
        lost, won = np.meshgrid(np.arange(n + 1), np.arange(n + 1), indexing="ij")
        valid = lost + won <= n
        z = critical_z(n, budget, a)
        passed = valid & (score_z(lost, np.where(valid, won, 0), n, budget) <= z)
        stop = float(state[passed].sum())
        power += stop
        expected += stop * n
        state = np.where(passed, 0.0, state)
        prev = n
    expected += float(state.sum()) * plan.n
    return min(power, 1.0), expected


def sequential_plan(discordance: float, budget: float, looks: int, drop: float = 0.0, alpha: float = 0.05,
                    power: float = 0.8, rho: float = RHO, most: int = 20_000) -> tuple[LookPlan, float, float] | None:
    """The smallest N (on a 10% grid from 0.8x the fixed-n plan) whose K-look design, calibrated for
    ``budget``, reaches ``power`` at this discordance and drop: (its plan, its power, its expected items).
    None when the drop is at or above the budget or no N up to ``most`` reaches it."""
    from workers.certify.exact import exact_plan

    if drop >= budget:
        return None
    fixed = exact_plan(discordance, budget, drop, alpha, power)
    if fixed is None:
        return None
    n = max(looks, int(fixed * 0.8))
    while n <= most:
        plan = look_plan(n, looks, alpha, rho, budget)
        got, expected = sequential_power(plan, budget, discordance, drop)
        if got >= power:
            return plan, got, expected
        n = int(n * 1.1) + 1
    return None
