"""Refutation: the exact test of ``workers.certify.exact`` the other way round, H0: drop <= b against H1: drop > b.

The same counts, the same Tango score Z_b at drop = b, the other tail: a budget is refuted when the largest
probability over the nuisance p_won, at drop = b, of an outcome with Z_b at least the observed one is <= alpha
(outcomes within a relative 1e-12 below it count too: floating-point near-ties). Drops below b make large Z_b
rarer still (Z_b rises with each loss and falls with each win), so the sup at the boundary is the sup over H0;
``tests/workers/certify/test_refute.py`` enumerates the level at every n up to 60 and beyond, and at drops below
b. A budget is never both certified and refuted at alpha < 1/2. The region is not nested in b (n = 60, 18 lost /
2 won: refuted at 14.5%, not at 14.7-15.3%, again at 15.4%), so the reported bound scans like ``exact_bound``.
The verdict a confirmation gives (looks, the betting half, what it reads) is ``workers.certify.verdict``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

from workers.certify.exact import (
    _NEST_POINTS,
    _NEST_STEP,
    BOUND_FLOOR,
    METHOD,
    _check,
    _lost_limits,
    _outcomes,
    _sup_tail,
    _sup_tails,
    _tail,
    score_z,
)

_SCAN_BATCH = 50  # refute_bound's scan: budgets whose p-values are computed together


@dataclass(frozen=True)
class RefuteTest:
    """A budget tested the other way on paired right/wrong outcomes: is the drop shown *above* it?"""

    refuted: bool  # p_value <= alpha
    p_value: float  # sup over the nuisance of P(Z_b >= the observed | drop = budget)
    budget: float
    alpha: float
    lost: int
    won: int
    n: int
    method: str = METHOD

    @functools.cached_property
    def lower(self) -> float:
        """The largest budget this test would refute on these counts, every budget from BOUND_FLOOR up to it
        refuted (0.0 when not even BOUND_FLOOR is; a description, computed on first use)."""
        return refute_bound(self.lost, self.won, self.n, self.alpha)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "lower": self.lower}


@functools.lru_cache(maxsize=65536)
def refute_p_value(lost: int, won: int, n: int, budget: float) -> float:
    """The exact unconditional p-value of H0': drop <= ``budget`` (refutation: large Z_b is the evidence)."""
    _check(lost, won, n, budget)
    return _sup_tail(n, budget, float(score_z(lost, won, n, budget)), upper=True)


def refute_paired(lost: int, won: int, n: int, budget: float, alpha: float) -> RefuteTest:
    """Is the paired drop above ``budget``, with confidence 1 - ``alpha``? The mirror of :func:`certify_paired`
    (the same counts, the same Z_b, the other tail): refuted when sup over the nuisance of P(Z_b >= z_obs | drop =
    budget) <= alpha. A budget is never both certified and refuted at alpha < 1/2: the two tails of one outcome
    overlap at its own mass, so at every nuisance value the two tails add to at least 1."""
    _check(lost, won, n, budget, alpha)
    p = refute_p_value(int(lost), int(won), int(n), float(budget))
    return RefuteTest(p <= alpha, p, float(budget), float(alpha), int(lost), int(won), int(n))


@functools.lru_cache(maxsize=16384)
def refute_bound(lost: int, won: int, n: int, alpha: float) -> float:
    """The largest budget b' such that :func:`refute_paired` refutes every budget in [BOUND_FLOOR, b'], to 1e-4
    (0.0 when BOUND_FLOOR is not refuted: no positive drop is shown). Refutation is not nested in b, at low
    discordance too: as b moves, Z_b reorders the outcomes and the p-value jumps (n = 60, lost 18 / won 2: refuted
    at 14.5%, not at 14.7-15.3%, again at 15.4-15.5%). So a bisection finds a budget refuted with one above it not,
    the budgets up to 0.1 below are scanned on a 5e-4 grid, and the bisection restarts below the first one not
    refuted until the scan finds none. A budget refuted by the test may lie above the bound (the decision is
    always the test at the budget); costs up to a few hundred p-values, computed on first use."""
    _check(lost, won, n, 0.5, alpha)
    if refute_p_value(lost, won, n, BOUND_FLOOR) > alpha:
        return 0.0
    hi = 1.0  # not refuted (a drop above 1 is never shown)
    while True:
        lo = _bisect_refute(lost, won, n, alpha, BOUND_FLOOR, hi)
        grid = [round(lo - k * _NEST_STEP, 12) for k in range(_NEST_POINTS, 0, -1) if lo - k * _NEST_STEP > BOUND_FLOOR]
        failing = next((b for b, p in zip(grid, _refute_p_values(lost, won, n, grid), strict=True) if p > alpha), None)
        if failing is None:
            return lo
        hi = failing


