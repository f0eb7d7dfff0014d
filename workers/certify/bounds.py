"""Bounds for bounded scores and the planner's arithmetic (right/wrong scores: ``workers.certify.exact``).

Knows counts, per-item score differences and alpha; knows nothing about trials, budgets'
meaning, records or the sweep. Everything here is a plain function of numbers.

- ``betting_upper`` / ``betting_crossing``: Waudby-Smith & Ramdas (2023) betting bounds for the
  mean of values in [0, 1] (paired differences mapped from [-1, 1]); valid without normality.
  ``betting_upper`` is the fixed-n predictable plug-in bound (tighter at a known n);
  ``betting_crossing`` is the anytime-valid test (Ville's inequality; as in Howard et al. 2021
  confidence sequences) used for early stopping: checked after every item with no correction.
  Price of validity without normality: about twice the items of a normal-theory bound.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from statistics import NormalDist

_TORCH_FROM = 512  # betting bound: torch above this many items
_BET_CAP = 0.75  # WSR's truncation c: never stake more than 3/4 of the capital's headroom


def z_quantile(p: float) -> float:
    return NormalDist().inv_cdf(p)


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
