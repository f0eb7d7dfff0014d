"""The sweep: search each rule's knobs for the best speedup under quality budgets, on Ray.

    ray job submit --working-dir . -- python jobs/sweep.py --benchmark gsm8k \\
        --pair qwen2.5-coder-0.5b+1.5b --budgets 0.01,0.02,0.05 --items 40 --trials 16

Optuna (sqlite under the run directory; rerunning the same command resumes it) asks for a rule
family, its knobs (from the registry's field metadata) and a draft length; long-lived pair actors
evaluate the trial's items — from the benchmark's SEARCH split — streamed through Ray Data; the
driver aggregates the records against the cached target-only and lossless references on the same
items, stops a trial early once an anytime-valid bound says its accuracy drop is beyond the largest
budget (recorded as pruned), tells Optuna (objectives: speedup, accuracy; constraint: drop <=
largest budget) and logs a nested MLflow run. The Pareto front, the speedup table and acceptance
plots are refreshed as the sweep goes. At the end each budget is CERTIFIED, or not, on the
CONFIRMATION split, which the search never saw (``jobs.confirm``, decided by ``workers.certify.decide``):
the chosen policy per budget says which, with the bound, alpha, n and discordance.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # `python jobs/sweep.py` (as `ray job submit` runs it): repo root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

from dashboards.flips import flips_page  # noqa: E402
from jobs.progress import Progress, search_cost, trial_line, trial_timing  # noqa: E402
from jobs.search_space import decode_params, suggest  # noqa: E402
from jobs.sweep_args import (  # noqa: E402, F401  (build_parser, enqueued_params: the sweep's CLI, imported from here too)
    build_parser,
    effective_config,
    enqueued_params,
    log,
    make_sampler,
    parse_args,
    parse_settings,
    study_name,
    vllm_options,
)
from workers.evaluation import TARGET_ONLY, DecodeSpec, Record  # noqa: E402
from workers.metrics import aggregate, noise_floor, score_of  # noqa: E402
from workers.results.evidence import ordered_prefix, paired  # noqa: E402
from workers.results.flips import flip_rows, write_flips  # noqa: E402
from workers.results.store import RecordStore, reference_dir, runs_root, slug  # noqa: E402


class Sweep:
    """Driver state: workers, references, study, tracker. One per command invocation."""

    def __init__(self, args: argparse.Namespace, s: dict[str, Any]) -> None:
        import optuna

        from cluster.pair_actor import make_workers
        from cluster.runtime import default_num_actors, init_ray
        from jobs.tracking import SweepTracker

        self.args, self.s = args, s
        self.bench = s["bench"]
        self.root = runs_root(args.runs_root)
        self.name = study_name(args, s)
        self.dir = Path(args.run_dir) if args.run_dir else self.root / "sweeps" / self.name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.items = self.bench.items(limit=args.items or None, seed=args.subset_seed, split="search")
        # the confirmation pool: every item held apart from the search sample (the confirm split and the
        # search-split rows the sample did not use), in seeded order; --confirm-items takes its first N
        pool, sources = self.bench.confirmation_pool(self.items)
        n_confirm = args.items if args.confirm_items is None else args.confirm_items
        self.pool, self.n_confirm = pool, min(n_confirm, len(pool)) if n_confirm else len(pool)
        # provisional: the ledger gives the attempt its items when confirmation starts (jobs.confirm)
        self.confirm_items = pool[: self.n_confirm]
        self.split = {**self.bench.split_info(), "pool": len(pool), "pool_sources": sources,
                      "confirm_used": len(self.confirm_items), "search_sample": len(self.items)}
        log(f"search sample: {len(self.items)} items; confirmation pool: {len(pool)} held-apart items "
            f"({', '.join(f'{k} {v}' for k, v in sources.items())}), {len(self.confirm_items)} used")
        init_ray(args.address)
        n = args.actors or default_num_actors(int(args.actor_memory_gb * 2**30), max(1, int(args.cpus_per_actor)))
        log(f"starting {n} pair actor(s) for {args.pair} ({args.dtype})")
        self.workers = make_workers(n, args.pair, args.dtype, cpus_per_actor=args.cpus_per_actor,
                                    gpus_per_actor=args.gpus_per_actor, tensor_parallel_size=args.tensor_parallel_size,
                                    engine=args.engine, draft_len=s["draft_len"][0], vllm=vllm_options(args),
                                    python=getattr(args, "vllm_python", None))
        import ray

        self.profile = ray.get(self.workers[0].profile.remote())
        self.cost_ratio = args.cost_ratio if args.cost_ratio is not None else self.profile["cost_ratio"]
        self.verify_s = {int(k): v for k, v in self.profile["verify_s"].items()}
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.study = optuna.create_study(
            study_name=self.name, storage=f"sqlite:///{self.dir / 'optuna.db'}", load_if_exists=True,
            directions=["maximize", "maximize"], sampler=make_sampler(args.seed, 0, args.trials))
        if self.study.trials:
            self.study.sampler = make_sampler(args.seed, len(self.study.trials), args.trials)
        self.tracker = SweepTracker(self.dir)
        meta = self.dir / "sweep.json"
        state = json.loads(meta.read_text()) if meta.is_file() else {}
        parent = self.tracker.start_parent(
            self.name, {"benchmark": args.benchmark, "pair": args.pair, "dtype": args.dtype, "items": len(self.items),
                        "confirm_items": len(self.confirm_items), "alpha": args.alpha,
                        "split.search": self.split["search"], "split.confirm": self.split["confirm"],
                        "split.pool": self.split["pool"], "split.pool_sources": json.dumps(self.split["pool_sources"]),
                        "budgets": s["budgets"], "policies": s["families"], "draft_len_range": list(s["draft_len"]),
                        **s["decode"], "objective": args.objective, "cost_ratio": self.cost_ratio, "actors": n},
            {"machine": platform.node(), "python": platform.python_version(), "study": self.name,
             "run_dir": str(self.dir), **_versions()}, state.get("parent_run_id"))
        meta.write_text(json.dumps({"parent_run_id": parent, "study": self.name, "args": vars(args)}, indent=1,
                                   default=str))  # default: the --config files' paths
        self.save_config()
        self.refs: dict[str, dict[str, Record]] = {}
        self.flips: dict[str, Path] = {}  # report heading -> a trial's or a confirmed candidate's flips.parquet

    def save_config(self) -> None:
        """The effective config (file and flags merged, as resolved) as ``config.yaml`` in the run
        directory and on the parent MLflow run; a resumed sweep run with other options (more --trials,
        say) keeps the one before as ``config.prev.yaml``."""
        text = (f"# study {self.name}, every option as it ran: `python jobs/sweep.py --config <this file>` "
                f"resumes it\n{effective_config(self.args)}")
        path = self.dir / "config.yaml"
        if path.is_file() and path.read_text() != text:
            path.replace(self.dir / "config.prev.yaml")
        path.write_text(text)
        self.tracker.log_artifact(path)

    # -- references ------------------------------------------------------------------------------

    def reference_store(self, spec: DecodeSpec) -> RecordStore:
        # references are per engine (same greedy tokens up to bf16 kernels, different timings)
        pair = self.args.pair if self.args.engine == "cpu" else f"{self.args.pair}@{self.args.engine}"
        return RecordStore(reference_dir(self.root, pair, self.args.dtype, self.bench.key, spec))

    def reference_path(self, spec: DecodeSpec) -> Path:
        """The records file of ``spec``'s reference store (shared by sweeps over the same pair and task)."""
        return self.reference_store(spec).parquet

    def reference(self, spec: DecodeSpec, label: str, items: list | None = None) -> dict[str, Record]:
        store = self.reference_store(spec)
        return self.run_items(spec, label, store, self.items if items is None else items, retry_failed=True,
                              timeout=False)

    def run_items(self, spec: DecodeSpec, label: str, store: RecordStore, items: list,
                  stop: Any = None, *, retry_failed: bool = False, timeout: bool = True) -> dict[str, Record]:
        """``spec`` on ``items``, resumable through ``store``; ``stop(records)`` may end it early.
        ``retry_failed``: items whose stored record failed (an engine death, a parse failure) run again,
        once per call, their new record replacing the old (references: a failed reference item would
        otherwise stay cached for every later sweep). ``timeout``: whether ``--trial-timeout`` applies
        (search trials only; a reference or a confirmation that dropped items would change the items a
        certificate is decided on)."""
        from cluster.pair_actor import run_trial

        done = store.load()
        missing = [it for it in items if it.id not in done or (retry_failed and done[it.id].failed)]
        retried = sum(it.id in done for it in missing)
        if retried:
            log(f"{label}: retrying {retried} failed item(s)")
        if missing:
            ar = self.refs.get(TARGET_ONLY, {}) if spec.policy != TARGET_ONLY else {}
            refs = self.payload({**ar, **(self.refs.get("confirm:" + TARGET_ONLY, {}) if spec.policy != TARGET_ONLY
                                          else {})})
            bar = Progress(label, len(items), len(items) - len(missing))

            def on_record(rec: Record) -> bool:
                store.append(rec)
                done[rec.item_id] = rec
                bar.update(rec)
                return bool(stop is not None and stop({it.id: done[it.id] for it in items if it.id in done}))

            run = run_trial(self.workers, f"{label}-{spec.key()}", self.bench.ref, spec, missing, refs,
                            on_record=on_record, timeout_s=self.args.trial_timeout if timeout else None,
                            shard_size=self.shard_size(missing))
            bar.close("stopped early: the bound rules it out" if run.stopped_early else "")
        store.write_parquet(done.values())  # the whole store: a shared reference may hold both splits' items
        return {it.id: done[it.id] for it in items if it.id in done}

    def payload(self, references: dict[str, Record]) -> dict[str, Any]:
        """What the actors get of the target-only records: with replay on (the CPU engine at T = 0, unless
        ``--replay off``), each record's tokens, so the rule is replayed from them; else its outputs."""
        from workers.evaluation import reference_payload

        on = self.args.replay != "off" and self.args.engine == "cpu" and self.s["decode"]["temperature"] == 0.0
        return {k: reference_payload(r) if on and not r.failed else r.outputs for k, r in references.items()}

    def best_lossless(self, records: dict[str, Record]) -> dict[str, Any]:
        """Lossless at its fastest L of the search range, on the trial's items (``jobs.baseline``)."""
        from jobs.baseline import best_lossless
        return best_lossless(records, self.lossless_range(), self.cost_ratio, self.verify_factor)

    def lossless_range(self) -> dict[int, dict[str, Record]]:
        from jobs.baseline import lossless_all
        lo, hi = self.s["draft_len"][0], self.s["draft_len"][-1]
        if any(f"lossless-{n}" not in self.refs for n in range(lo, hi + 1)):
            lossless_all(self, list(range(lo, hi + 1)))
        return {n: self.lossless(n) for n in range(lo, hi + 1)}

    def shard_size(self, items: list) -> int | None:
        """vLLM batches a shard in one ``generate``: one shard per actor; the CPU engine small ones (the default)."""
        return math.ceil(len(items) / max(1, len(self.workers))) if self.args.engine == "vllm" and items else None

    def lossless(self, draft_len: int, split: str = "search", n: int | None = None) -> dict[str, Record]:
        """Lossless at ``draft_len`` on the search items, or on the first ``n`` (default all) confirmation items."""
        key = f"lossless-{draft_len}" if split == "search" else f"confirm:lossless-{draft_len}-{n}"
        if key not in self.refs:
            spec = DecodeSpec.make("lossless", {}, draft_len, **self.s["decode"])
            items = self.items if split == "search" else self.confirm_items[:n]
            self.refs[key] = self.reference(spec, f"lossless L={draft_len} reference ({split})", items)
        return self.refs[key]

    def verify_factor(self, draft_len: int) -> float:
        from workers.models.calibrate import CostProfile

        if not self.profile.get("verify_s"):
            return 1.0  # no timed verify passes (vLLM engine): the DESIGN's plain count
        data = dict(self.profile)
        data.pop("cost_ratio", None)
        return CostProfile(**data).verify_factor(draft_len)

    # -- trials ----------------------------------------------------------------------------------

    def resume_stale(self) -> None:
        """Trials left RUNNING by an interrupted sweep are failed and re-enqueued with the same
        params; their records (keyed by spec, not trial number) are reused item by item."""
        from optuna.trial import TrialState

        for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            self.study.tell(t.number, state=TrialState.FAIL)
            self.study.enqueue_trial(t.params, user_attrs={"resumed_from": t.number})
            log(f"trial {t.number} was interrupted: re-enqueued")

    def finished(self) -> int:
        from optuna.trial import TrialState

        return len(self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)))

    def run_one(self) -> None:
        from optuna.trial import TrialState

        from cluster.pair_actor import run_trial
        from workers.certify.decide import drop_bound, prune_test

        t_trial = time.perf_counter()
        trial = self.study.ask()
        family, params, draft_len = suggest(trial, self.s["families"], self.s["draft_len"], self.s.get("ranges"))
        spec = DecodeSpec.make(family, params, draft_len, **self.s["decode"])
        self.lossless_range()  # every L's lossless first, one pass per item (not the trial's L alone, then the rest)
        ar, ll = self.refs[TARGET_ONLY], self.lossless(draft_len)
        store = RecordStore(self.dir / "trials" / f"{slug(spec.label())}-{spec.key()}")
        records = {k: v for k, v in store.load().items() if k in ar}
        budget = max(self.s["budgets"])
        bar = Progress(f"trial {trial.number} {spec.label()}", len(self.items), len(records), self.best_text())
        order = [it.id for it in self.items]

        def on_record(rec: Record) -> bool:
            store.append(rec)
            records[rec.item_id] = rec
            bar.update(rec)
            ref, got = ordered_prefix(order, ar, records)
            if len(ref) < self.args.min_items_to_prune:
                return False
            # anytime-valid: checked after every item with no correction for the repeated looks
            return prune_test(ref, got, budget, self.args.alpha)

        todo = [it for it in self.items if it.id not in records]
        run = run_trial(self.workers, f"trial-{trial.number}", self.bench.ref, spec, todo, self.payload(ar),
                        on_record=on_record, timeout_s=self.args.trial_timeout, shard_size=self.shard_size(todo))
        bar.close()
        store.write_parquet(records.values())
        flips = write_flips(store.dir / "flips.parquet", flip_rows(order, ar, records))
        self.flips[f"trial {trial.number}: {spec.label()} (search split)"] = flips
        m = aggregate(list(records.values()), list(ar.values()), list(ll.values()), self.cost_ratio, self.verify_factor)
        ref, got = paired(ar, records)
        bound = drop_bound(ref, got, self.args.alpha)  # on the search items: orders candidates, certifies nothing
        ref, got = ordered_prefix(order, ar, records)
        pruned = run.stopped_early or (len(ref) >= self.args.min_items_to_prune
                                       and prune_test(ref, got, budget, self.args.alpha))
        best = self.best_lossless(records)
        speed = {"vs-ar": m.speedup_vs_ar_modelled, "vs-lossless": m.speedup_vs_lossless_modelled,
                 "vs-best-lossless": best["speedup"]}[self.args.objective]
        for k, v in m.flat().items():
            trial.set_user_attr(k, v)
        trial.set_user_attr("speedup_vs_best_lossless_modelled", best["speedup"])
        trial.set_user_attr("best_lossless_draft_len", best["draft_len"])
        from jobs.baseline import replay_counts

        for k, v in replay_counts(records).items():
            trial.set_user_attr(k, v)
        trial.set_user_attr("accuracy_drop_upper", bound.upper)
        trial.set_user_attr("discordance", bound.discordance)
        trial.set_user_attr("acceptance_per_position", m.acceptance_per_position)
        trial.set_user_attr("actor_failures", run.actor_failures)
        trial.set_user_attr("retried_items", run.retried_items)
        trial.set_user_attr("trial_wall_s", run.wall_s)
        trial.set_user_attr("spec_key", spec.key())
        over = m.accuracy_drop - budget if math.isfinite(m.accuracy_drop) else 1.0
        trial.set_constraint("accuracy_drop_over_budget", over)  # feasible when <= 0 (search guidance only)
        state = "PRUNED" if pruned else "COMPLETE"
        # search-split metrics as search.<name>; confirmation later logs confirm.<name> on the same run
        search = {f"search.{k}": v for k, v in m.flat().items()}
        search.update({"search.accuracy_drop_upper": bound.upper, "search.discordance": bound.discordance,
                       "search.items_evaluated": len(records)})
        run_id = self.tracker.log_trial(
            f"trial-{trial.number:03d} {spec.label()}",
            {"family": family, **{f"param.{k}": v for k, v in params.items()}, "draft_len": draft_len, "trial": trial.number},
            {**search, "retried_items": run.retried_items, "actor_failures": len(run.actor_failures),
             "trial_wall_s": run.wall_s},
            {"state": state, "family": family, "spec_key": spec.key(), "split": "search"},
            {store.parquet: "", flips: "", self.reference_path(DecodeSpec.make(TARGET_ONLY, **self.s["decode"])): "reference"})
        trial.set_user_attr("mlflow_run_id", run_id)
        if pruned:
            self.study.tell(trial, state=TrialState.PRUNED)
        elif math.isnan(speed) or math.isnan(m.accuracy):
            self.study.tell(trial, state=TrialState.FAIL)
        else:
            self.study.tell(trial, [speed, m.accuracy])
        state = "PRUNED" if pruned else "COMPLETE"
        trial_timing(self, trial.number, run, [records[it.id] for it in todo if it.id in records],
                     time.perf_counter() - t_trial)
        trial_line(self, trial.number, spec, m, state, run.wall_s)

    # -- reporting -------------------------------------------------------------------------------

    def trials_frame(self):
        import polars as pl

        rows = []
        for t in self.study.get_trials(deepcopy=False):
            if t.state.name not in ("COMPLETE", "PRUNED") or "accuracy" not in t.user_attrs:
                continue
            family, params, draft_len = decode_params(t.params, self.s["families"], self.s["draft_len"])
            a = t.user_attrs
            rows.append({"trial": t.number, "family": family, "params": json.dumps(params, sort_keys=True),
                         "draft_len": draft_len, "state": t.state.name, "items": int(a.get("items", 0)),
                         **{k: float(a.get(k, math.nan)) for k in (
                             "accuracy", "accuracy_drop", "accuracy_drop_ci_lo", "accuracy_drop_ci_hi",
                             "speedup_vs_ar_modelled", "speedup_vs_ar_measured", "speedup_vs_lossless_modelled",
                             "speedup_vs_lossless_measured", "speedup_vs_best_lossless_modelled",
                             "best_lossless_draft_len", "mean_acceptance_length", "draft_acceptance_rate",
                             "accuracy_drop_upper", "discordance")},
                         "mlflow_run_id": a.get("mlflow_run_id")})
        frame = pl.DataFrame(rows) if rows else pl.DataFrame()
        if len(frame):  # the objective's speedup, under one name for the confirmation's candidates
            objective = {"vs-ar": "speedup_vs_ar_modelled", "vs-lossless": "speedup_vs_lossless_modelled",
                         "vs-best-lossless": "speedup_vs_best_lossless_modelled"}[self.args.objective]
            frame = frame.with_columns(pl.col(objective).alias("speedup"))
        return frame

    def report(self, final: bool = False) -> dict[str, Any]:
        """The search split's report (every few trials); with ``final``, certify each budget on the
        confirmation split and write the chosen policies (``chosen/budget-<b>.json``)."""
        from dashboards.report import write_report
        from dashboards.tables import chosen_per_budget
        from jobs import frontier

        frame = self.trials_frame()
        ar = self.refs[TARGET_ONLY]
        ref_acc = sum(score_of(r) for r in ar.values()) / max(1, len(ar))
        ll_key = next((k for k in self.refs if k.startswith("lossless")), None)
        floor = noise_floor(list(self.refs[ll_key].values()), list(ar.values())).__dict__ if ll_key else None
        winners = {}
        if len(frame):
            for budget, row in chosen_per_budget(frame, self.s["budgets"]).items():
                if row is not None:
                    winners[f"search ≤{budget * 100:g}%: {row['family']} (trial {row['trial']})"] = self.acceptance(row)
        out = self.dir / "report"
        out.mkdir(parents=True, exist_ok=True)
        chosen: dict[str, Any] = {}
        table = None
        if final:
            from jobs.confirm import certify_sweep

            chosen, table = certify_sweep(self, frame, out)
        write_report(frame, out, reference_accuracy=ref_acc, budgets=self.s["budgets"],
                     winners_acceptance=winners or None, noise_floor=floor, title=self.name, certification=table)
        self.write_flips_page(frame, out)
        frontier.write(frontier.from_sweep(self, frame, chosen), out, self.name)  # what limits the speed
        self.tracker.log_report(out, chosen)
        return chosen

    def write_flips_page(self, frame: Any, out: Path) -> None:
        """``report/flips.md``: the confirmed candidates' flipped items (confirmation split), then each
        finished trial's (search split), both outputs side by side; linked from report.md."""
        sections = [(h, p) for h, p in self.flips.items() if h.startswith("confirmation")]
        for row in sorted(frame.iter_rows(named=True), key=lambda r: r["trial"]) if len(frame) else []:
            spec = self.spec_of(row)
            sections.append((f"trial {row['trial']}: {spec.label()} (search split)",
                             self.dir / "trials" / f"{slug(spec.label())}-{spec.key()}" / "flips.parquet"))
        (out / "flips.md").write_text(flips_page(sections, self.name, per_section=10))
        report = out / "report.md"
        if report.is_file() and "flips.md" not in report.read_text():
            report.write_text(report.read_text().rstrip("\n") + "\n\nFlipped items, both outputs side by side, per "
                              "confirmed candidate and per trial: [flips.md](flips.md)\n")

    def base_choice(self, budget: float) -> dict[str, Any]:
        return {"budget": budget, "pair": self.args.pair, "benchmark": self.bench.name, "dtype": self.args.dtype,
                "sweep": self.name, "parent_run_id": self.tracker.parent_id, "decode": self.s["decode"],
                "engine": self.args.engine, "split": self.split, "search_items": len(self.items),
                **({"pair_fingerprint": self.ledger.pair_id} if getattr(self, "ledger", None) else {})}

    def spec_of(self, row: dict) -> DecodeSpec:
        return DecodeSpec.make(row["family"], json.loads(row["params"]), row["draft_len"], **self.s["decode"])

    def acceptance(self, row: dict) -> tuple[int, list[int]]:
        spec = self.spec_of(row)
        store = RecordStore(self.dir / "trials" / f"{slug(spec.label())}-{spec.key()}")
        recs = [r for r in store.load().values() if not r.failed]
        counts = [0] * spec.draft_len
        for r in recs:
            counts = [a + b for a, b in zip(counts, r.accepted_per_position, strict=False)]
        return sum(r.num_drafts for r in recs), counts

    def best_text(self) -> str:
        """The search split's best modelled speedup per budget so far (point estimates: a
        description of the search, not a certificate)."""
        frame = self.trials_frame()
        best = []
        for b in self.s["budgets"]:
            ok = frame.filter((frame["state"] == "COMPLETE") & (frame["accuracy_drop"] <= b)) if len(frame) else frame
            best.append(f"≤{b * 100:g}%: {ok['speedup'].max():.2f}x" if len(ok) else f"≤{b * 100:g}%: -")
        return f"search best ({self.args.objective}) " + ", ".join(best)

    def run(self) -> dict[str, Any]:
        self.elapsed: list[float] = []
        self.refs[TARGET_ONLY] = self.reference(DecodeSpec.make(TARGET_ONLY, **self.s["decode"]), "target-only reference")
        self.resume_stale()
        for params in self.s["enqueue"]:
            self.study.enqueue_trial(params, skip_if_exists=True)
        if self.finished() >= self.args.trials:
            log(f"study {self.name} already has {self.finished()} finished trials: reporting only")
        from cluster.pair_actor import release

        try:
            while self.finished() < self.args.trials:
                self.run_one()
                if self.finished() % 4 == 0:
                    self.report()
            search_cost(self)
            chosen = self.report(final=not self.args.search_only)
            if self.args.search_only:
                log("--search-only: the search is done; the same command without it confirms")
            self.tracker.end()
        finally:  # Ctrl-C or SIGTERM too: the engines' processes go with the actors
            release(self.workers)
        return chosen


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    return {f"version.{p}": md.version(p) for p in ("torch", "transformers", "ray", "optuna", "mlflow")}


