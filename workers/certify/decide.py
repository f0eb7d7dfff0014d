"""Certification: what it takes to say a rule's accuracy drop stays within a budget.

A budget b is certified when a test of "the paired drop (reference score - trial score, per item)
is at least b" is rejected at level alpha on a confirmation split the search never saw. This module
owns the statistics of that claim and nothing else: splits, bounds, early stopping, the
fixed-sequence confirmation and the sample-size planner. It knows per-item scores in [0, 1] and
candidates' keys and speeds; it knows nothing about models, Ray, Optuna, MLflow or where records
live (the sweep, the report and Serve call it; none of them decides feasibility).

Methods:
- right/wrong scores (GSM8K, MMLU, HumanEval, IFEval strict or loose: every per-item score is 0 or
  1): the exact unconditional test of ``workers.certify.exact`` (``certify_paired``), ordered by
  Tango's score statistic: its type-I error is <= alpha at every n and every nuisance value, checked
  by exact enumeration. The reported upper bound is the same test inverted.
- bounded scores (MT-bench similarity, or any score strictly between 0 and 1): a betting bound
  (Waudby-Smith & Ramdas 2023, predictable plug-in; ``workers.certify.bounds``), valid for any
  distribution on [0, 1]; needs about twice the items.
- early stopping: an anytime-valid betting test (confidence sequence; Waudby-Smith & Ramdas 2023,
  Howard et al. 2021) on the paired differences, checkable after every item without correction.
- group-sequential confirmation (``workers.certify.sequential``): a few looks on the fixed item order;
  look k certifies when Tango's Z_b on its items is within a threshold calibrated by exact enumeration
  so the error spent by look k stays within alpha * t^rho (or, uncalibrated, the exact test at the alpha
  the look spends: a union bound); the first look that passes certifies (:func:`sequential_bound`).
- several candidates per budget: fixed-sequence testing (Maurer et al. 1995; Westfall & Krishen
  2001): test in a pre-set order at full alpha, stop at the first failure; family-wise error <= alpha.
- planning: a normal approximation (n ~ 6.2 d / (b - drop)^2 at alpha = .05 and 80% power); it
  does not know the exact bound's or the betting bound's extra cost.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from workers.certify.bounds import betting_crossing, betting_upper, normal_plan
from workers.certify.exact import METHOD as EXACT
from workers.certify.exact import certify_paired, exact_bound

ALPHA = 0.05
# A budget's three verdicts, named here for ``workers.certify.verdict`` (which imports them: none imports back)
CERTIFIED, REFUTED, UNDECIDED = "certified", "refuted", "undecided"


def _json_float(value: float) -> float | None:
    return None if isinstance(value, float) and math.isnan(value) else value


@dataclass(frozen=True)
class DropBound:
    """A one-sided (1 - alpha) upper bound of the paired drop mean(reference - trial)."""

    method: str  # "exact-unconditional" (right/wrong), "betting" (bounded), "none" (n = 0)
    alpha: float
    n: int  # paired items (both arms present)
    drop: float  # point estimate mean(reference - trial); nan if n == 0
    upper: float  # the bound; 1.0 (the largest possible drop) when n == 0
    losses: int  # items where reference > trial
    wins: int  # items where trial > reference
    discordance: float  # (losses + wins) / n; nan if n == 0
    mean_sq: float = math.nan  # mean((reference - trial)^2): the planner's d (= discordance for right/wrong)
    budget: float = math.nan  # set once tested against a budget (fixed_sequence): the budget ...
    p_value: float = math.nan  # ... and the exact test's p-value there (right/wrong; nan for betting)
    look: int = 1  # group-sequential confirmation: the look this bound was taken at (alpha: that look's level)
    looks: int = 1  # ... of this many planned looks (1: a fixed-n test on every item)
    z: float = math.nan  # calibrated looks: Tango's Z_b of these counts at the budget ...
    z_max: float = math.nan  # ... and the look's threshold: certified iff z <= z_max (the calibrated region)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe: nan becomes None."""
        return {k: _json_float(v) for k, v in asdict(self).items()}


def _check_alpha(alpha: float, name: str = "alpha") -> None:
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"{name} must be in (0, 1), got {alpha}")


