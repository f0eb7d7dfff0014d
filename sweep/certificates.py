"""What a budget's certificate says, as the chosen files, ``certification.json`` and MLflow record it, and the
figures beside it: the search's candidates, the certificate's fields, the confirmation's metrics under the
search's names, the noise-floor row (lossless against target-only on the same items) and, before confirmation,
each budget's outlook (the items its first candidate would need). Decides nothing: ``workers.certify.decide``
does; runs nothing: ``sweep.confirm`` does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from workers.certify.decide import Candidate, Certificate, DropBound, items_needed, order_candidates
from workers.certify.exact import METHOD as EXACT
from workers.certify.exact import exact_bound
from workers.certify.sequential import LookPlan
from workers.evaluation import Record
from workers.metrics.trial import score_of
from workers.results.evidence import bound_between


def candidates_from(frame: Any) -> list[Candidate]:
    """The search's COMPLETE trials as candidates (speed: the sweep's objective speedup)."""
    if frame is None or not len(frame):
        return []
    out = []
    for row in frame.iter_rows(named=True):
        if row.get("state") != "COMPLETE" or not math.isfinite(row.get("speedup") or math.nan):
            continue
        out.append(Candidate(key=f"trial-{row['trial']}", speed=float(row["speedup"]),
                             search_drop=float(row["accuracy_drop"]),
                             search_upper=float(row.get("accuracy_drop_upper", row["accuracy_drop"])),
                             payload=dict(row), search_discordance=float(row.get("discordance", math.nan))))
    return out


def certificate_fields(cert: Certificate, split: dict[str, Any], n_items: int,
                       counts: dict[str, dict[str, int]] | None = None, plan: LookPlan | None = None,
                       stopped: dict[str, int] | None = None, sources: dict[str, int] | None = None
                       ) -> dict[str, Any]:
    """What ``chosen/budget-<b>.json`` and the MLflow tags say about a budget's certificate; ``counts``
    (``Confirmation.counts``): each tested candidate's failed and missing items, by arm; ``plan`` and
    ``stopped``: the group-sequential design and where each candidate stopped on success; ``sources``: the
    confirmation items by source (the pool's composition as used, never a split's name alone)."""
    bound, counts = cert.bound, counts or {}
    shown = cert.chosen.key if cert.chosen else (cert.steps[0][0] if cert.steps else None)
    design = None if plan is None else {**plan.to_dict(), "look": None if bound is None else bound.look,
                                        "stopped_at": (stopped or {}).get(shown)}
    return {**counts.get(shown, {}), "sequential": design,
        "certified": bool(cert.certified), "verdict": cert.verdict, "alpha": cert.alpha, "reason": cert.reason,
        "refutation": None if cert.refutation is None else cert.refutation.to_dict(),
        "bound": None if bound is None else bound.upper, "drop": None if bound is None else bound.drop,
        "n": None if bound is None else bound.n, "discordance": None if bound is None else bound.discordance,
        "method": None if bound is None else bound.method, "items_needed": cert.items_needed,
        "p_value": None if bound is None or math.isnan(bound.p_value) else bound.p_value,
        "evidence": None if shown is None else f"evidence/{shown}.csv", "candidate": shown,
        "confirm_split": composition(sources or {}, n_items), "confirm_sources": sources,
        "confirm_items": n_items, "pool": split.get("pool"),
        "pool_sources": split.get("pool_sources"),
        "steps": [{"candidate": key, "passed": passed, **b.to_dict(), **counts.get(key, {})}
                  for key, b, passed in cert.steps],
    }


def verdict_word(cert: Certificate) -> str:
    """How a budget's decision reads in the log: CERTIFIED, REFUTED (the drop shown above it), REFUSED (the knobs
    showed no effect) or not certified (undecided)."""
    if cert.certified:
        return "CERTIFIED"
    if cert.reason.startswith("refused"):
        return "REFUSED"
    return "REFUTED" if cert.verdict == "refuted" else "not certified (undecided)"


def refutation_note(cert: Certificate) -> str:
    """The refutation's own sentence, where the budget was refuted ('' otherwise)."""
    return f"; {cert.refutation.reason}" if cert.verdict == "refuted" else ""


def composition(sources: dict[str, int], n_items: int) -> str:
    """How a certificate names its items: '120 held-apart items: gsm8k/test 18 + gsm8k/train 102'."""
    parts = " + ".join(f"{k} {v:,}" for k, v in sources.items())
    return f"{n_items:,} held-apart items" + (f": {parts}" if parts else "")


