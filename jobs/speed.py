"""The speed a certificate states, like for like.

- ``speed_figures``: the confirmation records' speed against the target-only reference on the same items,
  as ratios of sums (modelled on every item; measured only on items both arms decoded in full).
- ``over_lossless``: the candidate's modelled speedup over lossless at the best L of the search (the best
  lossless, ``jobs.baseline``) and over target-only, on the items its certificate used; and, with
  ``--speed-items`` N > 0, the measured figure from a timed run of N of those items in which target-only,
  lossless at that L and the candidate decode each item in full, one after another on one actor (so at the
  same concurrency: batch 1 on the CPU engine), the next item only after all three; each figure says its n, the
  concurrency and the machine's load before and after.

Knows records and the sweep's actors; nothing about certificates' statistics.
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Callable
from typing import Any

from workers.evaluation import Record

MODEL_TOLERANCE = 0.15  # the modelled speed must agree with the measured one within this, or the measured is stated


def _interval(stat: Callable[[list[int]], float], n: int, seed: int = 0, resamples: int = 1000
              ) -> tuple[float, float, float]:
    """``stat`` over all n items and a paired (item-resampling) 95% bootstrap interval. A description
    of speed, not a certificate: nothing a quality budget relies on is decided by it."""
    est = stat(list(range(n)))
    rng = random.Random(seed)
    values = sorted(v for v in (stat([rng.randrange(n) for _ in range(n)]) for _ in range(resamples))
                    if math.isfinite(v))
    if not values:
        return (est, math.nan, math.nan)
    return (est, values[int(0.025 * len(values))], values[min(len(values) - 1, int(0.975 * len(values)))])


def speed_figures(records: dict[str, Record], reference: dict[str, Record], cost_ratio: float,
                  verify_factor: Callable[[int], float]) -> dict[str, float]:
    """Speed vs the reference on every item both arms attempted, a failed item with the time it took
    (its tokens count as produced, its time as spent), as ratios of sums, never means of per-item
    ratios (one short item would swing those):

    - ``measured_per_token``: (Σ tokens / Σ decode s) of the trial over the reference's;
    - ``measured_per_answer``: Σ reference decode s / Σ trial decode s (time to produce the answers);
    - ``modelled_per_token`` / ``modelled_per_answer``: the same with the modelled cost (target-step
      units, c = ``cost_ratio`` per draft forward) in place of seconds.
    Each with ``_lo``/``_hi``: a paired bootstrap interval over items (descriptive).
    """
    keys = [k for k in reference if k in records]
    out: dict[str, float] = {"speed_items": float(len(keys)),
                             "speed_failed_items": float(sum(records[k].failed for k in keys)),
                             "speed_replayed_items": float(sum(not records[k].timed for k in keys))}
    if not keys:
        return out

    def cost(r: Record) -> float:
        factor = verify_factor(r.draft_len) if r.draft_len else 1.0
        return factor * r.target_forwards + cost_ratio * r.draft_forwards

    def seconds(r: Record) -> float:  # a failed item still took its time: a rule whose slow items fail
        return r.decode_time_s if r.decode_time_s > 0 else max(r.wall_time_s, 0.0)  # must not look faster

    units: dict[str, Callable[[Record], float]] = {"measured": seconds, "modelled": cost}
    for kind, unit in units.items():
        # measured: only items both arms decoded (a replayed record's seconds are a pass's, not its rule's)
        use = keys if kind == "modelled" else [k for k in keys if records[k].timed and reference[k].timed]
        if not use:
            continue
        trial, ref = [records[k] for k in use], [reference[k] for k in use]
        t_unit, r_unit = [unit(r) for r in trial], [unit(r) for r in ref]
        t_tok, r_tok = [r.tokens for r in trial], [r.tokens for r in ref]

        def per_answer(idx: list[int], t_unit=t_unit, r_unit=r_unit) -> float:
            den = sum(t_unit[i] for i in idx)
            return sum(r_unit[i] for i in idx) / den if den > 0 else math.nan

        def per_token(idx: list[int], t_unit=t_unit, r_unit=r_unit, t_tok=t_tok, r_tok=r_tok) -> float:
            t = sum(t_unit[i] for i in idx) * sum(r_tok[i] for i in idx)
            return sum(r_unit[i] for i in idx) * sum(t_tok[i] for i in idx) / t if t > 0 else math.nan

        for name, stat in (("per_answer", per_answer), ("per_token", per_token)):
            est, lo, hi = _interval(stat, len(use))
            out[f"{kind}_{name}"], out[f"{kind}_{name}_lo"], out[f"{kind}_{name}_hi"] = est, lo, hi
    return out


def _ratio(records: list[Record], base: list[Record], unit: Callable[[Record], float]) -> float:
    """(Σ tokens / Σ unit) of ``records`` over the same of ``base``: a ratio of sums, never a mean of ratios."""
    mine, theirs = sum(unit(r) for r in records), sum(unit(r) for r in base)
    if mine <= 0 or theirs <= 0:
        return math.nan
    return (sum(r.tokens for r in records) / mine) / (sum(r.tokens for r in base) / theirs)


def over_lossless(sweep: Any, row: dict[str, Any], records: dict[str, Record], reference: dict[str, Record],
                  used: int) -> dict[str, Any]:
    """The candidate of trial ``row`` (its confirmation ``records``, on the first ``used`` confirmation items)
    against lossless at the search's best L and against target-only: modelled on those items, measured in a
    like-for-like timed run of the first ``--speed-items`` of them."""
    from workers.evaluation import TARGET_ONLY, DecodeSpec

    spec = sweep.spec_of(row)
    best = row.get("best_lossless_draft_len")
    draft_len = int(best) if best is not None and math.isfinite(float(best)) else spec.draft_len
    lossless = sweep.lossless(draft_len, "confirm", used)
    keys = [k for k in records if k in lossless and k in reference
            and not (records[k].failed or lossless[k].failed or reference[k].failed)]

    def cost(r: Record) -> float:
        factor = sweep.verify_factor(r.draft_len) if r.draft_len else 1.0
        return factor * r.target_forwards + sweep.cost_ratio * r.draft_forwards

    mine, ll, ar = ([d[k] for k in keys] for d in (records, lossless, reference))
    out: dict[str, Any] = {
        "vs_lossless": {"draft_len": draft_len, "modelled": _ratio(mine, ll, cost) if keys else math.nan,
                        "measured": math.nan, "items": len(keys)},
        "vs_target_only": {"modelled": _ratio(mine, ar, cost) if keys else math.nan, "measured": math.nan,
                           "items": len(keys)},
    }
    n = min(int(getattr(sweep.args, "speed_items", 0) or 0), len(keys))
    if n > 0:
        import ray

        shared = set(keys)
        order = [it for it in sweep.confirm_items if it.id in shared][:n]
        specs = [DecodeSpec.make(TARGET_ONLY, **sweep.s["decode"]),
                 DecodeSpec.make("lossless", {}, draft_len, **sweep.s["decode"]), spec]
        load_before = os.getloadavg()[0]
        try:
            timed = ray.get(sweep.workers[0].time_items.remote(sweep.bench.ref, specs, order))
        except ray.exceptions.RayError as err:  # a lost actor loses the timing, never the certificate
            error = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
            for side in ("vs_lossless", "vs_target_only"):
                out[side]["timed"] = {"error": error}
            return out
        ok = [i for i in range(n) if not any(arm[i].failed for arm in timed)]
        ar_t, ll_t, mine_t = ([arm[i] for i in ok] for arm in timed)

        def seconds(r: Record) -> float:
            return r.decode_time_s

        like = {"items": len(ok), "concurrency": 1, "interleaved": "target-only, lossless, candidate per item",
                "load_1m": [load_before, os.getloadavg()[0]]}
        out["vs_lossless"].update(measured=_ratio(mine_t, ll_t, seconds), modelled_timed=_ratio(mine_t, ll_t, cost),
                                  timed=like)
        out["vs_target_only"].update(measured=_ratio(mine_t, ar_t, seconds), modelled_timed=_ratio(mine_t, ar_t, cost),
                                     timed=like)
    for side in ("vs_lossless", "vs_target_only"):
        out[side].update(stated_figure(out[side]))
    return out


def stated_figure(figures: dict[str, Any]) -> dict[str, Any]:
    """Which figure a certificate states: the modelled one (all its items) where the model, on the timed items,
    agrees with the measurement within ``MODEL_TOLERANCE``; else the measured one, and the model's error said.
    Untimed (``--speed-items 0``): the modelled figure, its agreement unknown."""
    modelled, timed, measured = (figures.get(k, math.nan) for k in ("modelled", "modelled_timed", "measured"))
    if not (math.isfinite(timed) and math.isfinite(measured) and measured > 0):
        return {"model_error": math.nan, "model_agrees": None, "stated": modelled, "stated_from": "modelled (not timed)"}
    error = timed / measured - 1.0
    agrees = abs(error) <= MODEL_TOLERANCE
    return {"model_error": error, "model_agrees": agrees, "stated": modelled if agrees else measured,
            "stated_from": "modelled" if agrees else f"measured (the model is off by {error * 100:+.0f}%)"}