def _paired(reference: Sequence[float], trial: Sequence[float]) -> tuple[list[float], list[float]]:
    ref, tri = [float(v) for v in reference], [float(v) for v in trial]
    if len(ref) != len(tri):
        raise ValueError(f"reference and trial must be paired: {len(ref)} reference scores vs {len(tri)} trial scores")
    for arm, values in (("reference", ref), ("trial", tri)):
        for i, v in enumerate(values):
            if not 0.0 <= v <= 1.0:  # also catches nan
                raise ValueError(f"{arm} score {v} at item {i} is outside [0, 1] (a failed item scores 0 in its arm)")
    return ref, tri


def drop_bound_from_counts(losses: int, wins: int, n: int, alpha: float = ALPHA) -> DropBound:
    """The right/wrong bound from counts alone: ``losses`` items the reference got right and the
    trial wrong, ``wins`` the reverse, out of ``n`` paired items."""
    _check_alpha(alpha)
    if min(losses, wins, n) < 0 or losses + wins > n:
        raise ValueError(f"counts must satisfy 0 <= losses + wins <= n, got losses={losses}, wins={wins}, n={n}")
    if n == 0:
        return DropBound("none", alpha, 0, math.nan, 1.0, 0, 0, math.nan)
    d = (losses + wins) / n
    return DropBound(EXACT, alpha, n, (losses - wins) / n, exact_bound(losses, wins, n, alpha), losses, wins, d, d)


def drop_bound(reference: Sequence[float], trial: Sequence[float], alpha: float = ALPHA, *,
               binary: bool | None = None) -> DropBound:
    """One-sided (1 - alpha) upper bound of the true paired drop E[reference - trial].

    ``reference`` and ``trial`` are per-item scores in [0, 1], same items in the same order.
    ``binary=None`` picks the right/wrong bound when every score is 0 or 1, else the betting bound.
    Right/wrong: the exact unconditional test (``workers.certify.exact``) inverted: the smallest budget
    it would certify, valid at every n.
    Bounded: Waudby-Smith & Ramdas's betting bound. n = 0 gives upper = 1.0.
    """
    _check_alpha(alpha)
    ref, tri = _paired(reference, trial)
    is_binary = all(v in (0.0, 1.0) for v in ref + tri)
    if binary is None:
        binary = is_binary
    elif binary and not is_binary:
        raise ValueError("binary=True but some scores are neither 0 nor 1")
    diffs = [r - t for r, t in zip(ref, tri, strict=True)]
    losses, wins = sum(d > 0 for d in diffs), sum(d < 0 for d in diffs)
    if binary:
        return drop_bound_from_counts(losses, wins, len(diffs), alpha)
    n = len(diffs)
    if n == 0:
        return DropBound("none", alpha, 0, math.nan, 1.0, 0, 0, math.nan)
    upper = 2.0 * betting_upper([(1.0 + d) / 2.0 for d in diffs], alpha) - 1.0
    return DropBound("betting", alpha, n, sum(diffs) / n, min(upper, 1.0), losses, wins, (losses + wins) / n,
                     sum(d * d for d in diffs) / n)


def sequential_bound(reference: Sequence[float], trial: Sequence[float], plan: Any, budget: float) -> DropBound:
    """The deciding look of a group-sequential confirmation (``plan``: a ``sequential.LookPlan``): the bound on
    the first n_k items at the look's level alpha_k, tested against ``budget`` (:func:`passes`), for the first
    look that certifies; if none does, the last look whose n_k items are all here (or, with fewer items than
    the first look, every item at the first look's level). One look is the fixed-n test at ``plan.alpha``.

    Which bound every look uses is decided once, from all the scores given: right/wrong scores take the exact
    test at the plan's levels (calibrated jointly for the exact test); any other score makes every look a
    betting bound at the alpha its look spends (spent_k - spent_{k-1}, summing to alpha: a union bound), since
    the calibrated levels hold only for the exact test and add up to more than alpha."""
    ref, tri = _paired(reference, trial)
    binary = all(v in (0.0, 1.0) for v in ref + tri)
    calibrated = plan.thresholds is not None and plan.budget == budget and len(plan.sizes) > 1
    shares = plan.shares

    def look(k: int, n: int) -> DropBound:
        level = max(plan.alphas[k - 1] if binary else shares[k - 1], 1e-12)  # 0: nothing may pass at this look
        bound = replace(passes(drop_bound(ref[:n], tri[:n], level, binary=binary), budget), look=k,
                        looks=len(plan.sizes))
        if calibrated and bound.method == EXACT:
            from workers.certify.exact import score_z

            bound = replace(bound, z=float(score_z(bound.losses, bound.wins, bound.n, budget)),
                            z_max=plan.thresholds[k - 1])
        return bound

    taken: DropBound | None = None
    for k, n in enumerate(plan.sizes, start=1):
        if n > len(ref):
            break
        taken = look(k, n)
        if certifies(taken):
            return taken
    return taken if taken is not None else look(1, len(ref))


