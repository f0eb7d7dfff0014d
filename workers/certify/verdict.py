"""A budget's verdict: **certified** (the drop is shown below b), **refuted** (shown above b) or **undecided**.

Certification is ``decide``'s. Refutation is its mirror, a claim with its own error accounting: a rule refuted at
budget b has a true paired drop above b, wrongly so with probability at most alpha. On the confirmation items of
the candidate that failed a budget's certification (the first of its fixed sequence, the one that decides the
budget), over the same look plan:

The scores are the items actually observed, the longest prefix of the fixed order both arms have records for
(``workers.results.evidence.refutation_pairs``): never the losses certification books past a futility stop, and a
failed item filled in against refutation (reference wrong, candidate right).

- **right/wrong scores**: half of alpha goes to the exact unconditional test of H0: drop <= b
  (``workers.certify.exact.refute_paired``, its level checked by exact enumeration at every n) at each planned look
  whose items are all here, look k at that half times the share of alpha the plan spends at k (a union bound over
  the looks: P(refuted at some look | drop <= b) <= the half, whichever stopping rule ended the confirmation early,
  since stopping without refuting only removes chances); the other half to the anytime-valid betting test the
  futility stop uses (``decide.first_prune``: P(it ever crosses | drop <= b) <= its level, at any item count, so a
  confirmation cut short by futility mid-look can still be refuted). P(refuted | drop <= b) <= alpha in all.
- **bounded scores** (MT-bench): the betting test alone, at the same half of alpha (the other half unspent).

The confirmation's futility stop runs that same betting test at that same level (:func:`futility_level`) against
the largest budget whose candidate list holds the candidate, on the same observed prefix: a futility stop at that
budget *is* its refutation by the betting half, unless an item failed (a failed item counts against refuting and
turns the betting half off). At a smaller budget the refutation is decided afresh on the same items.

The statement is per budget, at the alpha that budget is confirmed at (``--joint``'s share where given): the
budgets are refuted on the same items, and refutation is not nested in b, so several refuted budgets carry their
errors side by side. A resumed attempt keeps its first decision (``sweep.attempt.prior_refusal``): a re-decision
cannot refute what was left undecided. A refutation is about the candidate tested, not about every rule of the
family: "this rule, at these knobs, loses more than b". Knows scores, look plans and alpha; nothing about records
or the sweep.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from workers.certify.decide import CERTIFIED, REFUTED, UNDECIDED, verdict_of  # noqa: F401 - verdict.* names too

EXACT_SHARE = 0.5  # of a refutation's alpha, right/wrong scores: the exact test at the looks; the rest: the betting test
GATE_EXIT = {CERTIFIED: 0, REFUTED: 10, UNDECIDED: 11}  # jobs/sweep.py --gate: a deployment's CI reads these


def futility_level(alpha: float) -> float:
    """The level of a confirmation's futility stop at confirmation ``alpha``: the refutation's betting half, so
    that the stop and the refutation are one anytime-valid test (stopping for futility never costs certification
    anything, whatever its level: it only gives up chances to certify)."""
    return alpha * (1.0 - EXACT_SHARE)


@dataclass(frozen=True)
class Refutation:
    """Whether a candidate's drop is shown above ``budget`` at ``alpha``, and by what."""

    refuted: bool
    budget: float
    alpha: float
    n: int  # the items the deciding test saw (all the candidate's paired items where nothing refuted)
    method: str  # "exact-unconditional" (at a look), "betting" (anytime-valid), or "none"
    p_value: float = math.nan  # the exact test's, at the look that refuted (or the last look tested)
    level: float = math.nan  # the level that test was held to at that look
    look: int = 0  # the look that refuted (exact), 0 otherwise
    looks: int = 1
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in asdict(self).items()}


def refutation(reference: Sequence[float], trial: Sequence[float], plan: Any, budget: float,
               alpha: float, imputed: int = 0) -> Refutation:
    """Is the paired drop of ``trial`` against ``reference`` (per-item scores in the confirmation's fixed order,
    every one observed: ``workers.results.evidence.refutation_pairs``) shown above ``budget`` at ``alpha``? ``plan``: the confirmation's
    ``sequential.LookPlan`` (its sizes and the share of alpha each look spends). ``imputed``: failed items filled in
    against refutation; the exact test's region only grows with losses and shrinks with wins, so filling
    them against refutation keeps its level, but the betting test's stakes depend on the path, so with any imputed
    item it is skipped (its half of alpha unspent). See the module for the error accounting."""
    from workers.certify.decide import _check_alpha, _paired, first_prune
    from workers.certify.refute import refute_paired

    _check_alpha(alpha)
    if not 0.0 < budget < 1.0:
        raise ValueError(f"budget must be in (0, 1), got {budget}")
    ref, tri = _paired(reference, trial)
    binary = all(v in (0.0, 1.0) for v in ref + tri)
    exact_alpha = alpha * EXACT_SHARE if binary else 0.0
    looks = len(plan.sizes)
    last: tuple[int, float, float] | None = None
    if binary:
        shares = [s / sum(plan.shares) for s in plan.shares]
        for k, (n, share) in enumerate(zip(plan.sizes, shares, strict=True), start=1):
            if n > len(ref):
                break
            lost = sum(r > t for r, t in zip(ref[:n], tri[:n], strict=True))
            won = sum(t > r for r, t in zip(ref[:n], tri[:n], strict=True))
            level = exact_alpha * share
            if level <= 0.0:
                continue
            test = refute_paired(lost, won, n, budget, level)
            last = (k, test.p_value, level)
            if test.refuted:
                return Refutation(True, budget, alpha, n, "exact-unconditional", test.p_value, level, k, looks,
                                  f"refuted: exact test of drop <= {budget:g} p = {test.p_value:.3g} <= {level:.3g} "
                                  f"at look {k} of {looks} ({lost} lost / {won} won of the first {n} items, as observed; "
                                  f"half of this budget's alpha {alpha:g} to this test, split over the looks)")
    bet_alpha = futility_level(alpha)
    crossed = first_prune(ref, tri, budget, bet_alpha) if ref and not imputed else None
    if crossed is not None:
        return Refutation(True, budget, alpha, crossed, "betting", math.nan, bet_alpha, 0, looks,
                          f"refuted: the anytime-valid betting test of drop <= {budget:g} crossed 1/{bet_alpha:g} "
                          f"after {crossed} observed items (half of this budget's alpha {alpha:g})")
    k, p, level = last if last is not None else (0, math.nan, math.nan)
    tested = f"the exact test's p = {p:.3g} > {level:.3g} at look {k} of {looks}; " if last is not None else \
        "no look's items were all observed; "
    betting = (f"the betting test not run ({imputed} failed or missing item(s) among {len(ref)})" if imputed else
               f"the betting test never crossed 1/{bet_alpha:g} in {len(ref)} items")
    return Refutation(False, budget, alpha, len(ref), "none", p, level, 0, looks, f"not refuted: {tested}{betting}")

