"""Error paid across attempts: the attempts on one ledger key form a family that spends alpha.

A confirmation attempt tests its budgets on items no earlier attempt used. Nothing stops a user from opening
attempts on fresh items until one certifies, and 20 attempts each at alpha 0.05 make a wrong certificate likely
(1 - 0.95^20 = 64% where every rule sits at its budget). So the k-th attempt on a (benchmark, pair) is tested at

    alpha_k = alpha * 2^-k          (k = 1, 2, ...; sum over all k < alpha)

where ``alpha`` is the family's alpha per budget, fixed by its first attempt (a later attempt that states more is
tested at the family's; with ``--joint``, alpha divided among the budgets first). The number k is the attempt's
place in its family, given by the ledger when the attempt opens (``workers.results.ledger``: unique per family
by a database constraint) and never changed.

Why P(any certificate of a budget b fixed in advance is wrong, over the family) <= alpha: attempts use disjoint
items, and alpha_k is fixed when attempt k opens. Given everything before it (which candidates, budgets, n and
looks it uses, chosen after earlier verdicts), attempt k's items are fresh, so its test - a fixed sequence of
exact tests at alpha_k, group-sequential or not - wrongly certifies b with conditional probability at most
alpha_k (the exact test's size is largest at drop = b: Tango's Z_b rises with each loss and falls with each
win, so turning ties into losses only shrinks every look's region). By the union bound, P(any wrong) <=
sum_k E[P(wrong at k | before k)] <= sum_k alpha_k < alpha. :func:`attempt_size` computes an attempt's exact
size by enumeration (sup over the nuisance on the exact module's grid), and :func:`family_error` the
probability 1 - prod(1 - s_k) for a FIXED sequence of designs: an illustration that the levels bite, checked in
``tests/workers/certify/test_family.py`` for 10 attempts at this project's sizes; under adaptive designs the
union bound is the argument. What it assumes: the items of attempt k were not evaluated outside the ledger
before it opened (a search-only study or ``jobs.evaluate`` on the confirmation split, or records of another
drafter with the same target, are outside what the ledger sees) and one ledger (plus the shipped history)
holds the family; ``docs/design.md`` lists these limits.

The earliest attempts on the shipped pair were made before the family existed, at alpha 0.05 each; they keep
their place in the family (the ledger numbers them in the shipped history's order) and are re-decided at the
level it gives them (``docs/design.md``). Knows levels, sizes and probabilities; nothing about ledgers or models.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

SPENDING = "alpha * 2^-k (the k-th attempt on this benchmark and pair)"


def family_alpha(alpha: float, number: int) -> float:
    """The level the ``number``-th attempt of a family tests each budget at, at family level ``alpha``."""
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    if int(number) != number or number < 1:
        raise ValueError(f"an attempt's number in its family is 1, 2, ..., got {number}")
    return float(alpha) * 2.0 ** -int(number)


def spent(alpha: float, attempts: int) -> float:
    """The alpha the first ``attempts`` attempts of a family spend in all (< alpha)."""
    return sum(family_alpha(alpha, k) for k in range(1, attempts + 1))


def attempt_size(n: int, looks: int, level: float, budget: float) -> float:
    """The exact size of one attempt's test of ``budget`` at ``level`` on ``n`` items with ``looks`` looks: the
    largest probability, over the nuisance (P(won), at drop = budget, where H0 is hardest to reject), that it
    certifies. Every outcome is enumerated (``workers.certify.exact`` for one look, the group-sequential
    plan's crossing probabilities for several)."""
    import numpy as np

    from workers.certify.exact import _nuisance_grid, type_one_error
    from workers.certify.sequential import crossing, look_plan

    grid = _nuisance_grid(float(budget))
    if looks <= 1:
        return float(np.max(type_one_error(n, budget, level, grid)))
    plan = look_plan(n, looks, level, budget=budget)
    if plan.thresholds is None:  # the union bound's looks: each an exact test at its share
        return min(1.0, sum(float(np.max(type_one_error(size, budget, share, grid)))
                            for size, share in zip(plan.sizes, plan.shares, strict=True)))
    return max(crossing(plan.sizes, plan.thresholds, budget, float(pw))[-1] for pw in grid)


def family_error(sizes: Sequence[float]) -> float:
    """P(any certificate of the family is wrong) at most, for a fixed sequence of attempts of exact sizes ``sizes``
    on disjoint items: 1 - prod(1 - s_k) (adaptive designs: the union bound, sum of the levels)."""
    return 1.0 - math.prod(1.0 - s for s in sizes)