def first_prune(reference: Sequence[float], trial: Sequence[float], budget: float,
                alpha: float = ALPHA) -> int | None:
    """The number of items after which ``prune_test`` first says prune, or None if it never does."""
    _check_alpha(alpha)
    if not 0.0 <= budget < 1.0:
        raise ValueError(f"budget must be in [0, 1), got {budget}")
    ref, tri = _paired(reference, trial)
    return betting_crossing([(1.0 + r - t) / 2.0 for r, t in zip(ref, tri, strict=True)], (1.0 + budget) / 2.0, alpha)


def prune_test(reference: Sequence[float], trial: Sequence[float], budget: float, alpha: float = ALPHA) -> bool:
    """True when the trial's true drop exceeds ``budget`` with confidence, by an anytime-valid
    betting test on the paired differences in the order given: P(prune ever | drop <= budget)
    <= alpha however often it is called, so the sweep may call it after every record. The order
    must not depend on the outcomes (pass items by index, not by completion time, which can
    correlate with correctness)."""
    return first_prune(reference, trial, budget, alpha) is not None


def items_needed(discordance: float, budget: float, drop: float = 0.0, alpha: float = ALPHA,
                 power: float = 0.8) -> int | None:
    """Paired items a certificate of ``budget`` needs with probability ``power`` when the true drop
    is ``drop`` and the discordance (share of items whose correctness differs; for bounded scores the
    mean squared paired difference) is ``discordance``. A normal-approximation plan of the score test:
    n = (z_{1-a} sqrt(max(d, b) - b^2) + z_power sqrt(d - drop^2))^2 / (b - drop)^2, about
    6.2 d / (b - drop)^2 at alpha = .05 and 80% power. None when drop >= budget (no n suffices)."""
    _check_alpha(alpha)
    _check_alpha(power, "power")
    if not 0.0 <= discordance <= 1.0:
        raise ValueError(f"discordance must be in [0, 1], got {discordance}")
    if not 0.0 < budget <= 1.0:
        raise ValueError(f"budget must be in (0, 1], got {budget}")
    if not -1.0 <= drop <= 1.0:
        raise ValueError(f"drop must be in [-1, 1], got {drop}")
    return normal_plan(discordance, budget, drop, alpha, power)


@dataclass(frozen=True)
class Candidate:
    """A search-split trial offered for confirmation."""

    key: str  # the trial's identity, e.g. "trial-7"
    speed: float  # search-split speedup (higher is faster)
    search_drop: float  # search-split drop point estimate
    search_upper: float  # search-split upper bound (orders candidates)
    payload: dict = field(default_factory=dict)  # anything the caller wants back
    search_discordance: float = math.nan  # search-split discordance: what a plan for it starts from

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "speed": self.speed, "search_drop": _json_float(self.search_drop),
                "search_upper": _json_float(self.search_upper),
                "search_discordance": _json_float(self.search_discordance), "payload": self.payload}


def _safety(c: Candidate) -> tuple[float, float]:
    return (c.search_upper, c.search_drop)


