"""The decision of a right/wrong certificate: an exact unconditional test that the paired drop is below b.

n paired items, each *lost* (the reference right, the candidate wrong; probability p_lost), *won* (the
reverse; p_won) or tied. The drop is p_lost - p_won. A budget b is certified when the test of

    H0: drop >= b   (the candidate is at least b worse than the reference)   vs   H1: drop < b

rejects H0 at level alpha. :func:`certify_paired` is the one public door: decision, p-value, bound
(``workers.certify.refute.refute_paired``, its mirror, for the opposite claim).

- **Order.** Outcomes are ordered by Tango's (1998) score statistic at drop = b,
  ``Z_b = (lost - won - n b) / sqrt(n (2 p~ + b - b^2))`` with p~ the maximum-likelihood p_won under
  drop = b: a small Z_b is evidence of a small drop. It weighs a difference by the discordance, so
  a candidate that rarely disagrees with the reference is certified on far fewer items than by the
  plain difference lost - won.
- **p-value.** The largest probability, over the nuisance p_won in [0, (1 - b) / 2] at drop = b, of an
  outcome at least as extreme: ``sup P(Z_b <= z_obs)``. Exact (Barnard/Suissa-Shuster style), valid at
  every n: no normal approximation, no switch between methods. Drops above b make small Z_b rarer still
  (``tests/workers/certify/test_exact.py`` enumerates both). Computed by conditioning on the discordant
  count m ~ Binomial(n, 2 p_won + b): given m, lost ~ Binomial(m, (p_won + b) / (2 p_won + b)), and Z_b
  rises with lost, so {Z_b <= z} given m is {lost <= l*(m)}: one binomial CDF per m, over the m that
  carry mass. The sup is taken on a fixed grid of the nuisance (uniform, and geometric towards both ends,
  where the tail bends fastest); the tests hold the type-I error to alpha on a 20,001-point grid.
- **Bound.** The same test inverted: the smallest budget it would certify (bisection to 1e-4; never
  below 1e-4, where the statistic degenerates). A description that agrees with the decision, not a
  second decision.
- **Refutation** (``workers.certify.refute``), the mirror: a budget is *refuted* when the test of
  H0': drop <= b vs H1': drop > b rejects at alpha, so a verdict is certified, refuted or undecided. The
  same Z_b, the other tail: large Z_b is evidence of a large drop, and the p-value is
  ``sup P(Z_b >= z_obs)`` over the same nuisance range at drop = b, the same grid and refinement (given m,
  {Z_b >= z} is {lost > l(m)}: one binomial complement per m). Drops below b make large Z_b rarer still
  (Z_b rises with lost and falls with won, and every (p_lost, p_won) with drop <= b is coupled to one at
  drop = b with as many lost or more and as many won or fewer); ``tests/workers/certify/test_refute.py``
  enumerates both, at every n up to 60 and a few above. The two verdicts exclude each other at alpha < 1/2
  (an outcome lies in both of its own tails). ``refute_bound``, the largest budget below which every
  budget is refuted, describes it (refutation is not nested in b: a scan, not a bisection alone).

Knows counts, budgets and alpha; nothing about records, trials or the sweep. numpy and scipy's binomial
functions (imported where used).
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from typing import Any

METHOD = "exact-unconditional"
BOUND_FLOOR = 1e-4  # the smallest budget the bound reports (Z_b degenerates at b = 0)
_REFINE_CELLS, _REFINE_STEPS = 6, 24  # the sup is refined around the 6 best grid points, 24 golden-section steps
_NEST_STEP, _NEST_POINTS = 5e-4, 200  # the bounds' scans: budgets above (certify, above 50% discordance), below (refute)
_TIE = 1e-12  # relative: refutation's tail takes in outcomes this close below z (floating-point near-ties)
_GRID = 96  # nuisance points: 2 x _GRID uniform, _GRID geometric towards each end
_SD, _PAD = 8.0, 12.0  # discordant counts kept: mean +- (8 sd + 12); the +12 covers skewed, Poisson-like
# binomials (s near 0 or 1), whose tails a normal sd underrates: the mass left out is < 1e-14 either way


@dataclass(frozen=True)
class PairedTest:
    """A budget tested on paired right/wrong outcomes."""

    certified: bool  # p_value <= alpha
    p_value: float  # sup over the nuisance of P(an outcome at least as extreme | drop = budget)
    budget: float
    alpha: float
    lost: int
    won: int
    n: int
    method: str = METHOD

    @functools.cached_property
    def bound(self) -> float:
        """The smallest budget this test would certify on these counts (a description; computed on first use)."""
        return exact_bound(self.lost, self.won, self.n, self.alpha)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "bound": self.bound}


def _check(lost: int, won: int, n: int, budget: float, alpha: float | None = None) -> None:
    if min(lost, won, n) < 0 or lost + won > n or n < 1:
        raise ValueError(f"counts must satisfy 0 <= lost + won <= n and n >= 1, got lost={lost}, won={won}, n={n}")
    if not 0.0 < budget < 1.0:
        raise ValueError(f"budget must be in (0, 1), got {budget}")
    if alpha is not None and not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")


def score_z(lost: Any, won: Any, n: int, budget: float) -> Any:
    """Tango's score statistic at drop = ``budget`` (arrays broadcast): small = evidence of a small drop."""
    return _score(lost, won, n, float(budget))