def _exit_on_sigterm() -> None:
    """SIGTERM (``kill``, ``ray job stop``) unwinds like Ctrl-C, so the actors release their engines."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    _exit_on_sigterm()
    try:
        settings = parse_settings(args)
        from workers.results.store import persistent_dir

        runs_root(args.runs_root)  # a root inside a Ray job's temporary working_dir copy fails now, not at the end
        if args.run_dir:
            persistent_dir(args.run_dir, "--run-dir")
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    sweep = Sweep(args, settings)
    run_dir = Path(sweep.dir).resolve()
    log(f"run directory: {run_dir}")
    chosen = sweep.run()
    summary = {b: {k: c.get(k) for k in ("policy", "params", "draft_len", "trial", "certified")}
               | {k: (c.get("certification") or {}).get(k) for k in ("bound", "n", "discordance", "items_needed")}
               for b, c in chosen.items()}
    print(json.dumps({"run_dir": str(run_dir), "parent_run_id": sweep.tracker.parent_id,
                      "report": str(run_dir / "report" / "report.md"),
                      "certification": str(run_dir / "report" / "certification.md"), "chosen": summary},
                     indent=1, default=str), flush=True)
    import shlex

    log(f"run directory: {run_dir} (rerunning the same command resumes it)")
    log(f"MLflow UI, from the checkout: .venv/bin/python -m jobs.tracking ui --run-dir {shlex.quote(str(run_dir))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
