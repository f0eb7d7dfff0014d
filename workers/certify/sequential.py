"""Group-sequential confirmation: a few looks on the fixed item order, stopping early on success.

A confirmation of up to N items, in an order fixed before any outcome is seen, is looked at K times:
after the first n_1 < n_2 < ... < n_K = N items (``n_k = ceil(k N / K)``). The error is spent along the
power family ``alpha * (n_k / N) ** rho`` (Kim & DeMets; ``rho`` = 2 by default, between Pocock's flat
and O'Brien-Fleming's late spending), and the candidate is certified at the first look that passes.

**Calibrated looks** (:func:`calibrate`, with a budget). Look k passes when Tango's Z_b on the first n_k
items is at most z_k. The distribution of (lost, won) among the candidates not yet certified is carried
from look to look exactly (a 2-D convolution with the trinomial of the new items), and z_k is the largest
attainable value with P(certified by look k | drop = b) <= alpha * (n_k / N) ** rho at every nuisance
value of a grid; the thresholds are then checked on a dense grid (:func:`crossing`), any point that
exceeds joins the grid and the calibration runs again. The decision *is* the threshold (the fixed-n
p-value at z_k is reported as the look's nominal level, never used to decide: ties in that p-value would
admit outcomes the calibration left out). Drops above b make small Z_b rarer still (a coupling; the
tests check it).

**Large N.** Above ~554 items the whole (N + 1)^2 state no longer fits in memory for every nuisance point;
the calibration then carries only the band of states that carry mass (``banded``: mass cut away is booked as
if certified, so the level still holds), up to N = 4,000.

**Union bound** (no budget, or N above 4,000). Look k runs the exact test of
``workers.certify.exact`` at level alpha_k = the alpha spent at look k (spent_k - spent_{k-1}); P(certified
at some look | drop >= b) <= sum_k alpha_k = alpha. Valid, more conservative.

A candidate may also stop for *futility* (``decide.prune_test``, anytime-valid): stopping to declare
failure only lowers the chance of certifying. The decision itself is ``decide.sequential_bound``. One look
(K = 1) is the fixed-n test.

**Refutation** (:func:`refute_looks`): the mirror claim, drop > b, over the same looks by the union bound
(look k: ``exact.refute_paired`` at the alpha the look spends); the calibrated thresholds are certification's
and say nothing about the other tail.

Knows counts, budgets and alpha; nothing about records, trials or the sweep. numpy and scipy (imported
where used).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

RHO = 2.0  # power-family spending exponent
_CALIBRATION_GRID = 16  # x 4: the nuisance points calibration starts from (a thinner copy of ``exact``'s grid)
_CHECK_GRID = 1001  # uniform nuisance points (plus both ends, geometric) every calibration is checked on
_CALIBRATION_CELLS = 25_000_000  # nuisance points x (N + 1)^2 states at most (memory): larger N, banded.py
_BANDED_UP_TO = 4000  # the banded calibration's largest N (its bands grow as sqrt(N)): above, the union bound
_ROUNDS = 4  # calibrate, check on the dense grid, add the points that exceed, again (then the union bound)


@dataclass(frozen=True)
class LookPlan:
    """Where the looks fall, the alpha spent by each, and what certifies at each look."""

    sizes: tuple[int, ...]  # items at each look, increasing, the last = N
    alphas: tuple[float, ...]  # each look's nominal level (the union bound: certify_paired at this level)
    alpha: float
    rho: float = RHO
    spent: tuple[float, ...] = ()  # the error spent by the end of each look: alpha * (n_k / N) ** rho
    budget: float | None = None  # the budget the looks were calibrated for (None: the union bound)
    thresholds: tuple[float, ...] | None = None  # calibrated: look k certifies iff Z_b <= thresholds[k]

    @property
    def n(self) -> int:
        return self.sizes[-1]

    @property
    def shares(self) -> tuple[float, ...]:
        """The alpha each look spends (spent_k - spent_{k-1}; they sum to alpha): the union bound's levels."""
        return _shares(tuple(self.spent) or tuple(self.alphas))

    def to_dict(self) -> dict[str, Any]:
        how = ("exact: each look certifies Z_b <= z_k, the largest z_k whose cumulative P(certified) stays within "
               "the spent alpha over the nuisance (checked on a dense grid)" if self.thresholds is not None
               else "union bound over looks (each look's exact test at the alpha its look spends)")
        return {"sizes": list(self.sizes), "alphas": list(self.alphas), "spent": list(self.spent),
                "alpha": self.alpha, "rho": self.rho, "budget": self.budget,
                "thresholds": None if self.thresholds is None else [None if math.isinf(z) else z for z in self.thresholds],
                "spending": f"alpha * t^{self.rho:g} (power family); {how}"}


