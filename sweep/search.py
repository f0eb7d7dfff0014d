"""The search: Optuna asks for a rule, its knobs and a draft length; the trial runs on the search sample,
is pruned once an anytime-valid bound rules it out, and is told (objectives: speedup, accuracy).

The search space is ``sweep.space``'s (from the policy registry's field metadata). :func:`run_trial` is one ask / run / prune / tell; :func:`trials_frame` the finished trials as a
frame (what the report, the frontier and the confirmation's candidates read). Everything on the search split
is a description: certificates are decided on other items (``sweep.confirm``).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sweep.space import decode_params, suggest

if TYPE_CHECKING:
    from sweep.settings import Settings
    from sweep.state import SweepState
    from workers.evaluation import DecodeSpec
    from workers.metrics.trial import TrialMetrics

# -- the trials ------------------------------------------------------------------------------------

OBJECTIVE_COLUMN = {"vs-ar": "speedup_vs_ar_modelled", "vs-lossless": "speedup_vs_lossless_modelled",
                    "vs-best-lossless": "speedup_vs_best_lossless_modelled"}
FRAME_FLOATS = ("accuracy", "accuracy_drop", "accuracy_drop_ci_lo", "accuracy_drop_ci_hi", "speedup_vs_ar_modelled",
                "speedup_vs_ar_measured", "speedup_vs_lossless_modelled", "speedup_vs_lossless_measured",
                "speedup_vs_best_lossless_modelled", "best_lossless_draft_len", "mean_acceptance_length",
                "draft_acceptance_rate", "accuracy_drop_upper", "discordance")


@dataclass(frozen=True)
class TrialOutcome:
    """What one trial did: its number, rule, search-split metrics, state and wall time."""

    number: int
    spec: DecodeSpec
    metrics: TrialMetrics
    state: str  # COMPLETE or PRUNED
    wall_s: float  # the trial's items on the actors
    items_per_s: float


def spec_of(settings: Settings, row: dict[str, Any]) -> DecodeSpec:
    """The decoding spec of a trials-frame row."""
    from workers.evaluation import DecodeSpec

    return DecodeSpec.make(row["family"], json.loads(row["params"]), row["draft_len"], **settings.decode)


def trial_dir(run_dir: Path, spec: DecodeSpec) -> Path:
    """Where a rule's search records live (keyed by spec, not trial number: a re-enqueued trial reuses them)."""
    from workers.results.store import slug

    return run_dir / "trials" / f"{slug(spec.label())}-{spec.key()}"


def finished(study: Any) -> int:
    """The study's finished trials (complete or pruned): what ``--trials`` counts."""
    from optuna.trial import TrialState

    return len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)))


def resume_stale(study: Any) -> list[int]:
    """Trials left RUNNING by an interrupted sweep are failed and re-enqueued with the same params; their
    records (keyed by spec, not trial number) are reused item by item. Returns their numbers."""
    from optuna.trial import TrialState

    from sweep.progress import log

    stale = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    for t in stale:
        study.tell(t.number, state=TrialState.FAIL)
        study.enqueue_trial(t.params, user_attrs={"resumed_from": t.number})
        log(f"trial {t.number} was interrupted: re-enqueued")
    return [t.number for t in stale]


