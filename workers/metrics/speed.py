"""The speed a certificate states, like for like.

- ``speed_figures``: the confirmation records' speed against the target-only reference on the same items,
  as ratios of sums (modelled on every item; measured only on items both arms decoded in full).
- ``over_lossless``: the candidate's modelled speedup over lossless at the best L of the search (the best
  lossless, ``workers.metrics.lossless``) and over target-only, on the items its certificate used; and, with
  ``--speed-items`` N > 0, the measured figure from a timed run of N of those items (:class:`Timed`, run on
  an actor by ``cluster.pool``) in which target-only, lossless at that L and the candidate decode each item in
  full, one after another (so at the same concurrency: batch 1 on the CPU engine), the next item only after all
  three; each figure says its n, the concurrency and the machine's load before and after. The timed run's full
  decodes also check the records they time (``replay_check``): replayed or not, they must be the same decode.

Knows records and the cost model; nothing about actors or certificates' statistics.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from workers.evaluation import Record
from workers.metrics.cost import CostModel, modelled_cost

MODEL_TOLERANCE = 0.15  # the modelled speed must agree with the measured one within this, or the measured is stated


def ratio_text(value: float | None, digits: int = 2, missing: str = "not timed") -> str:
    """A speed ratio for a log or report line: ``1.23x``, or ``missing`` where there is no figure (None or
    NaN: a measured speed where nothing was timed, a modelled one with no items to model), never ``nanx``."""
    if value is None or not math.isfinite(value):
        return missing
    return f"{value:.{digits}f}x"


def measured_text(value: float | None, digits: int = 2) -> str:
    """A measured speed ratio for a log or report line: ``measured 1.23x``, or ``not timed`` without one."""
    return "not timed" if value is None or not math.isfinite(value) else f"measured {ratio_text(value, digits)}"


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
        return modelled_cost(r, cost_ratio, verify_factor)

    def seconds(r: Record) -> float:  # a failed item still took its time: a rule whose slow items fail
        return r.decode_time_s if r.decode_time_s > 0 else max(r.wall_time_s, 0.0)  # must not look faster

    units: dict[str, Callable[[Record], float]] = {"measured": seconds, "modelled": cost}
    for kind, unit in units.items():
        # measured: only items both arms decoded in full, alone (a replayed record's seconds are a pass's, not its
        # rule's; a batched one's overlap its neighbours')
        use = keys if kind == "modelled" else [k for k in keys if records[k].solo and reference[k].solo]
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
    base_tokens = sum(r.tokens for r in base)
    if mine <= 0 or theirs <= 0 or base_tokens <= 0:
        return math.nan
    return (sum(r.tokens for r in records) / mine) / (base_tokens / theirs)


def rotation(k: int, arms: int) -> list[int]:
    """The arms' order in chunk ``k`` of a concurrent timed run: the one that goes first rotates chunk by chunk."""
    turn = k % arms
    return [*range(turn, arms), *range(turn)]


@dataclass(frozen=True)
class Timed:
    """A like-for-like timed run: ``arms`` (target-only, lossless, candidate: each one record per timed item, the
    same items in the same order, decoded one after another per item at ``concurrency``) and the 1-minute load
    before and after; or ``error`` when the run was lost (a lost actor loses the timing, never the certificate)."""

    arms: tuple[list[Record], list[Record], list[Record]] | None
    load_1m: tuple[float, float] = (math.nan, math.nan)
    concurrency: int = 1
    error: str | None = None
    # at a concurrency above 1: each arm's wall seconds over its own chunks (its requests overlap, so a record's
    # seconds are not its share of the machine): measured speed is then output tokens over these walls
    walls: tuple[float, float, float] | None = None