def confirm_metrics(bound: DropBound, speed: dict[str, float], records: dict[str, Record]) -> dict[str, float]:
    """One candidate's confirmation figures, under the same names as the search's (``confirm.<name>``
    next to ``search.<name>`` in MLflow, so the compare view lines them up)."""
    scores = [score_of(r) for r in records.values()]
    out = {"accuracy": sum(scores) / len(scores) if scores else math.nan, "accuracy_drop": bound.drop,
           "accuracy_drop_upper": bound.upper, "discordance": bound.discordance, "items": float(bound.n),
           "failures": float(sum(r.failed for r in records.values()))}
    # speed only as speed.<kind>_<per_token|per_answer> (ratios of sums): the search's speedup_vs_ar_* are
    # other definitions (a mean of per-item ratios, measured), so they never share a name
    out.update({f"speed.{k}": v for k, v in speed.items()})
    return out


def noise_floor_row(reference: dict[str, Record], lossless: dict[str, Record], alpha: float, draft_len: int,
                    budgets: Sequence[float] = ()) -> dict[str, Any]:
    """Lossless vs target-only on the confirmation items at ``draft_len``: its own row, never folded into
    another number. What it measures is the *discordance* (the share of items whose correctness differs,
    from numerics alone: the same rule, other kernels) and the *output divergence* (items whose tokens
    differ). Its one-sided bound mostly reflects n (zero discordance still bounds 53% at n = 4, 6% at
    n = 40), so it is not "the smallest budget that can be told from noise"; what the discordance does
    tell is how many items a certificate at each budget needs even for a lossless-like rule
    (``items_needed.<b>``, 80% power, normal approximation). ``drop_lo``/``drop_hi``: a two-sided
    (1 - alpha) exact interval for the lossless drop (each side the exact bound at alpha / 2)."""
    bound = bound_between(reference, lossless, alpha)
    keys = [k for k in reference if k in lossless]
    differ = sum(reference[k].output_token_ids != lossless[k].output_token_ids for k in keys)
    row: dict[str, Any] = {"draft_len": draft_len, "items": len(keys),
                           "output_divergence": differ / len(keys) if keys else math.nan,
                           "discordance": bound.discordance, **{f"bound.{k}": v for k, v in bound.to_dict().items()}}
    if keys and bound.method == EXACT:
        row["drop_hi"] = exact_bound(bound.losses, bound.wins, bound.n, alpha / 2)
        row["drop_lo"] = -exact_bound(bound.wins, bound.losses, bound.n, alpha / 2)
    if keys and math.isfinite(bound.discordance):
        d = max(bound.mean_sq, 1.0 / len(keys))  # zero seen is not zero: at least one item in n
        row.update({f"items_needed.{b:g}": items_needed(min(d, 1.0), b, 0.0, alpha) for b in budgets})
    return row


def pool_outlook(candidates: list[Candidate], budgets: Sequence[float], limit: int | None, pool: int,
                 used: int, alpha: float) -> list[dict[str, Any]]:
    """Before confirmation, per budget: the first candidate of its sequence, the items a certificate of it
    would need at its *search* discordance and drop (80% power, normal approximation: ``jobs.plan``
    gives the exact figure), and the smallest budget the whole pool could certify for it."""
    rows = []
    for budget in budgets:
        first = order_candidates(candidates, budget, limit=limit)[:1]
        if not first:
            rows.append({"budget": budget, "candidate": None})
            continue
        c = first[0]
        d = c.search_discordance
        if not math.isfinite(d):
            rows.append({"budget": budget, "candidate": c.key})
            continue
        drop = min(max(c.search_drop, 0.0), d)  # never plan on the candidate beating the reference
        d = min(max(d, abs(drop), 1e-6), 1.0)
        need = items_needed(d, budget, drop, alpha)
        lo, hi = max(drop, 0.0), 1.0  # the smallest budget whose plan fits in the pool
        while hi - lo > 1e-4:
            mid = (lo + hi) / 2
            plan = items_needed(d, mid, drop, alpha) if mid > drop else None
            lo, hi = (lo, mid) if plan is not None and plan <= pool else (mid, hi)
        rows.append({"budget": budget, "candidate": c.key, "search_discordance": d, "search_drop": drop,
                     "items_needed": need, "pool": pool, "used": used, "smallest_budget_for_pool": hi})
    return rows
