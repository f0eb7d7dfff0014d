"""Calibrated group-sequential looks for large confirmations, carried on the states that carry mass.

``sequential.calibrate`` carries the whole (N + 1) x (N + 1) distribution of (lost, won) for every nuisance
point of its grid; above N ~ 550 that no longer fits and the plan fell back to the union bound, which wastes
alpha (exact level 0.0426 at N 600, K 2, b 5%; 0.0329 at N 1000, K 4, b 2%) and made a power cliff at the switch.

Here each nuisance point carries only a *band*: the rectangle of (lost, won) where its distribution has mass
(the trinomial of the new items is cut at its mean +- (8 sd + 12) per axis; rows and columns of the carried
band whose mass falls below 1e-18 are dropped). Every cut and every drop is booked as *lost mass* and counted
as if it had certified, so what is computed is an upper bound of P(certified by look k) at that nuisance point,
exact up to that booked mass (below 1e-12 in all here): the calibration below holds the true error within the
spent alpha, never only approximately. The carried band is a sub-distribution of the true one (each step maps
one to the other), so the bound holds whatever the cut.

Thresholds are chosen as in ``sequential``: at look k, the largest attainable Z_b whose cumulative probability
of certifying stays within alpha * (n_k / N) ** rho at every grid point, then checked on a dense grid (points
that exceed join the grid and the calibration runs again).

Knows counts, budgets and alpha; numpy and scipy (imported where used).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

_SD, _PAD = 8.0, 12.0  # the new items' trinomial is kept at mean +- (8 sd + 12) per axis
_DROP = 1e-18  # edge rows / columns of a band with less mass than this are dropped (booked as lost)


@dataclass
class Band:
    """P(lost, won) on the rectangle [lost0, lost0 + rows) x [won0, won0 + cols); ``lost``: mass cut away."""

    mass: Any  # [rows, cols] float64
    lost0: int
    won0: int
    lost: float = 0.0


def _window(m: int, p: float) -> tuple[int, int]:
    sd = math.sqrt(m * p * (1.0 - p))
    return max(0, math.floor(m * p - _SD * sd - _PAD)), min(m, math.ceil(m * p + _SD * sd + _PAD))


def trinomial(m: int, p_lost: float, p_won: float, lost: tuple[int, int], won: tuple[int, int]) -> Any:
    """The trinomial pmf of (lost, won) over m items on [lost[0], lost[1]] x [won[0], won[1]] (0 where
    lost + won > m); ``sequential`` takes the whole square, the bands their windows."""
    import numpy as np
    from scipy.special import gammaln, xlogy

    # every term is a function of one count in 0..m: computed once per count on a 1-D table and looked up
    # (the same numbers, summed in the same order, as evaluating gammaln / xlogy on the whole 2-D grid)
    a = np.arange(lost[0], lost[1] + 1)[:, None]
    c = np.arange(won[0], won[1] + 1)[None, :]
    t = m - a - c
    ok = t >= 0
    t = np.where(ok, t, 0)
    p_tie = max(0.0, 1.0 - p_lost - p_won)
    counts = np.arange(m + 1, dtype=np.float64)
    log_fact = gammaln(counts + 1.0)
    tie_term = xlogy(counts, p_tie) if p_tie > 0 else np.where(counts > 0, -np.inf, 0.0)
    logp = (gammaln(m + 1.0) - log_fact[a] - log_fact[c] - log_fact[t]
            + xlogy(counts, p_lost)[a] + xlogy(counts, p_won)[c] + tie_term[t])
    return np.where(ok, np.exp(logp), 0.0)


def _kernel(m: int, p_lost: float, p_won: float) -> tuple[Any, int, int]:
    """The trinomial pmf of (lost, won) over m items on its window: (array, first lost, first won)."""
    lost, won = _window(m, p_lost), _window(m, p_won)
    return trinomial(m, p_lost, p_won, lost, won), lost[0], won[0]


def carry(band: Band, m: int, p_lost: float, p_won: float, n: int) -> Band:
    """``band`` after m more items (n in all), cut to where it has mass; the mass cut away is booked."""
    import numpy as np
    from scipy.signal import fftconvolve

    kernel, a0, c0 = _kernel(m, p_lost, p_won)
    before = float(band.mass.sum())
    mass = np.clip(fftconvolve(band.mass, kernel), 0.0, None)
    lost0, won0 = band.lost0 + a0, band.won0 + c0
    rows, cols = np.ogrid[: mass.shape[0], : mass.shape[1]]
    mass = np.where(lost0 + rows + won0 + cols <= n, mass, 0.0)
    r, c = np.flatnonzero(mass.sum(axis=1) >= _DROP), np.flatnonzero(mass.sum(axis=0) >= _DROP)
    if len(r) and len(c):
        mass = mass[r[0]: r[-1] + 1, c[0]: c[-1] + 1]
        lost0, won0 = lost0 + int(r[0]), won0 + int(c[0])
    else:
        mass, lost0, won0 = np.zeros((1, 1)), lost0, won0
    # everything the true process holds that this band does not: the kernel's cut tails and the dropped edges
    cut = max(0.0, before - float(mass.sum()))
    return Band(mass, lost0, won0, band.lost + cut)


def band_z(band: Band, n: int, budget: float) -> Any:
    """Tango's Z_b at every cell of the band (+inf where lost + won > n)."""
    import numpy as np

    from workers.certify.exact import score_z

    lost = band.lost0 + np.arange(band.mass.shape[0])[:, None]
    won = band.won0 + np.arange(band.mass.shape[1])[None, :]
    valid = lost + won <= n
    return np.where(valid, score_z(lost, np.where(valid, won, 0), n, budget), np.inf)


