"""The numerical core of ``workers.certify.decide``: one-sided bounds on a paired accuracy drop.

Knows counts, per-item score differences and alpha; knows nothing about trials, budgets'
meaning, records or the sweep. Everything here is a plain function of numbers.

- ``tango_upper``: Tango's (1998) score bound for the difference of paired proportions
  (losses - wins) / n, solved by bisection on the score statistic. Asymptotically exact, tight,
  but a score method: its exact coverage (enumerated over all outcomes) oscillates below nominal
  near the boundaries, down to about 0.94 for positive drops at n in 30..200 and lower for tiny n.
- ``exact_upper``: used for n <= ``EXACT_MAX_N``. Buehler's bound (Lloyd & Kabaila 2003) with
  outcomes ordered by Tango's bound: the largest drop of any (p_loss, p_win) under which an outcome
  at least as favourable as the observed one still has probability > alpha. Valid by construction
  (coverage >= 1 - alpha at every parameter, checked by enumeration in the tests); the sup is
  taken over a grid (drop step ``EXACT_STEP``, added once to stay conservative; 48 nuisance points
  per drop, denser at the edges). Built once per (n, alpha) with torch: well under a second.
- ``betting_upper`` / ``betting_crossing``: Waudby-Smith & Ramdas (2023) betting bounds for the
  mean of values in [0, 1] (paired differences mapped from [-1, 1]); valid without normality.
  ``betting_upper`` is the fixed-n predictable plug-in bound (tighter at a known n);
  ``betting_crossing`` is the anytime-valid test (Ville's inequality; as in Howard et al. 2021
  confidence sequences) used for early stopping: checked after every item with no correction.
  Price of validity without normality: about twice the items of a normal-theory bound.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from statistics import NormalDist

EXACT_MAX_N = 30  # at and below: the exact (Buehler) bound; above: Tango's score bound
EXACT_STEP = 0.0025  # drop grid of the exact bound
_EXACT_NUISANCE = 48
_TORCH_FROM = 512  # betting bound: torch above this many items
_BET_CAP = 0.75  # WSR's truncation c: never stake more than 3/4 of the capital's headroom


def z_quantile(p: float) -> float:
    return NormalDist().inv_cdf(p)


# --- paired binary outcomes -------------------------------------------------------------------


def _tango_z(losses: float, wins: float, n: int, delta: float) -> float:
    """Tango's score statistic for H0: p_loss - p_win = delta (constrained MLE of p_win)."""
    a = 2.0 * n
    b = -losses - wins + (2.0 * n - losses + wins) * delta
    c = -wins * delta * (1.0 - delta)
    p_win = (math.sqrt(max(b * b - 4.0 * a * c, 0.0)) - b) / (2.0 * a)
    var = n * (2.0 * p_win + delta * (1.0 - delta))
    num = losses - wins - n * delta
    if var <= 0.0:
        return math.copysign(math.inf, num) if num else 0.0
    return num / math.sqrt(var)


def tango_upper(losses: int, wins: int, n: int, alpha: float) -> float:
    """Largest drop delta whose one-sided score test is not rejected: Z(delta) >= -z_{1-alpha}."""
    z = z_quantile(1.0 - alpha)
    lo, hi = (losses - wins) / n, 1.0
    if _tango_z(losses, wins, n, 1.0 - 1e-12) >= -z:
        return 1.0
    while hi - lo > 1e-10:
        mid = 0.5 * (lo + hi)
        if _tango_z(losses, wins, n, mid) >= -z:
            lo = mid
        else:
            hi = mid
    return hi


def exact_upper(losses: int, wins: int, n: int, alpha: float) -> float:
    return _exact_table(n, alpha)[losses * (n + 1) + wins]


@functools.lru_cache(maxsize=64)
def _exact_table(n: int, alpha: float) -> tuple[float, ...]:
    """Buehler upper bound of every outcome (losses, wins) at this n, indexed losses*(n+1)+wins."""
    import torch  # only here: the exact table is the one vectorised computation

    cells = [(x, y) for x in range(n + 1) for y in range(n + 1 - x)]
    x = torch.tensor([c[0] for c in cells], dtype=torch.float64)
    y = torch.tensor([c[1] for c in cells], dtype=torch.float64)
    t = n - x - y
    order_stat = torch.tensor([tango_upper(a, b, n, alpha) for a, b in cells], dtype=torch.float64)
    order = torch.argsort(order_stat)
    ranked = order_stat[order]
    last_tie = torch.searchsorted(ranked, ranked + 1e-12, right=True) - 1  # P(T <= t) counts ties
    log_coef = math.lgamma(n + 1) - torch.lgamma(x + 1) - torch.lgamma(y + 1) - torch.lgamma(t + 1)
    feats = torch.stack([log_coef, x, y, t])[:, order]  # [4, cells]
    drops = torch.arange(-1.0, 1.0 + EXACT_STEP / 2, EXACT_STEP, dtype=torch.float64)
    k = _EXACT_NUISANCE
    spread = (1 - torch.cos(math.pi * torch.arange(k, dtype=torch.float64) / (k - 1))) / 2  # dense at edges

    def log_or_floor(p: torch.Tensor) -> torch.Tensor:  # log 0 -> -1e6 so that 0 * log 0 = 0
        return torch.where(p > 0, torch.log(p.clamp(min=1e-300)), torch.full_like(p, -1e6))

    best = torch.full((len(cells),), -2.0, dtype=torch.float64)
    for start in range(0, len(drops), 128):
        d0 = drops[start:start + 128]
        lo = (-d0).clamp(min=0)
        hi = torch.maximum(((1 - d0) / 2).clamp(min=0), lo)
        p_win = (lo[:, None] + (hi - lo)[:, None] * spread[None, :]).reshape(-1)
        p_loss = (p_win + d0.repeat_interleave(k)).clamp(0, 1)
        p_tie = (1 - p_loss - p_win).clamp(min=0)
        theta = torch.stack([torch.ones_like(p_loss), log_or_floor(p_loss), log_or_floor(p_win),
                             log_or_floor(p_tie)], dim=1)  # [drops*k, 4]
        tail = torch.cumsum(torch.exp(theta @ feats), dim=1)[:, last_tie]  # P(T <= T_cell)
        tail = tail.reshape(len(d0), k, -1).amax(dim=1)  # sup over the nuisance
        alive = torch.where(tail > alpha, d0[:, None], torch.full_like(tail, -2.0)).amax(dim=0)
        best = torch.maximum(best, alive)
    upper = (best + EXACT_STEP).clamp(max=1.0)
    out = [0.0] * ((n + 1) * (n + 1))
    for (a, b), u in zip((cells[i] for i in order.tolist()), upper.tolist(), strict=True):
        out[a * (n + 1) + b] = u
    return tuple(out)