def replay_check(timed: Timed, records: dict[str, Record], lossless: dict[str, Record],
                 reference: dict[str, Record] | None = None) -> dict[str, Any]:
    """The timed run's full decodes against the records the certificate and its modelled speed were made of, on
    the same items, arm by arm (candidate, lossless, target-only): output tokens and every acceptance count must be
    equal, and a failure on one side only is a difference. ``replayed_differ``: pairs whose held record was
    replayed (``workers.replay``) and differs from its full decode — evidence that replay was not exact there,
    which a certificate must not rest on; ``full_differ``: pairs of two full decodes that differ (nondeterminism
    between actors or runs: noted, not acted on). ``status``: "identical", "replay differs", "full decodes
    differ" or "unchecked" (nothing timed)."""
    out: dict[str, Any] = {"items": 0, "replayed": 0, "replayed_differ": [], "full_differ": [], "candidate_items": []}
    if timed.arms is None:
        out["status"] = "unchecked"
        return out
    arms = ((timed.arms[2], records, "candidate"), (timed.arms[1], lossless, "lossless"),
            (timed.arms[0], reference or {}, "target-only"))
    for arm, held, name in arms:
        audit_against(out, arm, held, name)
    return settle(out)


AUDITED_FIELDS = ("output_token_ids", "num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_position")


def audit_against(out: dict[str, Any], decoded: Sequence[Record], held: dict[str, Record], arm: str) -> None:
    """Add to ``out`` (a :func:`replay_check` result) the full decodes ``decoded`` of arm ``arm`` against the records
    ``held`` for the same items: tokens and every acceptance count equal, a failure on one side only a difference."""
    for full in decoded:
        made = held.get(full.item_id)
        if made is None:
            continue
        out["items"] += 1
        out["replayed"] += int(not made.timed)
        if arm == "candidate":
            out.setdefault("candidate_items", []).append(full.item_id)
        differ = made.failed != full.failed or (not made.failed and any(getattr(full, f) != getattr(made, f)
                                                                         for f in AUDITED_FIELDS))
        if differ:
            out["full_differ" if made.timed else "replayed_differ"].append(f"{arm}:{full.item_id}")


def settle(out: dict[str, Any]) -> dict[str, Any]:
    """``out``'s status from what it holds."""
    out["status"] = ("unchecked" if not out["items"] else "replay differs" if out["replayed_differ"]
                     else "full decodes differ" if out["full_differ"] else "identical")
    out["identical"] = out["status"] == "identical"
    return out


def comparable(records: dict[str, Record], lossless: dict[str, Record], reference: dict[str, Record]) -> list[str]:
    """The items all three arms hold unfailed (what the modelled figures use, and the timed items come from)."""
    return [k for k in records if k in lossless and k in reference
            and not (records[k].failed or lossless[k].failed or reference[k].failed)]