def _score(lost: Any, won: Any, n: int, b: Any) -> Any:
    """:func:`score_z` with ``b`` a float or an array of budgets broadcast against the counts."""
    import numpy as np

    lost, won = np.asarray(lost, dtype=np.float64), np.asarray(won, dtype=np.float64)
    ties = n - lost - won
    half = lost * (1.0 - b) + won * (1.0 - 3.0 * b) - 2.0 * ties * b
    p_won = (half + np.sqrt(half * half + 8.0 * n * won * b * (1.0 - b))) / (4.0 * n)
    return (lost - won - n * b) / np.sqrt(n * (2.0 * p_won + b - b * b))


def _lost_limits(n: int, budget: float, z: float, upper: bool = False) -> Any:
    """For every discordant count m = 0..n, the largest lost in [0, m] with Z_b(lost, m - lost) <= z (``upper``:
    < z, the last lost outside the upper tail), or -1. Z_b rises with lost at fixed m (checked in the tests), so a
    vectorised bisection over lost finds it."""
    return _lost_limits_many(n, [budget], [z], upper)[0]


def _lost_limits_many(n: int, budgets: Any, zs: Any, upper: bool = False) -> Any:
    """:func:`_lost_limits` for B (budget, z) pairs at once: row i is ``_lost_limits(n, budgets[i], zs[i])``."""
    import numpy as np

    b = np.asarray(budgets, dtype=np.float64)[:, None]
    z = np.asarray(zs, dtype=np.float64)[:, None]
    m = np.arange(n + 1)
    lo = np.full((len(b), n + 1), -1)  # Z at lo is <= z (lo = -1: none yet)
    hi = np.broadcast_to(m + 1, lo.shape)  # Z at hi is > z (hi = m + 1: past the end)
    while True:
        open_ = hi - lo > 1
        if not open_.any():
            return lo
        mid = (lo + hi) // 2
        lost = np.maximum(mid, 0)
        score = _score(lost, m - lost, n, b)
        below = score < z if upper else score <= z
        lo = np.where(open_ & below, mid, lo)
        hi = np.where(open_ & ~below, mid, hi)


def _tail(n: int, budget: float, limits: Any, p_won: Any, drop: float | None = None, upper: bool = False) -> Any:
    """P(Z_b <= z) for each nuisance value in ``p_won`` when the true drop is ``drop`` (default: the budget);
    ``limits`` from :func:`_lost_limits`. ``upper``: P(Z_b >= z) instead, with ``limits`` from
    ``_lost_limits(..., upper=True)``: given m, P(lost > limit(m)), the binomial's complement (``bdtrc``, exact
    in the far tail where 1 - bdtr would cancel). One row of :func:`_tails`."""
    import numpy as np

    p_won = np.asarray(p_won, dtype=np.float64)
    drop = budget if drop is None else drop
    return _tails(n, np.asarray(limits)[None, :], p_won.reshape(1, -1), np.array([float(drop)]), upper)[0]