def _shares(spent: tuple[float, ...]) -> tuple[float, ...]:
    """Each look's increment of the alpha spent by its end."""
    return (spent[0],) + tuple(b - a for a, b in zip(spent, spent[1:], strict=False))


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

    With ``budget``: each look's region {Z_b <= z_k} is calibrated exactly (:func:`calibrate`), so the
    procedure's probability of certifying by look k is at most ``spent[k]`` at every nuisance value of a
    dense grid. Without (or where N is too large to carry): the union bound (each look's exact test at the
    alpha its look spends, spent_k - spent_{k-1}), valid for any budget but conservative. One look is the
    fixed-n test at ``alpha`` either way."""
    sizes, spent = _sizes(n, looks, alpha, rho)
    if len(sizes) == 1:
        return LookPlan(sizes, (float(alpha),), float(alpha), float(rho), spent, budget)
    calibrated = None
    if budget is not None and n <= _BANDED_UP_TO:
        # the whole (N + 1)^2 state where it fits; above, only the band of states that carry mass (banded.py)
        banded = len(_calibration_grid(float(budget))) * (n + 1) ** 2 > _CALIBRATION_CELLS
        calibrated = calibrate(sizes, spent, float(budget), banded)
    if calibrated is None:  # too large to carry here, or no calibration held: the union bound
        return LookPlan(sizes, _shares(spent), float(alpha), float(rho), spent, None)
    levels, thresholds = calibrated
    return LookPlan(sizes, levels, float(alpha), float(rho), spent, float(budget), thresholds)


@functools.lru_cache(maxsize=16)
def _state_z(n: int, budget: float) -> Any:
    """Tango's Z_b at every (lost, won) of n items (+inf where lost + won > n), shape (n + 1, n + 1).

    Read-only and cached: it depends on (n, budget) alone, and ``crossing`` asks for the same looks at every
    one of the thousand-odd nuisance points of its check grid (16 kept: one plan's looks; at most ~40 MB, as
    the full state is carried only up to N ~ 554)."""
    import numpy as np

    from workers.certify.exact import score_z

    lost, won = np.meshgrid(np.arange(n + 1), np.arange(n + 1), indexing="ij")
    valid = lost + won <= n
    out = np.where(valid, score_z(lost, np.where(valid, won, 0), n, budget), np.inf)
    out.flags.writeable = False
    return out


@functools.lru_cache(maxsize=16)
def _within(n: int) -> Any:
    """The mask lost + won <= n over the (n + 1, n + 1) states (read-only, cached)."""
    import numpy as np

    lost, won = np.ogrid[: n + 1, : n + 1]
    out = lost + won <= n
    out.flags.writeable = False
    return out


def _calibration_grid(budget: float) -> Any:
    """A thinner copy of ``exact``'s nuisance grid (its first and last points kept)."""
    import numpy as np

    from workers.certify.exact import _nuisance_grid

    grid = _nuisance_grid(budget)
    step = max(1, len(grid) // (4 * _CALIBRATION_GRID))
    return np.unique(np.concatenate([grid[::step], grid[:3], grid[-3:]]))


def _check_grid(budget: float) -> Any:
    import numpy as np

    top = (1.0 - budget) / 2.0
    near = np.geomspace(1e-7, 0.02, 24)
    return np.unique(np.concatenate([np.linspace(0.0, top, _CHECK_GRID), top * near, top * (1.0 - near)]))


def _carry(state: Any, m: int, p_lost: float, p_won: float, n: int) -> Any:
    """The distribution of (lost, won) after m more items (cells with lost + won > n masked to 0)."""
    import numpy as np
    from scipy.signal import fftconvolve

    state = np.clip(fftconvolve(state, _kernel(m, p_lost, p_won)), 0.0, None)[: n + 1, : n + 1]
    return np.where(_within(n), state, 0.0)


def crossing(sizes: tuple[int, ...], thresholds: tuple[float, ...], budget: float, p_won: float,
             drop: float | None = None) -> list[float]:
    """P(certified by look k) for each k, when each look certifies Z_b <= its threshold (exact enumeration,
    drop = ``budget`` unless given): :func:`_crossings` at the one nuisance point ``p_won``."""
    return [float(x) for x in _crossings(sizes, thresholds, budget, [p_won], drop=drop)[0]]


def _crossings(sizes: tuple[int, ...], thresholds: tuple[float, ...], budget: float, p_wons: Any,
               chunk: int = 8, drop: float | None = None) -> Any:
    """P(certified by look k) at every nuisance point of ``p_wons`` (drop = ``budget`` unless given): an array
    [len(p_wons), looks]. Each point's numbers are those of carrying it alone (:func:`_carry`: the same kernels,
    FFT lengths and sums, bit for bit), computed on ``chunk`` points per FFT call: the dense check grid is a
    thousand-odd points a round."""
    import numpy as np
    from scipy import fft as sp_fft

    drop = budget if drop is None else drop
    p_wons = np.asarray(p_wons, dtype=np.float64)
    out = np.empty((len(p_wons), len(sizes)))
    for lo in range(0, len(p_wons), chunk):
        pws = p_wons[lo: lo + chunk]
        state, total, prev = np.ones((len(pws), 1, 1)), np.zeros(len(pws)), 0
        for k, (n, z) in enumerate(zip(sizes, thresholds, strict=True)):
            m = n - prev
            kernels = np.stack([_kernel(m, float(pw) + drop, float(pw)) for pw in pws])
            # scipy.signal.fftconvolve's "full" convolution, on every point of the chunk (which, like it, multiplies
            # where the state is a single cell: no axis to transform)
            if state.shape[1:] == (1, 1):
                conv = state * kernels
            else:
                full = (state.shape[1] + m, state.shape[2] + m)
                fshape = [sp_fft.next_fast_len(d, True) for d in full]
                spectrum = sp_fft.rfftn(state, fshape, axes=(1, 2)) * sp_fft.rfftn(kernels, fshape, axes=(1, 2))
                conv = sp_fft.irfftn(spectrum, fshape, axes=(1, 2))[:, : full[0], : full[1]]
            state = np.where(_within(n), np.clip(conv, 0.0, None)[:, : n + 1, : n + 1], 0.0)
            passed = _state_z(n, budget) <= z
            total = total + np.array([float(one[passed].sum()) for one in state])  # summed as crossing sums it
            out[lo: lo + len(pws), k] = total
            state = np.where(passed, 0.0, state)
            prev = n
    return out


def _calibrate_on(sizes: tuple[int, ...], spent: tuple[float, ...], budget: float, grid: Any) -> tuple[float, ...]:
    """The largest attainable thresholds z_k such that, at every point of ``grid``, P(certified by look k)
    <= spent[k] (-inf where nothing may pass)."""
    import numpy as np

    states = [np.ones((1, 1)) for _ in grid]
    crossed = np.zeros(len(grid))
    thresholds, prev = [], 0
    for n, target in zip(sizes, spent, strict=True):
        zgrid = _state_z(n, budget)
        z = zgrid.ravel()
        order = np.argsort(z, kind="stable")
        zs = z[order]
        ends = np.flatnonzero(np.r_[zs[1:] != zs[:-1], True] & np.isfinite(zs))  # last index of each distinct Z
        best = len(ends) - 1
        for i, pw in enumerate(grid):
            states[i] = _carry(states[i], n - prev, pw + budget, pw, n)
            cum = np.cumsum(states[i].ravel()[order])[ends]
            # the largest group j with crossed + cum[j] <= target (cum is nondecreasing in j)
            best = min(best, int(np.searchsorted(cum, target - crossed[i], side="right")) - 1)
        z_k = -math.inf if best < 0 else float(zs[ends[best]])
        passed = zgrid <= z_k
        for i in range(len(grid)):
            crossed[i] += float(states[i][passed].sum())
            states[i] = np.where(passed, 0.0, states[i])
        thresholds.append(z_k)
        prev = n
    return tuple(thresholds)


@functools.lru_cache(maxsize=256)
def calibrate(sizes: tuple[int, ...], spent: tuple[float, ...], budget: float, banded: bool = False
              ) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
    """(nominal levels, thresholds) of looks at ``sizes``: look k certifies when Tango's Z_b on the first n_k
    items is <= z_k, each z_k the largest attainable value with

        max over the nuisance of P(certified at some look <= k | drop = budget) <= spent[k],

    computed exactly by carrying the distribution of (lost, won) of the candidates not yet certified from
    look to look (a 2-D convolution with the trinomial of the new items). Calibrated on a grid, then checked
    on a dense one (:func:`crossing`); points that exceed join the grid and it is calibrated again (None if
    that does not settle: the caller falls back to the union bound). The decision is the threshold itself;
    the nominal level (the fixed-n p-value at z_k) is reported beside it. Uses the looks' correlation, so
    each look's region is at least the union bound's."""
    import numpy as np

    from workers.certify import banded as band
    from workers.certify.exact import _sup_tail

    calibrate_on, cross = (band.calibrate_on, band.crossing) if banded else (_calibrate_on, crossing)
    grid, check = _calibration_grid(budget), _check_grid(budget)
    for _ in range(_ROUNDS):
        thresholds = calibrate_on(sizes, spent, budget, grid)
        crossed = (_crossings(sizes, thresholds, budget, check) if not banded
                   else [cross(sizes, thresholds, budget, float(pw)) for pw in check])
        over = [pw for pw, row in zip(check, crossed, strict=True)
                if any(c > t + 1e-12 for c, t in zip(row, spent, strict=True))]
        if not over:
            levels = tuple(0.0 if math.isinf(z) else min(1.0, _sup_tail(n, budget, z))
                           for n, z in zip(sizes, thresholds, strict=True))
            return levels, thresholds
        grid = np.unique(np.concatenate([grid, over]))
    return None


def _kernel(m: int, p_lost: float, p_won: float) -> Any:
    """Trinomial pmf of (lost, won) over m items, as an (m + 1) x (m + 1) array (0 where lost + won > m)."""
    from workers.certify.banded import trinomial

    return trinomial(m, p_lost, p_won, (0, m), (0, m))


def sequential_power(plan: LookPlan, budget: float, discordance: float, drop: float = 0.0) -> tuple[float, float]:
    """(P(certified at some look), expected items used) when the true discordance and drop are these, by
    exact enumeration of (lost, won) through the looks (a candidate stops at the look that certifies it;
    futility stops are not modelled: they only lower both figures). At drop = ``budget`` the first figure is
    the procedure's type-I error at that nuisance (the tests hold it to alpha)."""
    import numpy as np

    from workers.certify.exact import critical_z
    if not 0.0 <= abs(drop) <= discordance <= 1.0:
        raise ValueError(f"need |drop| <= discordance <= 1, got drop={drop}, discordance={discordance}")
    p_lost, p_won = (discordance + drop) / 2.0, (discordance - drop) / 2.0
    state = np.ones((1, 1))  # P(lost, won) among the candidates still running
    power, expected, prev = 0.0, 0.0, 0
    for k, (n, a) in enumerate(zip(plan.sizes, plan.alphas, strict=True)):
        state = _carry(state, n - prev, p_lost, p_won, n)
        z = plan.thresholds[k] if plan.thresholds is not None and plan.budget == budget else critical_z(n, budget, a)
        passed = _state_z(n, budget) <= z
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


@dataclass(frozen=True)
class LookRefutation:
    """Refutation over a plan's looks (:func:`refute_looks`)."""

    refuted: bool
    look: int  # the look that refuted (1-based); not refuted: the last look tested (0: none)
    looks: int  # the plan's looks
    tests: tuple[Any, ...]  # ``exact.RefuteTest`` of each look tested, in order, up to the one that refuted

    def to_dict(self) -> dict[str, Any]:
        return {"refuted": self.refuted, "look": self.look, "looks": self.looks,
                "tests": [t.to_dict() for t in self.tests]}


def refute_looks(counts: Sequence[tuple[int, int]], plan: LookPlan, budget: float) -> LookRefutation:
    """Is the paired drop shown above ``budget`` at some look? ``counts``: (lost, won) among the first
    ``plan.sizes[k]`` items at each look reached, in order (fewer than the plan's looks where the run stopped
    early). Look k refutes when ``exact.refute_paired`` does at level ``plan.shares[k - 1]``, the alpha that look
    spends; the first look that refutes decides.

    The level is a union bound: each look's exact test holds P(refuted at look k | drop <= b) <= share_k at every
    nuisance value, and the shares sum to alpha, so P(refuted at some look | drop <= b) <= alpha however the
    looks are correlated. It holds whatever ended the run early (a certification, a futility stop, a budget of
    items), and whatever that rule read, since stopping without refuting only removes looks from the union:
    the event "refuted at a look reached" lies inside "look k's test rejects, for some k of the full plan".
    Calibrated plans keep their certification thresholds for certifying; refutation takes their shares alone."""
    from workers.certify.exact import _check
    from workers.certify.refute import refute_paired

    sizes, shares = plan.sizes, plan.shares
    _check(0, 0, 1, budget)
    if len(counts) > len(sizes):
        raise ValueError(f"{len(counts)} looks of counts for a plan of {len(sizes)} looks")
    tests, prev = [], (0, 0, 0)
    for k, ((lost, won), n, level) in enumerate(zip(counts, sizes, shares, strict=False), start=1):
        lost, won = int(lost), int(won)
        _check(lost, won, n, budget)
        if lost < prev[0] or won < prev[1] or (lost - prev[0]) + (won - prev[1]) > n - prev[2]:
            raise ValueError(f"counts must accumulate over the looks: look {k} has lost={lost}, won={won} of {n} "
                             f"items after lost={prev[0]}, won={prev[1]} of {prev[2]}")
        prev = (lost, won, n)
        if level <= 0.0:  # this look spends nothing: it may refute nothing
            continue
        test = refute_paired(lost, won, n, budget, level)
        tests.append(test)
        if test.refuted:
            return LookRefutation(True, k, len(sizes), tuple(tests))
    return LookRefutation(False, len(counts), len(sizes), tuple(tests))