def over_lossless(records: dict[str, Record], lossless: dict[str, Record], reference: dict[str, Record],
                  draft_len: int, cost: CostModel, timed: Timed | None = None, audit: Timed | None = None,
                  coupled: bool = False) -> dict[str, Any]:
    """A candidate's confirmation ``records`` against ``lossless`` (at the search's best L, ``draft_len``) and
    against target-only (``reference``): modelled on the items all three hold, measured from ``timed`` (the
    like-for-like run of the first ``--speed-items`` of them, :class:`Timed`), and the figure a certificate
    states (:func:`stated_figure`).

    ``coupled``: the records were drawn with the coupled sampler (``policies.coupling``); ``timed`` then samples as
    a deployment does (the standard sampler, which accepts more) and ``audit`` holds the same arms decoded in full
    with the records' own sampler, for the replay check. The modelled figure over all items is then the coupled
    sampler's, said so, and the stated figure comes from the timed items alone (the model on their standard-sampler
    counts, if it agrees with the measurement; else the measurement), or is none where nothing was timed so."""
    keys = comparable(records, lossless, reference)
    mine, ll, ar = ([d[k] for k in keys] for d in (records, lossless, reference))
    out: dict[str, Any] = {
        "vs_lossless": {"draft_len": draft_len, "modelled": _ratio(mine, ll, cost.cost) if keys else math.nan,
                        "measured": math.nan, "items": len(keys)},
        "vs_target_only": {"modelled": _ratio(mine, ar, cost.cost) if keys else math.nan, "measured": math.nan,
                           "items": len(keys)},
    }
    out["replay_check"] = {"status": "unchecked", "items": 0, "replayed": 0, "replayed_differ": [], "full_differ": [],
                           "candidate_items": []}
    if coupled:
        for side in ("vs_lossless", "vs_target_only"):
            out[side]["modelled_sampler"] = "coupled"  # below the standard sampler's acceptance: not a deployment's
            out[side]["timed_sampler"] = "standard"
            out[side].update(stated=math.nan, stated_from="none: the coupled sampler's modelled figure is not a "
                             "deployment's, and nothing was timed with the standard sampler")
    if timed is not None and timed.error is not None:
        for side in ("vs_lossless", "vs_target_only"):
            out[side]["timed"] = {"error": timed.error}
        return out
    if timed is not None and timed.arms is not None:
        n = len(timed.arms[0])
        ok = [i for i in range(n) if not any(arm[i].failed for arm in timed.arms)]
        ar_t, ll_t, mine_t = ([arm[i] for i in ok] for arm in timed.arms)

        def seconds(r: Record) -> float:
            return r.decode_time_s

        like = {"items": len(ok), "concurrency": timed.concurrency,
                "interleaved": "target-only, lossless, candidate per item", "load_1m": list(timed.load_1m)}
        measured_ll, measured_ar = _ratio(mine_t, ll_t, seconds), _ratio(mine_t, ar_t, seconds)
        modelled_ll, modelled_ar = _ratio(mine_t, ll_t, cost.cost), _ratio(mine_t, ar_t, cost.cost)
        if timed.walls is not None:
            # concurrent arms: output tokens over each arm's own walls, every item counted (a request that failed
            # made no tokens; a record whose scoring failed still decoded its tokens in that wall)
            rates = [sum(r.tokens for r in arm) / w if w > 0 else math.nan
                     for arm, w in zip(timed.arms, timed.walls, strict=True)]

            def over(a: float, b: float) -> float:
                return a / b if math.isfinite(a) and math.isfinite(b) and b > 0 else math.nan

            measured_ll, measured_ar = over(rates[2], rates[1]), over(rates[2], rates[0])
            # the modelled figures on the same items as the measured ones: all of them
            modelled_ll, modelled_ar = (_ratio(list(timed.arms[2]), list(timed.arms[i]), cost.cost) for i in (1, 0))
            in_flight = [sum(r.wall_time_s for r in arm) / w if w > 0 else math.nan
                         for arm, w in zip(timed.arms, timed.walls, strict=True)]
            like.update(items=n, interleaved=f"chunk by chunk, each arm's requests {timed.concurrency} at a time, the "
                        "arm that goes first rotating; output tokens over each arm's walls",
                        tokens_per_s=dict(zip(("target_only", "lossless", "candidate"), rates, strict=True)),
                        # requests in flight on average: below the concurrency where items are few or chunks drain
                        in_flight=dict(zip(("target_only", "lossless", "candidate"), in_flight, strict=True)),
                        latency={name: latency(arm) for name, arm in zip(("target_only", "lossless", "candidate"),
                                                                         timed.arms, strict=True)})
        out["vs_lossless"].update(measured=measured_ll, modelled_timed=modelled_ll, timed=like)
        out["vs_target_only"].update(measured=measured_ar, modelled_timed=modelled_ar, timed=like)
        out["replay_check"] = replay_check(timed if audit is None else audit, records, lossless, reference)
    for side in ("vs_lossless", "vs_target_only"):
        if not coupled:
            out[side].update(stated_figure(out[side]))
        elif math.isfinite(out[side].get("modelled_timed", math.nan)):  # the timed items' figures alone
            out[side].update(stated_figure({**out[side], "modelled": out[side]["modelled_timed"]}))
    return out


def latency(records: Sequence[Record]) -> dict[str, float]:
    """What a request waited at its concurrency, p50 and p90 over ``records`` (each decoded beside the others of its
    chunk, so its seconds are a client's): time to first token (its prefill, queueing included) and time per output
    token after the first."""
    ok = [r for r in records if not r.failed and r.tokens > 0]

    def pct(values: list[float], q: float) -> float:
        if not values:
            return math.nan
        values = sorted(values)
        return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]

    ttft = [r.prefill_time_s for r in ok]
    tpot = [r.decode_time_s / max(1, r.tokens - 1) for r in ok]
    return {"ttft_p50_s": pct(ttft, 0.5), "ttft_p90_s": pct(ttft, 0.9), "tpot_p50_s": pct(tpot, 0.5),
            "tpot_p90_s": pct(tpot, 0.9), "items": len(ok)}


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