def binary_upper(losses: int, wins: int, n: int, alpha: float) -> tuple[float, str]:
    """(upper bound, method name): exact at n <= EXACT_MAX_N, Tango's score bound above."""
    if n <= EXACT_MAX_N:
        return exact_upper(losses, wins, n, alpha), "exact-buehler"
    return tango_upper(losses, wins, n, alpha), "tango-score"


# --- bounded scores: betting ------------------------------------------------------------------


def _plug_in_variances(values: Sequence[float]) -> list[float]:
    """WSR's predictable variance estimates: entry t uses values[:t] only (1/4 prior weight)."""
    out, total, sq = [], 0.5, 0.25
    for i, v in enumerate(values):
        out.append(sq / (i + 1))
        total += v
        mean = total / (i + 2)
        sq += (v - mean) ** 2
    return out


def betting_upper(unit_values: Sequence[float], alpha: float) -> float:
    """Upper (1 - alpha) bound for the mean of values in [0, 1]: the smallest m at which the
    capital betting on 'mean below m', prod(1 + lam_t (m - x_t)), ever reaches 1/alpha.
    The capital is nondecreasing in m, so bisection finds it; returns the rejected end.
    Above ``_TORCH_FROM`` items the capital is summed by torch (~5 ms at n = 10,000)."""
    n = len(unit_values)
    log_target = math.log(1.0 / alpha)
    variances = _plug_in_variances(unit_values)
    if n < _TORCH_FROM:
        stakes = [math.sqrt(2.0 * log_target / (n * v)) for v in variances]

        def peak(m: float) -> float:
            cap = _BET_CAP / (1.0 - m) if m < 1.0 else math.inf
            best = total = 0.0
            for s, x in zip(stakes, unit_values, strict=True):
                total += math.log1p(min(s, cap) * (m - x))
                best = max(best, total)
            return best
    else:
        import torch  # only here: a vectorised sum for large n

        xs = torch.tensor(unit_values, dtype=torch.float64)
        lam = torch.sqrt(2.0 * log_target / (n * torch.tensor(variances, dtype=torch.float64)))

        def peak(m: float) -> float:
            cap = _BET_CAP / (1.0 - m) if m < 1.0 else math.inf
            return float(torch.cumsum(torch.log1p(lam.clamp(max=cap) * (m - xs)), dim=0).amax())

    if peak(1.0) < log_target:
        return 1.0
    # bracket near the mean first (the bound sits within a few standard errors of it)
    mean = sum(unit_values) / n
    lo, hi = 0.0, 1.0
    if peak(mean) < log_target:
        lo = mean
        guess = min(1.0, mean + 4.0 * math.sqrt(variances[-1] * log_target / n) + 1.0 / n)
        if peak(guess) >= log_target:
            hi = guess
        else:
            lo = guess
    while hi - lo > 1e-6:
        mid = 0.5 * (lo + hi)
        if peak(mid) >= log_target:
            hi = mid
        else:
            lo = mid
    return hi


def betting_crossing(unit_values: Sequence[float], threshold: float, alpha: float) -> int | None:
    """Anytime-valid test of H0: mean <= threshold for values in [0, 1]: the 1-based index at
    which the capital prod(1 + lam_t (x_t - threshold)) first reaches 1/alpha, or None.
    P(it ever does | H0) <= alpha (Ville), so it may be checked after every item."""
    if threshold >= 1.0:
        return None  # no mean in [0, 1] exceeds it
    log_target = math.log(1.0 / alpha)
    cap = _BET_CAP / threshold
    capital = 0.0
    for t, (x, var) in enumerate(zip(unit_values, _plug_in_variances(unit_values), strict=True), start=1):
        stake = min(math.sqrt(2.0 * log_target / (var * t * math.log1p(t))), cap)
        capital += math.log1p(stake * (x - threshold))
        if capital >= log_target:
            return t
    return None


# --- planning ---------------------------------------------------------------------------------


def normal_plan(second_moment: float, budget: float, drop: float, alpha: float, power: float) -> int | None:
    """Smallest n at which the one-sided score test of 'drop >= budget' rejects with the given
    power when the true drop is ``drop``, by the normal approximation: variance under the null
    max(d, b) - b^2, under the alternative d - drop^2 (d: mean squared paired difference)."""
    if drop >= budget:
        return None
    null_var = max(second_moment, budget) - budget * budget
    alt_var = max(second_moment - drop * drop, 0.0)
    root = z_quantile(1.0 - alpha) * math.sqrt(null_var) + z_quantile(power) * math.sqrt(alt_var)
    return max(1, math.ceil(root * root / (budget - drop) ** 2 - 1e-9))