def run_trial(state: SweepState) -> TrialOutcome:
    """One trial: ask, run its items on the actors (resumable, pruned by the anytime-valid test against the
    largest budget), aggregate against the references on the same items, log it to MLflow, tell Optuna."""
    from optuna.trial import TrialState

    from cluster.pair_actor import run_trial as run_on_actors
    from sweep.progress import trial_timing
    from workers.certify.decide import drop_bound, prune_test
    from workers.evaluation import DecodeSpec, Record
    from workers.metrics.lossless import best_lossless, replay_counts
    from workers.metrics.trial import aggregate
    from workers.results.evidence import ordered_prefix, paired
    from workers.results.flips import flip_rows, write_flips
    from workers.results.store import RecordStore

    s, args, refs = state.settings, state.settings.args, state.refs
    t_trial = time.perf_counter()
    trial = state.study.ask()
    family, params, draft_len = suggest(trial, s.families, s.draft_len, s.ranges)
    spec = DecodeSpec.make(family, params, draft_len, **s.decode)
    lossless = refs.lossless_range()  # every L's lossless first, one pass per item (not the trial's L, then the rest)
    ar, ll = refs.target_only(), refs.lossless(draft_len)
    store = RecordStore(trial_dir(state.dir, spec))
    records = {k: v for k, v in store.load().items() if k in ar}
    budget = max(s.budgets)
    from sweep.progress import Progress

    bar = Progress(f"trial {trial.number} {spec.label()}", len(state.items), len(records), best_text(state))
    order = [it.id for it in state.items]

    def on_record(rec: Record) -> bool:
        store.append(rec)
        records[rec.item_id] = rec
        bar.update(rec)
        ref, got = ordered_prefix(order, ar, records)
        if len(ref) < args.min_items_to_prune:
            return False
        # anytime-valid: checked after every item with no correction for the repeated looks
        return prune_test(ref, got, budget, args.alpha)

    todo = [it for it in state.items if it.id not in records]
    run = run_on_actors(state.workers, f"trial-{trial.number}", s.bench.ref, spec, todo, refs.payload(ar),
                        on_record=on_record, timeout_s=args.trial_timeout, shard_size=refs.shard_size(todo))
    bar.close()
    store.write_parquet(records.values())
    flips = write_flips(store.dir / "flips.parquet", flip_rows(order, ar, records))
    cost = state.cost
    m = aggregate(list(records.values()), list(ar.values()), list(ll.values()), cost.cost_ratio, cost.verify)
    ref, got = paired(ar, records)
    bound = drop_bound(ref, got, args.alpha)  # on the search items: orders candidates, certifies nothing
    ref, got = ordered_prefix(order, ar, records)
    pruned = run.stopped_early or (len(ref) >= args.min_items_to_prune and prune_test(ref, got, budget, args.alpha))
    best = best_lossless(records, lossless, cost.cost_ratio, cost.verify)
    speed = {"vs-ar": m.speedup_vs_ar_modelled, "vs-lossless": m.speedup_vs_lossless_modelled,
             "vs-best-lossless": best["speedup"]}[args.objective]
    attrs = {**m.flat(), "speedup_vs_best_lossless_modelled": best["speedup"],
             "best_lossless_draft_len": best["draft_len"], **replay_counts(records),
             "accuracy_drop_upper": bound.upper, "discordance": bound.discordance,
             "acceptance_per_position": m.acceptance_per_position, "actor_failures": run.actor_failures,
             "retried_items": run.retried_items, "trial_wall_s": run.wall_s, "spec_key": spec.key()}
    for k, v in attrs.items():
        trial.set_user_attr(k, v)
    over = m.accuracy_drop - budget if math.isfinite(m.accuracy_drop) else 1.0
    trial.set_constraint("accuracy_drop_over_budget", over)  # feasible when <= 0 (search guidance only)
    outcome = "PRUNED" if pruned else "COMPLETE"
    # search-split metrics as search.<name>; confirmation later logs confirm.<name> on the same run
    search = {f"search.{k}": v for k, v in m.flat().items()}
    search.update({"search.accuracy_drop_upper": bound.upper, "search.discordance": bound.discordance,
                   "search.items_evaluated": len(records)})
    run_id = state.tracker.log_trial(
        f"trial-{trial.number:03d} {spec.label()}",
        {"family": family, **{f"param.{k}": v for k, v in params.items()}, "draft_len": draft_len, "trial": trial.number},
        {**search, "retried_items": run.retried_items, "actor_failures": len(run.actor_failures),
         "trial_wall_s": run.wall_s},
        {"state": outcome, "family": family, "spec_key": spec.key(), "split": "search"},
        {store.parquet: "", flips: "", refs.path(refs.target_only_spec()): "reference"})
    trial.set_user_attr("mlflow_run_id", run_id)
    if pruned:
        state.study.tell(trial, state=TrialState.PRUNED)
    elif math.isnan(speed) or math.isnan(m.accuracy):
        state.study.tell(trial, state=TrialState.FAIL)
    else:
        state.study.tell(trial, [speed, m.accuracy])
    trial_timing(state.dir / "timing.jsonl", trial.number, len(state.workers), run,
                 [records[it.id] for it in todo if it.id in records], time.perf_counter() - t_trial)
    return TrialOutcome(trial.number, spec, m, outcome, run.wall_s, m.items / run.wall_s if run.wall_s else 0.0)


