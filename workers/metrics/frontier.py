"""What limits a lossy rule's speed over lossless on this pair, measured from a sweep's own records.

A certificate says a rule is safe at a budget; the frontier says what that safety buys and what bounds it:

- **lossless at every L** (its replayed records on the search items): the acceptance length (tokens per
  target forward), the share of draft tokens it accepts, its modelled tokens per cost and its speed over
  target-only; the best L is the baseline every lossy rule is measured against;
- **the ceiling at every L**: a rule that accepted every draft token would emit L + 1 tokens per round at the
  cost of one verify and L draft forwards, so no rule at that L beats ``(L + 1) / (v(L) + c L)`` tokens per
  cost; over the best lossless that is the most any acceptance rule can buy on this pair at this cost ratio;
- **the search**: every finished trial's modelled speed over the best lossless against its paired drop on the
  search items (lost and won items, discordance), and the Pareto front of the two (descriptions: the search's
  figures decide nothing; the certificates do, on other items);
- **the budgets**: each budget's certificate, its speed over the best lossless and over target-only, modelled
  and measured like for like, and whether the model agreed with the measurement (``workers.metrics.speed``);
- **where the lost items are**: each confirmed candidate's lost items and where its run first left the
  target-only output.

The numbers are this module's; ``dashboards.frontier`` writes them beside the sweep's certificates
(``report/frontier.json`` and ``frontier.md``), exported with them (``jobs.results export``). Knows records,
trial rows and the cost model; nothing about Optuna or Ray.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from typing import Any

from workers.certify.decide import shown_step
from workers.evaluation import Record
from workers.metrics.cost import ceiling, tokens_per_cost


def lossless_rows(lossless: Mapping[int, Mapping[str, Record]], cost_ratio: float,
                  verify_factor: Callable[[int], float]) -> list[dict[str, Any]]:
    """Per L: items, acceptance length, accepted share of draft tokens, tokens per modelled cost and speed over
    target-only (one target forward per token: tokens per cost 1), over the items every L holds unfailed."""
    shared = None
    for recs in lossless.values():
        ok = {k for k, r in recs.items() if not r.failed}
        shared = ok if shared is None else shared & ok
    rows = []
    for draft_len, recs in sorted(lossless.items()):
        use = [recs[k] for k in sorted(shared or ())]
        forwards = sum(r.target_forwards for r in use)
        drafted = sum(r.num_draft_tokens for r in use)
        tpc = tokens_per_cost(use, cost_ratio, verify_factor) if use else math.nan
        rows.append({"draft_len": draft_len, "items": len(use),
                     "acceptance_length": sum(r.tokens for r in use) / forwards if forwards else math.nan,
                     "accepted_share": sum(r.num_accepted_tokens for r in use) / drafted if drafted else math.nan,
                     "tokens_per_cost": tpc, "vs_target_only": tpc})
    return rows


def ceiling_rows(lengths: list[int], cost_ratio: float, verify_factor: Callable[[int], float],
                 best: float) -> list[dict[str, Any]]:
    """Per L: the tokens per cost of a rule that accepts every draft token, and that over the best lossless."""
    rows = []
    for n in lengths:
        tpc = ceiling(n, cost_ratio, verify_factor)
        rows.append({"draft_len": n, "acceptance_length": n + 1, "tokens_per_cost": tpc,
                     "vs_best_lossless": tpc / best if best and math.isfinite(best) else math.nan})
    return rows


def trial_rows(frame: Any) -> list[dict[str, Any]]:
    """Every finished trial, fastest over the best lossless first; lost and won items from its drop and
    discordance on its items (drop = (lost - won) / n, discordance = (lost + won) / n)."""
    rows = []
    for row in frame.iter_rows(named=True) if frame is not None and len(frame) else []:
        n, drop, disc = row["items"], row["accuracy_drop"], row["discordance"]
        lost = round(n * (disc + drop) / 2) if all(map(math.isfinite, (drop, disc))) else None
        won = round(n * (disc - drop) / 2) if lost is not None else None
        params = json.loads(row["params"])
        knobs = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in sorted(params.items()))
        rows.append({"trial": row["trial"], "rule": f"{row['family']} ({knobs})", "draft_len": row["draft_len"],
                     "state": row["state"], "items": n, "lost": lost, "won": won, "drop": drop, "discordance": disc,
                     "acceptance_length": row["mean_acceptance_length"],
                     "vs_best_lossless": row["speedup_vs_best_lossless_modelled"],
                     "vs_target_only": row["speedup_vs_ar_modelled"]})
    rows.sort(key=lambda r: -(r["vs_best_lossless"] if math.isfinite(r["vs_best_lossless"]) else -math.inf))
    return rows


def pareto(rows: list[dict[str, Any]]) -> list[int]:
    """The finished (not pruned) trials no other beats on both speed over the best lossless and drop."""
    done = [r for r in rows if r["state"] == "COMPLETE" and math.isfinite(r["vs_best_lossless"])
            and math.isfinite(r["drop"])]
    front = []
    for r in done:
        if not any(o["vs_best_lossless"] >= r["vs_best_lossless"] and o["drop"] <= r["drop"]
                   and (o["vs_best_lossless"] > r["vs_best_lossless"] or o["drop"] < r["drop"]) for o in done):
            front.append(r["trial"])
    return front


def budget_rows(chosen: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for choice in chosen.values():
        cert = choice.get("certification") or {}
        step = shown_step(cert)  # the chosen candidate's step: a fixed sequence may certify more than one
        rows.append({"budget": choice["budget"], "certified": bool(choice.get("certified")),
                     "rule": choice.get("policy"), "params": choice.get("params"), "draft_len": choice.get("draft_len"),
                     "p_value": cert.get("p_value"), "bound": cert.get("bound"), "n": cert.get("n"),
                     "lost": step.get("losses"), "won": step.get("wins"),
                     "vs_lossless": choice.get("vs_lossless"), "vs_target_only": choice.get("vs_target_only")})
    return rows


def lost_items(reference: Mapping[str, Record], confirmed: Mapping[str, Mapping[str, Record]]) -> dict[str, list]:
    """Per confirmed candidate: the items target-only got right and it got wrong, with where its run left the
    target-only output (``Record.replay``: ``diverged@t`` is the generated index of its first accepted mismatch)."""
    out = {}
    for label, recs in confirmed.items():
        out[label] = [{"item": k, "how": r.replay or "decoded in full", "tokens": r.tokens,
                       "reference_tokens": reference[k].tokens}
                      for k, r in recs.items() if k in reference and not reference[k].failed
                      and reference[k].score > 0 and (r.failed or r.score <= 0)]
    return out


def summary(*, lossless: Mapping[int, Mapping[str, Record]], cost_ratio: float, verify_factor: Callable[[int], float],
            frame: Any, chosen: Mapping[str, Mapping[str, Any]], profile: Mapping[str, Any] | None = None,
            reference: Mapping[str, Record] | None = None,
            confirmed: Mapping[str, Mapping[str, Record]] | None = None) -> dict[str, Any]:
    ll = lossless_rows(lossless, cost_ratio, verify_factor)
    best = max((r for r in ll if math.isfinite(r["tokens_per_cost"])), key=lambda r: r["tokens_per_cost"], default=None)
    best_tpc = best["tokens_per_cost"] if best else math.nan
    for r in ll:
        r["vs_best_lossless"] = r["tokens_per_cost"] / best_tpc if best else math.nan
    ceiling = ceiling_rows([r["draft_len"] for r in ll], cost_ratio, verify_factor, best_tpc)
    trials = trial_rows(frame)
    profile = dict(profile or {})
    return {
        "cost_model": {"cost_ratio": cost_ratio, "verify_factor": {r["draft_len"]: verify_factor(r["draft_len"])
                                                                   for r in ll},
                       "calibration_load_1m": profile.get("load_1m"), "machine": profile.get("machine")},
        "lossless": ll, "best_lossless": {"draft_len": best["draft_len"] if best else None, "tokens_per_cost": best_tpc},
        "ceiling": ceiling,
        "ceiling_best": max((r["vs_best_lossless"] for r in ceiling if math.isfinite(r["vs_best_lossless"])),
                            default=math.nan),
        "trials": trials, "pareto": pareto(trials), "budgets": budget_rows(chosen),
        "lost_items": lost_items(reference or {}, confirmed or {}),
    }