def _tails(n: int, limits: Any, p_won: Any, drop: Any, upper: bool = False) -> Any:
    """:func:`_tail` for B budgets at once: row i is ``_tail(n, ., limits[i], p_won[i], drop[i], upper)``, bit for
    bit (each row is summed over its own window width, as it alone would be). The bound's scans and the sup's
    refinement ask for hundreds of budgets' tails on a few nuisance values each: one call for all of them spends
    the numpy calls once (log C(n, m) from a table per n; np.minimum/np.maximum for clip)."""
    import numpy as np
    from scipy.special import bdtr, bdtrc, xlog1py, xlogy

    drop = np.asarray(drop, dtype=np.float64)[:, None]
    disc = np.minimum(np.maximum(2.0 * p_won + drop, 0.0), 1.0)  # P(discordant)
    share = np.minimum(np.maximum((p_won + drop) / np.where(disc > 0, disc, 1.0), 0.0), 1.0)  # P(lost | discordant)
    sd = np.sqrt(n * disc * (1.0 - disc))
    first = np.minimum(np.maximum(np.floor(n * disc - _SD * sd - _PAD), 0), n).astype(np.int64)
    last = np.minimum(np.maximum(np.ceil(n * disc + _SD * sd + _PAD), 0), n).astype(np.int64)
    widths = (last - first).max(axis=1) + 1  # each budget's window, as its own call would take it
    width = int(widths.max())
    m = first[:, :, None] + np.arange(width)
    inside = m <= last[:, :, None]
    m = np.minimum(m, n)
    s = disc[:, :, None]  # Binomial(n, s) pmf at m, through logs (scipy.stats' pmf costs 10x more here)
    mass = np.exp(_log_choose(n)[m] + xlogy(m, s) + xlog1py(n - m, -s)) * inside
    limit = limits[np.arange(len(m))[:, None, None], m]
    # The binomial CDF only where it is neither 0 nor 1 and has mass: limit < 0 gives 0 (upper: 1), limit = m
    # gives exactly 1 (upper: 0; scipy returns those exactly), and mass 0 (outside the window, or underflow)
    # multiplies any finite value to 0: bit for bit what evaluating it everywhere gives, with fewer
    # incomplete-beta calls, most of this function's time.
    part = (limit >= 0) & (limit < m) & (mass != 0.0)
    tail = np.where(limit < 0, 1.0 if upper else 0.0, 0.0 if upper else 1.0)
    tail[part] = (bdtrc if upper else bdtr)(limit[part], m[part], np.broadcast_to(share[:, :, None], m.shape)[part])
    terms = mass * tail
    if (widths == width).all():
        return terms.sum(axis=2)
    out = np.empty(disc.shape)
    for w in np.unique(widths):
        rows = widths == w
        out[rows] = np.ascontiguousarray(terms[rows][:, :, :w]).sum(axis=2)
    return out


@functools.lru_cache(maxsize=256)
def _log_choose(n: int) -> Any:
    """log C(n, m) for m = 0..n (the pmf's first factor in :func:`_tail`)."""
    import numpy as np
    from scipy.special import gammaln

    m = np.arange(n + 1)
    return gammaln(n + 1.0) - gammaln(m + 1.0) - gammaln(n - m + 1.0)


@functools.lru_cache(maxsize=4096)
def _nuisance_grid(budget: float) -> Any:
    """The nuisance values the sup is taken on (read-only: shared by every call at this budget)."""
    import numpy as np

    top = (1.0 - budget) / 2.0
    near = np.geomspace(1e-7, 0.5, _GRID)  # the tail bends fastest at either end of the range
    grid = np.unique(np.concatenate([np.linspace(0.0, top, 2 * _GRID), top * near, top * (1.0 - near)]))
    grid.flags.writeable = False
    return grid