def trials_frame(state: SweepState) -> Any:
    """The finished trials (complete or pruned, with metrics) as a polars frame, one row each, with the sweep's
    objective speedup also as ``speedup`` (the confirmation's candidates' speed)."""
    import polars as pl

    s = state.settings
    rows = []
    for t in state.study.get_trials(deepcopy=False):
        if t.state.name not in ("COMPLETE", "PRUNED") or "accuracy" not in t.user_attrs:
            continue
        family, params, draft_len = decode_params(t.params, s.families, s.draft_len)
        a = t.user_attrs
        rows.append({"trial": t.number, "family": family, "params": json.dumps(params, sort_keys=True),
                     "draft_len": draft_len, "state": t.state.name, "items": int(a.get("items", 0)),
                     **{k: float(a.get(k, math.nan)) for k in FRAME_FLOATS},
                     "mlflow_run_id": a.get("mlflow_run_id")})
    frame = pl.DataFrame(rows) if rows else pl.DataFrame()
    if len(frame):
        frame = frame.with_columns(pl.col(OBJECTIVE_COLUMN[s.args.objective]).alias("speedup"))
    return frame


def best_text(state: SweepState) -> str:
    """The search split's best modelled speedup per budget so far (point estimates: a description of the
    search, not a certificate)."""
    frame = trials_frame(state)
    best = []
    for b in state.settings.budgets:
        ok = frame.filter((frame["state"] == "COMPLETE") & (frame["accuracy_drop"] <= b)) if len(frame) else frame
        best.append(f"≤{b * 100:g}%: {ok['speedup'].max():.2f}x" if len(ok) else f"≤{b * 100:g}%: -")
    return f"search best ({state.settings.args.objective}) " + ", ".join(best)


def trial_line(outcome: TrialOutcome, attrs: dict[str, Any], done: int, total: int, eta_s: float, best: str) -> None:
    """The line a finished trial logs: its accuracy, drop and speeds, how its items were made, the search's
    best so far (``best``) and the ETA (``eta_s``, the confirmation not included); ``attrs``: its user attrs."""
    m, spec = outcome.metrics, outcome.spec
    from sweep.progress import log
    from workers.metrics.lossless import baseline_name
    from workers.metrics.speed import measured_text, ratio_text

    in_situ = (f", modelled with the c seen in this trial {m.cost_ratio_in_situ:.2f}: "
               f"{ratio_text(m.speedup_vs_ar_modelled_in_situ, missing='n/a')}"
               if m.cost_ratio_in_situ > 0 else "")  # vLLM: not timed
    log(f"trial {outcome.number} [{done}/{total}] {outcome.state} {spec.label()}: acc {m.accuracy:.3f} drop "
        f"{m.accuracy_drop:+.3f} speedup over the best lossless ({baseline_name(attrs.get('best_lossless_draft_len'))}) "
        f"{ratio_text(attrs.get('speedup_vs_best_lossless_modelled'), missing='n/a')} modelled, over target-only "
        f"{ratio_text(m.speedup_vs_ar_modelled, missing='n/a')} ({measured_text(m.speedup_vs_ar_measured)}{in_situ}) MAL "
        f"{m.mean_acceptance_length:.2f} | replayed {attrs.get('replayed_exact', 0)} items with nothing decoded, "
        f"{attrs.get('replayed_decoded', 0)} decoded from a divergence, {attrs.get('decoded_in_full', 0)} in full | "
        f"{outcome.items_per_s:.2f} items/s | {best} | ETA {eta_s / 60:.1f} min + confirmation")


def search_cost(study: Any) -> None:
    """What the search cost, against what decoding every item of every trial in full would have: items
    replayed with nothing decoded (one teacher-forced pass each), replayed and decoded from a divergence,
    and decoded in full."""
    from sweep.progress import log

    totals = {"replayed_exact": 0, "replayed_decoded": 0, "decoded_in_full": 0}
    for t in study.get_trials(deepcopy=False):
        for k in totals:
            totals[k] += int(t.user_attrs.get(k, 0))
    n = sum(totals.values())
    if n:
        log(f"search cost: {n:,} item evaluations: {totals['replayed_exact']:,} replayed with nothing decoded "
            f"(a teacher-forced pass each), {totals['replayed_decoded']:,} decoded from the round that left the "
            f"target-only output, {totals['decoded_in_full']:,} decoded in full; full decoding would have decoded "
            f"all {n:,}")