def order_candidates(candidates: Sequence[Candidate], budget: float, limit: int | None = None) -> list[Candidate]:
    """The search split's candidates for ``budget``, in confirmation order.

    Kept: feasible on the search split (search_drop <= budget + 1e-9) and on the Pareto front of
    the feasible ones (dropped if another feasible candidate is at least as fast and at least as
    safe, strictly better in one; safety = (search_upper, search_drop), lower is safer).
    Order: safest first: ascending search_upper, then search_drop, then descending speed, then key
    (on the front this is also slowest first). ``limit`` keeps the first ``limit`` of that order.
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    feasible = [c for c in candidates if c.search_drop <= budget + 1e-9]
    front = [c for c in feasible if not any(
        o.speed >= c.speed and _safety(o) <= _safety(c) and (o.speed > c.speed or _safety(o) < _safety(c))
        for o in feasible)]
    front.sort(key=lambda c: (c.search_upper, c.search_drop, -c.speed, c.key))
    return front if limit is None else front[:limit]


@dataclass
class Certificate:
    """The outcome of confirming one budget."""

    budget: float
    alpha: float
    certified: bool
    chosen: Candidate | None  # the fastest candidate that passed before the first failure
    bound: DropBound | None  # chosen's confirmation bound; if none passed, the first tested's
    steps: list[tuple[str, DropBound, bool]]  # (key, bound, passed) in test order
    items_needed: int | None  # not certified: items a certificate would need at the first tested's d and drop
    reason: str  # one sentence: why certified or not
    refutation: Any = None  # not certified: whether the tested candidate's drop is shown above the budget
    # (``workers.certify.verdict.Refutation``; None where nothing was tested)

    @property
    def verdict(self) -> str:
        """certified, refuted or undecided (``workers.certify.verdict``)."""
        return verdict_of(self.certified, self.refutation)

    def to_dict(self) -> dict[str, Any]:
        return {"budget": self.budget, "alpha": self.alpha, "certified": self.certified, "verdict": self.verdict,
                "refutation": self.refutation.to_dict() if self.refutation is not None else None,
                "chosen": self.chosen.to_dict() if self.chosen else None,
                "bound": self.bound.to_dict() if self.bound else None,
                "steps": [{"key": k, "bound": b.to_dict(), "passed": p} for k, b, p in self.steps],
                "items_needed": self.items_needed, "reason": self.reason}


def passes(bound: DropBound, budget: float) -> DropBound:
    """``bound`` tested against ``budget`` at its alpha: returned with ``budget`` and, for right/wrong
    scores, the exact test's ``p_value`` filled in. Passed = p_value <= alpha (right/wrong:
    :func:`workers.certify.exact.certify_paired`, the decision) or upper <= budget (betting, valid for
    any n); never with no paired item."""
    if bound.n == 0:
        return replace(bound, budget=budget)
    if bound.method == EXACT:
        test = certify_paired(bound.losses, bound.wins, bound.n, budget, bound.alpha)
        return replace(bound, budget=budget, p_value=test.p_value)
    return replace(bound, budget=budget)


def certifies(bound: DropBound) -> bool:
    """Whether a bound returned by :func:`passes` certifies its budget."""
    if bound.n == 0 or math.isnan(bound.budget):
        return False
    if not math.isnan(bound.z_max):  # a calibrated look: exactly the region its error was computed for
        return bound.z <= bound.z_max
    if bound.method == EXACT:
        return bound.p_value <= bound.alpha
    return bound.upper <= bound.budget


def bound_text(bound: DropBound, value: str, single: str = "confirmation upper bound") -> str:
    """``bound.upper`` (written ``value``) named for what it is. One look: the confirmation's upper bound
    (``single``). A look of a group-sequential plan: the fixed-n bound on that look's items at that look's
    level; with calibrated thresholds that level is nominal (the levels add up to more than alpha), so the
    figure describes the look and is not a bound valid under the plan; with the union bound over looks, it
    is at the alpha the look spends."""
    if bound.looks <= 1:
        return f"{single} {value}"
    if math.isnan(bound.z_max):
        return f"fixed-n upper bound {value} at the alpha its look spends"
    return (f"fixed-n upper bound {value} at its look's nominal level (a description, not a bound valid under "
            f"the {bound.looks}-look plan)")


def _evidence(bound: DropBound) -> str:
    """How a tested bound reads in a reason: the exact test's p-value with its bound, or the betting bound."""
    upper = bound_text(bound, f"{bound.upper:.4f}")
    look = "" if bound.looks == 1 else f" at look {bound.look} of {bound.looks}" + (
        " (the alpha it spends)" if math.isnan(bound.z_max) else f", Z_b {bound.z:.3f} vs its threshold {bound.z_max:.3f}")
    if bound.method == EXACT:
        return f"exact test p = {bound.p_value:.3g} (alpha {bound.alpha:g}{look}), {upper},"
    if bound.looks == 1:
        return upper
    return f"{upper} (look {bound.look} of {bound.looks}" + (
        ")" if math.isnan(bound.z_max) else f", Z_b {bound.z:.3f} vs its threshold {bound.z_max:.3f})")