def _refine(n: int, budgets: Any, limits: Any, grids: Any, values: Any, upper: bool = False) -> Any:
    """For each budget (row), the largest P(Z_b <= z) (``upper``: P(Z_b >= z)) in the cells around its best grid
    points: a golden-section search on each [grid[i - 1], grid[i + 1]] (all cells of all rows at once,
    ``_REFINE_STEPS`` steps: the cell shrinks to 1e-5 of its width). A fixed grid alone misses the sup between its
    points (n = 128 at 5%: 0.0500046 where alpha is 0.05), so the p-value is the larger of the grid's maximum and
    this."""
    import numpy as np

    best = np.stack([np.argsort(row)[-_REFINE_CELLS:] for row in values])
    last = grids.shape[1] - 1
    lo = np.take_along_axis(grids, np.clip(best - 1, 0, last), axis=1)
    hi = np.take_along_axis(grids, np.clip(best + 1, 0, last), axis=1)
    ratio = (np.sqrt(5.0) - 1.0) / 2.0
    a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
    fa, fb = _tails(n, limits, a, budgets, upper), _tails(n, limits, b, budgets, upper)
    top = np.maximum(fa.max(axis=1), fb.max(axis=1))
    for _ in range(_REFINE_STEPS):
        left = fa >= fb  # the max lies in [lo, b]: shrink from the right, else from the left
        hi, lo = np.where(left, b, hi), np.where(left, lo, a)
        b, fb = np.where(left, a, b), np.where(left, fa, fb)
        a = np.where(left, hi - ratio * (hi - lo), a)
        a, b = np.where(left, a, b), np.where(left, b, lo + ratio * (hi - lo))
        new = _tails(n, limits, np.where(left, a, b), budgets, upper)
        fa, fb = np.where(left, new, fb), np.where(left, fb, new)  # fb: already the old fa where left
        top = np.maximum(top, new.max(axis=1))
    return top


def _sup_tail(n: int, budget: float, z: float, upper: bool = False) -> float:
    """sup over the nuisance of P(Z_b <= z) at drop = budget: the fixed grid's maximum, refined in the cells
    around its best points (:func:`_refine`). Each nuisance value's tail is nondecreasing in z (the region only
    grows), so certified (p <= alpha) is exactly Z_b <= :func:`critical_z`.

    ``upper``: sup of P(Z_b >= z), the refutation's tail, nonincreasing in z (refuted is exactly Z_b >=
    ``refute.refute_critical_z``). Outcomes within ``_TIE`` (relative) below z count as at least as extreme: Z_b of
    two outcomes that are equal in exact arithmetic may differ in the last bits, and the one computed smaller
    must not drop out of the other's tail (a smaller tail is the anti-conservative error)."""
    return float(_sup_tails(n, [budget], [z], upper)[0])


_BATCH_CELLS = 1 << 21  # _sup_tails: budgets per batch so that the grid's tails hold about this many terms