def _refute_p_values(lost: int, won: int, n: int, budgets: list[float]) -> Iterator[float]:
    """:func:`refute_p_value` at each of ``budgets`` in order, bit for bit, computed a batch at a time
    (``exact._sup_tails``): the scan stops at the first budget not refuted, so it never computes far past it."""
    for start in range(0, len(budgets), _SCAN_BATCH):
        part = budgets[start:start + _SCAN_BATCH]
        yield from (float(p) for p in _sup_tails(n, part, [float(score_z(lost, won, n, b)) for b in part], upper=True))


def _bisect_refute(lost: int, won: int, n: int, alpha: float, lo: float, hi: float) -> float:
    """Bisection to 1e-4 between a budget ``lo`` the test refutes and ``hi`` (not refuted)."""
    while hi - lo > 1e-4:
        mid = (lo + hi) / 2.0
        if refute_p_value(lost, won, n, round(mid, 12)) <= alpha:
            lo = mid
        else:
            hi = mid
    return lo


_LAST_REFUTE_CRITICAL: dict[tuple[float, float], float] = {}  # (budget, alpha) -> the last first-refuted value


@functools.lru_cache(maxsize=1024)
def refute_critical_z(n: int, budget: float, alpha: float) -> float:
    """A z with refutation p-value <= alpha at every attainable Z_b from it up and above alpha at the one before:
    :func:`refute_paired` refutes exactly the outcomes with Z_b >= refute_critical_z (none, where it lies above
    every attainable Z_b). A binary search over the attainable values of Z_b (the sup of the upper tail is
    nonincreasing in z), returning the midpoint between the last value not refuted and the first refuted."""
    import numpy as np

    _check(0, 0, n, budget, alpha)
    values = np.unique(score_z(*_outcomes(n), n, budget))

    def refuted(i: int) -> bool:
        return _sup_tail(n, budget, float(values[i]), upper=True) <= alpha

    lo, hi = -1, len(values)  # values[lo] is not refuted (lo = -1: none), values[hi] is (hi = len: none is)
    hint = _LAST_REFUTE_CRITICAL.get((budget, alpha))
    if hint is not None:  # the critical value at a nearby n (a scan over n): gallop out from it
        i = int(np.clip(np.searchsorted(values, hint), 0, len(values) - 1))
        step = 1
        if refuted(i):
            hi = i
            while hi - step >= 0 and refuted(hi - step):
                hi, step = hi - step, step * 2
            lo = max(-1, hi - step)
        else:
            lo = i
            while lo + step < len(values) and not refuted(lo + step):
                lo, step = lo + step, step * 2
            hi = min(len(values), lo + step)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if refuted(mid):
            hi = mid
        else:
            lo = mid
    if hi < len(values):
        _LAST_REFUTE_CRITICAL[(budget, alpha)] = float(values[hi])
    if hi >= len(values):
        return float(values[-1]) + 1.0
    if lo < 0:
        return float(values[0]) - 1.0
    return float((values[lo] + values[hi]) / 2.0)


def refute_type_one_error(n: int, budget: float, alpha: float, p_won: Any, drop: float | None = None) -> Any:
    """P(refuted) for each nuisance value in ``p_won`` when the true drop is ``drop`` (default: the budget, where
    H0' is hardest to keep): the probability of Z_b >= :func:`refute_critical_z`, what the tests hold to alpha.
    At drop = budget through the conditional tail; otherwise summed over every outcome's trinomial mass."""
    import numpy as np

    drop = budget if drop is None else drop
    z = refute_critical_z(n, budget, alpha)
    p_won = np.atleast_1d(np.asarray(p_won, dtype=np.float64))
    if np.any(p_won < max(0.0, -drop) - 1e-15) or np.any(2.0 * p_won + drop > 1.0 + 1e-15):
        raise ValueError(f"p_won must lie in [max(0, -drop), (1 - drop) / 2] at drop={drop}")
    if drop == budget:
        return _tail(n, budget, _lost_limits(n, budget, z, upper=True), p_won, upper=True)
    from scipy.stats import multinomial

    lost, won = _outcomes(n)
    region = score_z(lost, won, n, budget) >= z
    counts = np.stack([lost[region], won[region], n - lost[region] - won[region]], axis=1)
    return np.array([float(multinomial.pmf(counts, n, [max(0.0, pw + drop), pw, max(0.0, 1.0 - 2.0 * pw - drop)]
                                           ).sum()) for pw in p_won])