def attainable(n: int, budget: float) -> Any:
    """Every value Tango's Z_b takes on n items, sorted."""
    import numpy as np

    from workers.certify.exact import _outcomes, score_z

    return np.unique(score_z(*_outcomes(n), n, budget))


def calibrate_on(sizes: tuple[int, ...], spent: tuple[float, ...], budget: float, grid: Any) -> tuple[float, ...]:
    """The largest attainable thresholds z_k with, at every point of ``grid``, (mass certified by look k) + (mass
    booked as lost) <= spent[k] (-inf where nothing may pass)."""
    import numpy as np

    bands = [Band(np.ones((1, 1)), 0, 0) for _ in grid]
    crossed = np.zeros(len(grid))
    thresholds, prev = [], 0
    for n, target in zip(sizes, spent, strict=True):
        cap = math.inf  # the threshold must stay below the first Z at which some point would exceed
        zs = []
        for i, pw in enumerate(grid):
            bands[i] = carry(bands[i], n - prev, pw + budget, pw, n)
            z = band_z(bands[i], n, budget).ravel()
            order = np.argsort(z, kind="stable")
            z, mass = z[order], bands[i].mass.ravel()[order]
            zs.append(z)
            ends = np.flatnonzero(np.r_[z[1:] != z[:-1], True] & np.isfinite(z))
            cum = np.cumsum(mass)[ends]
            over = np.flatnonzero(crossed[i] + bands[i].lost + cum > target)
            if len(over):
                cap = min(cap, float(z[ends[over[0]]]))
        values = attainable(n, budget)
        below = values[values < cap]
        z_k = float(below[-1]) if len(below) else -math.inf
        for i in range(len(grid)):
            passed = band_z(bands[i], n, budget) <= z_k
            crossed[i] += float(bands[i].mass[passed].sum())
            bands[i].mass = np.where(passed, 0.0, bands[i].mass)
        thresholds.append(z_k)
        prev = n
    return tuple(thresholds)


def crossing(sizes: tuple[int, ...], thresholds: tuple[float, ...], budget: float, p_won: float,
             drop: float | None = None) -> list[float]:
    """Upper bounds of P(certified by look k), each k, when each look certifies Z_b <= its threshold: the mass
    certified in the bands plus the mass they booked as lost (drop = ``budget`` unless given)."""
    import numpy as np

    drop = budget if drop is None else drop
    band, out, total, prev = Band(np.ones((1, 1)), 0, 0), [], 0.0, 0
    for n, z in zip(sizes, thresholds, strict=True):
        band = carry(band, n - prev, p_won + drop, p_won, n)
        passed = band_z(band, n, budget) <= z
        total += float(band.mass[passed].sum())
        out.append(total + band.lost)
        band.mass = np.where(passed, 0.0, band.mass)
        prev = n
    return out