def _sup_tails(n: int, budgets: Any, zs: Any, upper: bool = False) -> Any:
    """:func:`_sup_tail` at each (budget, z) pair, bit for bit, computed together (:func:`_tails`): what a bound's
    scan over hundreds of budgets asks for."""
    import numpy as np

    budgets, zs = [float(b) for b in budgets], [float(z) for z in zs]
    out = np.zeros(len(budgets))
    if not budgets:
        return out
    if upper:
        every = _lost_limits_many(n, budgets, [z - _TIE * (1.0 + abs(z)) for z in zs], upper=True)
        empty = (every >= np.arange(n + 1)).all(axis=1)
    else:
        every = _lost_limits_many(n, budgets, zs)
        empty = (every < 0).all(axis=1)
    todo = [i for i in range(len(budgets)) if not empty[i]]
    limits = [every[i] for i in todo]
    grids = [_nuisance_grid(budgets[i]) for i in todo]
    by_size: dict[int, list[int]] = {}
    for j, grid in enumerate(grids):
        by_size.setdefault(len(grid), []).append(j)
    for size, rows in by_size.items():
        step = max(1, _BATCH_CELLS // (size * (n + 1)))
        for k in range(0, len(rows), step):
            part = rows[k:k + step]
            lim, grid = np.stack([limits[j] for j in part]), np.stack([grids[j] for j in part])
            drop = np.array([budgets[todo[j]] for j in part])
            values = _tails(n, lim, grid, drop, upper)
            sup = np.minimum(np.maximum(values.max(axis=1), _refine(n, drop, lim, grid, values, upper)), 1.0)
            out[[todo[j] for j in part]] = sup
    return out


@functools.lru_cache(maxsize=65536)
def p_value(lost: int, won: int, n: int, budget: float) -> float:
    """The exact unconditional p-value of H0: drop >= ``budget`` for ``lost`` / ``won`` of ``n`` paired items."""
    _check(lost, won, n, budget)
    return _sup_tail(n, budget, float(score_z(lost, won, n, budget)))


@functools.lru_cache(maxsize=16384)
def exact_bound(lost: int, won: int, n: int, alpha: float) -> float:
    """The smallest budget b' in [BOUND_FLOOR, 1] such that :func:`certify_paired` certifies every budget above
    it, to 1e-4 (1.0 when none below 1 would). At discordance up to 50% the rejection region is nested in b
    (checked by the tests at every outcome of small n) and a bisection finds b'. Above 50% it is not: there the
    budgets up to b' + 0.1 are scanned on a 5e-4 grid and b' is moved past the last one not certified, so a
    budget certified by the test may lie below the bound (the decision is always the test at the budget)."""
    _check(lost, won, n, 0.5, alpha)
    if p_value(lost, won, n, BOUND_FLOOR) <= alpha:
        return BOUND_FLOOR
    hi = _bisect_bound(lost, won, n, alpha, BOUND_FLOOR, 1.0)
    if lost + won <= n / 2:
        return hi
    # Above 50% discordance the region is not nested in b (n = 120, lost 30 / won 38: certified at 4.8-5.1%, not
    # at 5.1-5.2%, again from 5.2%): scan the budgets above on a grid and restart past the last that fails.
    grid = [round(hi + k * _NEST_STEP, 12) for k in range(1, _NEST_POINTS + 1) if hi + k * _NEST_STEP < 1.0]
    failing = [b for b, p in zip(grid, p_values(lost, won, n, grid), strict=True) if p > alpha]
    if not failing:
        return hi
    last = failing[-1]
    return _bisect_bound(lost, won, n, alpha, last, min(1.0, last + _NEST_STEP))


def _bisect_bound(lost: int, won: int, n: int, alpha: float, lo: float, hi: float) -> float:
    """Bisection to 1e-4 between a budget ``lo`` the test does not certify and ``hi`` (certified, or 1)."""
    while hi - lo > 1e-4:
        mid = (lo + hi) / 2.0
        if p_value(lost, won, n, round(mid, 12)) <= alpha:
            hi = mid
        else:
            lo = mid
    return hi


def p_values(lost: int, won: int, n: int, budgets: Any) -> list[float]:
    """:func:`p_value` at each of ``budgets``, bit for bit, computed together (:func:`_sup_tails`): a bound's scan
    over hundreds of budgets spends a fraction of the numpy calls one budget at a time would."""
    for budget in budgets:
        _check(lost, won, n, budget)
    zs = [float(score_z(lost, won, n, budget)) for budget in budgets]
    return [float(p) for p in _sup_tails(n, budgets, zs)]


def certify_paired(lost: int, won: int, n: int, budget: float, alpha: float) -> PairedTest:
    """Is the paired drop below ``budget``, with confidence 1 - ``alpha``? ``lost``: items the reference got
    right and the candidate wrong; ``won``: the reverse; ``n``: paired items (a failed item counts as
    wrong in the arm that failed). Everything that certifies a right/wrong budget calls this."""
    _check(lost, won, n, budget, alpha)
    p = p_value(int(lost), int(won), int(n), float(budget))
    return PairedTest(p <= alpha, p, float(budget), float(alpha), int(lost), int(won), int(n))


_LAST_CRITICAL: dict[tuple[float, float], float] = {}  # (budget, alpha) -> the last critical value found


@functools.lru_cache(maxsize=1024)
def critical_z(n: int, budget: float, alpha: float) -> float:
    """A z with p-value <= alpha at every attainable Z_b up to it and above alpha at the next: ``certify_paired``
    certifies exactly the outcomes with Z_b <= critical_z (none, where it lies below every attainable Z_b). A
    binary search over the attainable values of Z_b (the sup tail is nondecreasing in z), returning the midpoint
    between the last certified value and the next."""
    import numpy as np

    _check(0, 0, n, budget, alpha)
    values = np.unique(score_z(*_outcomes(n), n, budget))
    lo, hi = -1, len(values)  # values[lo] certifies (lo = -1: none), values[hi] does not (hi = len: none fails)
    hint = _LAST_CRITICAL.get((budget, alpha))
    if hint is not None:  # the critical value at a nearby n (a planner's scan): gallop out from it
        i = int(np.clip(np.searchsorted(values, hint), 0, len(values) - 1))
        step = 1
        if _sup_tail(n, budget, float(values[i])) <= alpha:
            lo = i
            while lo + step < len(values) and _sup_tail(n, budget, float(values[lo + step])) <= alpha:
                lo, step = lo + step, step * 2
            hi = min(len(values), lo + step)
        else:
            hi = i
            while hi - step >= 0 and _sup_tail(n, budget, float(values[hi - step])) > alpha:
                hi, step = hi - step, step * 2
            lo = max(-1, hi - step)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _sup_tail(n, budget, float(values[mid])) <= alpha:
            lo = mid
        else:
            hi = mid
    if 0 <= lo:
        _LAST_CRITICAL[(budget, alpha)] = float(values[lo])
    if lo < 0:
        return float(values[0]) - 1.0
    if hi >= len(values):
        return float(values[-1]) + 1.0
    return float((values[lo] + values[hi]) / 2.0)


def _outcomes(n: int) -> tuple[Any, Any]:
    import numpy as np

    lost, discordant = np.triu_indices(n + 1)  # every lost <= discordant <= n
    return lost, discordant - lost


def type_one_error(n: int, budget: float, alpha: float, p_won: Any, drop: float | None = None) -> Any:
    """P(certified) for each nuisance value in ``p_won`` when the true drop is ``drop`` (default: the budget,
    where H0 is hardest to reject): the probability of Z_b <= :func:`critical_z`, what the tests hold to alpha."""
    import numpy as np

    drop = budget if drop is None else drop
    z = critical_z(n, budget, alpha)
    p_won = np.atleast_1d(np.asarray(p_won, dtype=np.float64))
    if drop == budget:
        return _tail(n, budget, _lost_limits(n, budget, z), p_won)
    from scipy.stats import multinomial

    lost, won = _outcomes(n)
    region = score_z(lost, won, n, budget) <= z
    counts = np.stack([lost[region], won[region], n - lost[region] - won[region]], axis=1)
    return np.array([float(multinomial.pmf(counts, n, [pw + drop, pw, max(0.0, 1.0 - 2.0 * pw - drop)]).sum())
                     for pw in p_won])


def exact_power(n: int, budget: float, alpha: float, discordance: float, drop: float = 0.0) -> float:
    """P(certified) on n items when the true discordance (P(lost) + P(won)) and drop (P(lost) - P(won)) are
    these: the probability of Z_b <= :func:`critical_z`, summed exactly over every outcome."""
    _check(0, 0, n, budget, alpha)
    if not 0.0 <= abs(drop) <= discordance <= 1.0:
        raise ValueError(f"need |drop| <= discordance <= 1, got drop={drop}, discordance={discordance}")
    z = critical_z(n, budget, alpha)
    return float(_tail(n, budget, _lost_limits(n, budget, z), [(discordance - drop) / 2.0], drop=drop)[0])


def exact_plan(discordance: float, budget: float, drop: float = 0.0, alpha: float = 0.05, power: float = 0.8,
               most: int = 200_000) -> int | None:
    """The smallest n whose :func:`exact_power` reaches ``power``. Exact power is not monotone in n for a
    discrete test (a bisection between a failing and a passing n can land past an n that already passes: it
    said 271 at discordance 0.1 and 5% where 265 passed), so this finds a passing n from the normal-approximation
    plan upwards, finds a floor below it whose power is clearly short (``power - 0.02``; galloping down 1, 2, 4,
    ... items; at least 20% down below n = 200), and scans every n up from that floor: the first that passes. None when the drop is at or above the budget,
    or no n up to ``most`` reaches it."""
    from workers.certify.bounds import normal_plan

    if drop >= budget:
        return None
    if not 0.0 < power < 1.0:
        raise ValueError(f"power must be in (0, 1), got {power}")
    start = normal_plan(min(max(discordance, 0.0), 1.0), budget, drop, alpha, power)

    def power_at(n: int) -> float:
        return exact_power(n, budget, alpha, discordance, drop)

    hi = max(1, int(start or 1))
    while power_at(hi) < power:
        if hi >= most:
            return None
        hi = min(most, int(hi * 1.25) + 1)
    # a floor clearly short of the power: galloping down from hi (1, 2, 4, ... below it), and at least 20%
    # below it where n is small (the sawtooth of a discrete test is widest there)
    floor, step = hi, 1
    while floor > 1:
        floor = max(1, hi - step)
        if power_at(floor) < power - 0.02 and (hi >= 200 or floor <= 0.8 * hi):
            break
        step *= 2
    for n in range(floor, hi):
        if power_at(n) >= power:
            return n
    return hi