def fixed_sequence(ordered: Sequence[Candidate], bound_of: Callable[[Candidate], DropBound], budget: float,
                   alpha: float = ALPHA) -> Certificate:
    """Confirm ``ordered`` (from ``order_candidates``) in that order, each at the full ``alpha``
    (:func:`passes`: the exact test for right/wrong scores, the betting bound otherwise); stop at the
    first failure. Family-wise error <= alpha, so the chosen candidate's true drop exceeds the budget
    with probability <= alpha (per budget: each budget is its own sequence). ``bound_of`` runs
    the confirmation evaluation and is called lazily: never for a candidate after the first failure."""
    _check_alpha(alpha)
    steps: list[tuple[str, DropBound, bool]] = []
    passed: list[tuple[Candidate, DropBound]] = []
    for cand in ordered:
        bound = passes(bound_of(cand), budget)
        ok = certifies(bound)
        steps.append((cand.key, bound, ok))
        if not ok:
            break
        passed.append((cand, bound))
    if not steps:
        return Certificate(budget, alpha, False, None, None, [], None,
                           f"no candidate: no search-split trial was feasible at budget {budget:g}")
    if passed:
        chosen, bound = max(passed, key=lambda cb: cb[0].speed)  # ties: the earlier (safer) one
        tail = f"; {steps[-1][0]} failed next" if not steps[-1][2] else ""
        return Certificate(budget, alpha, True, chosen, bound, steps, None,
                           f"{chosen.key}'s {_evidence(bound)} <= budget {budget:g} at alpha {alpha:g} on "
                           f"{bound.n} items ({len(passed)} of {len(steps)} tested passed{tail})")
    first = steps[0][1]
    need = None
    lead = ordered[0]
    if math.isfinite(lead.search_discordance):  # plan from the search, not from the confirmation that failed
        d, drop, where = lead.search_discordance, lead.search_drop, "search"
    elif first.n:
        d, drop, where = first.mean_sq, first.drop, "confirmation"
    else:
        d = drop = math.nan
    if not math.isfinite(d):
        plan = "; no paired item was confirmed"
    else:
        drop = min(max(drop, 0.0), 1.0)  # an observed gain is not planned on: it may be noise
        need = items_needed(min(max(d, abs(drop)), 1.0), budget, drop, alpha)
        plan = (f"; about {need} items would certify it with 80% power at its {where} discordance {d:.3f} and "
                f"drop {drop:.4f} (normal approximation)" if need is not None else
                f"; its {where} drop {drop:.4f} is at or above the budget, so no sample size would")
    return Certificate(budget, alpha, False, None, first, steps, need,
                       f"{steps[0][0]}'s {_evidence(first)} > budget {budget:g} at alpha {alpha:g} on "
                       f"{first.n} items{plan}")


def split_ids(ids: Sequence[str], seed: int, fraction: float = 0.5) -> tuple[list[str], list[str]]:
    """Seeded split of item ids into (search, confirm): disjoint, covering every id, in input order.

    An id goes to search when sha256(f"{seed}:{id}") read as a number in [0, 1) is below
    ``fraction``: it depends on that id alone, so adding or reordering items moves no other.
    """
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"fraction must be in (0, 1), got {fraction}")
    seen: set[str] = set()
    search: list[str] = []
    confirm: list[str] = []
    for item in ids:
        if item in seen:
            raise ValueError(f"item id {item!r} appears twice")
        seen.add(item)
        digest = hashlib.sha256(f"{seed}:{item}".encode()).digest()
        (search if int.from_bytes(digest[:8], "big") / 2.0**64 < fraction else confirm).append(item)
    return search, confirm


def shown_step(certification: dict[str, Any]) -> dict[str, Any]:
    """The step of a certificate's fields (``sweep.certificates.certificate_fields``) whose candidate the certificate
    states (the chosen one, whose evidence file it names; the first tested where none was chosen), or {} where none
    was tested. A fixed sequence that certifies more than one candidate chooses the last, not ``steps[0]``."""
    steps = certification.get("steps") or []
    key = certification.get("candidate")
    if key is None and certification.get("evidence"):  # a certificate written before it named its candidate
        key = certification["evidence"].rsplit("/", 1)[-1].removesuffix(".csv")
    return next((s for s in steps if s.get("candidate") == key), steps[0] if steps else {})


def verdict_of(certified: bool, refuted: Any) -> str:
    """certified, refuted (``refuted``: a ``workers.certify.verdict.Refutation`` that refutes) or undecided."""
    return CERTIFIED if certified else REFUTED if refuted is not None and refuted.refuted else UNDECIDED
