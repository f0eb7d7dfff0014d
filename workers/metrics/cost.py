"""The one cost model: what a decoding run costs in target-step units, and the speed that follows.

A run's decode cost (prefill excluded) is ``v(L) * target_forwards + c * draft_forwards``: c is the pair's
draft/target forward-time ratio, v(L) what a verify pass over L + 1 positions costs against a one-token target
step (1 for target-only decoding, L = 0). Its modelled speed is tokens per cost (target-only decoding: 1 token
per unit). A rule that accepted every draft token would emit L + 1 tokens per round for one verify and L draft
forwards: :func:`ceiling` is the most any acceptance rule can reach at L. Everything that prices a run (trial
metrics, the fastest lossless, a certificate's speed, the frontier, the step benchmarks) asks this module.

Knows counts: anything with ``draft_len``, ``target_forwards`` and ``draft_forwards`` (a ``Record``, a
``GenerationStats``); nothing about models, Ray or storage.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

VerifyFactor = Callable[[int], float]  # L -> v(L), a verify pass over L + 1 positions in target steps


class Counted(Protocol):
    draft_len: int
    target_forwards: int
    draft_forwards: int


def unit_verify(_: int) -> float:
    """v(L) = 1: every target forward costs one step (where no verify pass was timed, e.g. on vLLM)."""
    return 1.0


def verify_cost(verify_factor: VerifyFactor | float, draft_len: int) -> float:
    """What one target forward of a run at ``draft_len`` costs: 1 for target-only decoding, else v(L)."""
    if not draft_len:
        return 1.0
    return float(verify_factor(draft_len)) if callable(verify_factor) else float(verify_factor)


def modelled_cost(run: Counted, cost_ratio: float, verify_factor: VerifyFactor | float = unit_verify) -> float:
    """A run's decode cost in target-step units: v(L) * target forwards + c * draft forwards."""
    return verify_cost(verify_factor, run.draft_len) * run.target_forwards + cost_ratio * run.draft_forwards


def tokens_per_cost(records: Iterable[Any], cost_ratio: float, verify_factor: VerifyFactor | float = unit_verify
                    ) -> float:
    """Σ tokens / Σ modelled cost over ``records`` (a ratio of sums); NaN for no cost."""
    records = list(records)
    cost = sum(modelled_cost(r, cost_ratio, verify_factor) for r in records)
    return sum(r.tokens for r in records) / cost if cost > 0 else math.nan


def speedup_vs_target_only(tokens: int, run: Counted, cost_ratio: float,
                           verify_factor: VerifyFactor | float = unit_verify) -> float:
    """One run's modelled speed over target-only decoding: its tokens per cost (target-only: 1); 0 for no cost."""
    cost = modelled_cost(run, cost_ratio, verify_factor)
    return tokens / cost if cost > 0 else 0.0


def ceiling(draft_len: int, cost_ratio: float, verify_factor: VerifyFactor | float = unit_verify) -> float:
    """Tokens per cost of a rule that accepts every draft token at ``draft_len``: (L + 1) / (v(L) + c L)."""
    return (draft_len + 1) / (verify_cost(verify_factor, draft_len) + cost_ratio * draft_len)


@dataclass(frozen=True)
class CostModel:
    """c and v(L) as one value: the cost of a run on this pair and machine. ``verify_s``: a calibration's
    verify-pass seconds per positions (L + 1) and ``target_step_s`` its one-token step (v(L) interpolated
    linearly between them, as ``workers.models.calibrate.CostProfile``); without them v(L) = 1."""

    cost_ratio: float
    verify: VerifyFactor = field(default=unit_verify, compare=False)

    @classmethod
    def from_profile(cls, profile: Mapping[str, Any], cost_ratio: float | None = None,
                     verify_factor: float | None = None) -> CostModel:
        """From an actor's ``profile()`` (a calibration's figures); ``cost_ratio`` overrides its c (``--cost-ratio``),
        ``verify_factor`` its v(L) with one v at every L (``--verify-factor``)."""
        c = float(profile["cost_ratio"] if cost_ratio is None else cost_ratio)
        if verify_factor is not None:
            v = float(verify_factor)
            return cls(c, lambda _: v)
        if not profile.get("verify_s"):
            return cls(c)  # no timed verify passes (vLLM engine): the plain count
        from workers.models.calibrate import CostProfile

        data = {k: v for k, v in profile.items() if k != "cost_ratio"}
        return cls(c, CostProfile(**data).verify_factor)

    def verify_factor(self, draft_len: int) -> float:
        return self.verify(draft_len)

    def cost(self, run: Counted) -> float:
        return modelled_cost(run, self.cost_ratio, self.verify)

    def tokens_per_cost(self, records: Iterable[Any]) -> float:
        return tokens_per_cost(records, self.cost_ratio, self.verify)

    def ceiling(self, draft_len: int) -> float:
        return ceiling(draft_len, self.cost_ratio, self.verify)
