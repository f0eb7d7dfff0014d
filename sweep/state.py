"""The sweep's state: what every phase reads, made once per command invocation by :func:`open_sweep`.

A :class:`SweepState` is frozen: phases take it and return values (a trial's outcome, an attempt, the
chosen rules); none sets anything on it. What changes during a sweep lives in the objects it holds, each
the owner of its own: the Optuna study (trials), the tracker (MLflow runs), the references (cached records,
``sweep.references``).
"""

from __future__ import annotations

import json
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sweep.progress import log
from sweep.settings import Settings, endpoint_options, make_sampler, study_name, vllm_options
from workers.engine_registry import engine_traits
from workers.evaluation import TARGET_ONLY, DecodeSpec
from workers.metrics.cost import CostModel
from workers.results.store import runs_root, write_text

if TYPE_CHECKING:
    import optuna

    from sweep.references import References
    from sweep.tracking import SweepTracker
    from workers.benchmarks.base import Item


@dataclass(frozen=True)
class SweepState:
    settings: Settings
    name: str  # the study's (its identity: rerunning the same command resumes it)
    root: Path  # the runs root (reference caches)
    dir: Path  # this study's run directory
    items: list[Item]  # the search sample (the search split's first --items in seeded order)
    pool: list[Item]  # the confirmation pool: every item held apart from the search sample, in its fixed order
    n_confirm: int  # the confirmation items planned (the ledger gives the attempt which, ``sweep.confirm``)
    split: dict[str, Any]  # the split's description and the pool's composition
    workers: list[Any]  # the pair actors
    profile: dict[str, Any]  # the first actor's calibration (c, verify pass timings, machine, load)
    cost: CostModel  # c (--cost-ratio, else the profile's) and v(L) (--verify-factor, else the profile's)
    study: optuna.Study
    tracker: SweepTracker
    refs: References

    @property
    def args(self) -> Any:
        return self.settings.args

    @property
    def bench(self) -> Any:
        return self.settings.bench

    @property
    def confirm_planned(self) -> list[Item]:
        """The pool's first ``n_confirm`` items: the attempt's items unless the ledger gives others."""
        return self.pool[: self.n_confirm]


def optuna_storage(args: Any, run_dir: Path) -> str:
    """``--optuna-storage`` (a team's database URL), else a sqlite file under the run directory."""
    return getattr(args, "optuna_storage", None) or f"sqlite:///{run_dir / 'optuna.db'}"


def open_sweep(settings: Settings, config_yaml: str) -> SweepState:
    """The run directory, the search sample and the confirmation pool, a local (or given) Ray with the pair
    actors, the Optuna study (resumed where it exists) and the MLflow parent run. ``config_yaml``: every option
    as it runs (the command's parser dumps it), kept as the run directory's ``config.yaml``."""
    import optuna

    from cluster.pair_actor import make_workers, profile_of
    from cluster.runtime import default_num_actors, init_ray
    from cluster.startup import Watch
    from sweep.references import References
    from sweep.tracking import SweepTracker

    args, bench = settings.args, settings.bench
    root = runs_root(args.runs_root)
    name = study_name(settings)
    run_dir = Path(args.run_dir) if args.run_dir else root / "sweeps" / name
    run_dir.mkdir(parents=True, exist_ok=True)
    items = bench.items(limit=args.items or None, seed=args.subset_seed, split="search")
    # the confirmation pool: every item held apart from the search sample (the confirm split and the search-split
    # rows the sample did not use), in seeded order; --confirm-items takes its first N
    pool, sources = bench.confirmation_pool(items)
    wanted = args.items if args.confirm_items is None else args.confirm_items
    n_confirm = min(wanted, len(pool)) if wanted else len(pool)
    split = {**bench.split_info(), "pool": len(pool), "pool_sources": sources, "confirm_used": n_confirm,
             "search_sample": len(items)}
    log(f"search sample: {len(items)} items; confirmation pool: {len(pool)} held-apart items "
        f"({', '.join(f'{k} {v}' for k, v in sources.items())}), {n_confirm} used")
    if not args.search_only:
        from sweep.settings import family_line

        log(family_line(settings))
    init_ray(args.address)
    # a server's clients hold no model: two by default (the speed phase times on one, request by request)
    server = engine_traits(args.engine).needs_server
    n = args.actors or (2 if server else
                        default_num_actors(int(args.actor_memory_gb * 2**30), max(1, int(args.cpus_per_actor))))
    log(f"starting {n} pair actor(s) for {args.pair} ({args.dtype}); their progress follows")
    with Watch(log, f"the {n} pair actor(s)"):  # what each actor is loading, converting, calibrating, with an ETA
        workers = make_workers(n, args.pair, args.dtype, cpus_per_actor=args.cpus_per_actor,
                               gpus_per_actor=args.gpus_per_actor, tensor_parallel_size=args.tensor_parallel_size,
                               engine=args.engine, draft_len=settings.draft_len[0],
                               vllm=endpoint_options(args) if server else vllm_options(args),
                               python=getattr(args, "vllm_python", None), batch_size=args.batch_size)
        log(f"{n} pair actor(s) loaded; the cost profile at the search items' context (stored: read back; "
            "else measured on actor 1)")
        # timed at the context the search items decode at (8-shot prompts: ~1,410 tokens), not a fixed short one
        profile = profile_of(workers[0], bench.ref, items, DecodeSpec.make(TARGET_ONLY, **settings.decode))
        batch = batch_of(workers, bench.ref, items, DecodeSpec.make(TARGET_ONLY, **settings.decode))
    meta = run_dir / "sweep.json"
    before = json.loads(meta.read_text()) if meta.is_file() else {}
    profile = _study_profile(before.get("profile"), profile, args.engine)
    cost = CostModel.from_profile(profile, args.cost_ratio, getattr(args, "verify_factor", None))
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name=name, storage=optuna_storage(args, run_dir), load_if_exists=True,
                                directions=["maximize", "maximize"], sampler=make_sampler(args.seed, 0, args.trials))
    if study.trials:
        study.sampler = make_sampler(args.seed, len(study.trials), args.trials)
    tracker = SweepTracker(run_dir, getattr(args, "tracking_uri", None))
    parent = tracker.start_parent(
        name, {"benchmark": args.benchmark, "pair": args.pair, "dtype": args.dtype, "items": len(items),
               "confirm_items": n_confirm, "alpha": args.alpha,
               "split.search": split["search"], "split.confirm": split["confirm"],
               "split.pool": split["pool"], "split.pool_sources": json.dumps(split["pool_sources"]),
               "budgets": settings.budgets, "policies": settings.families, "draft_len_range": list(settings.draft_len),
               **settings.decode, "objective": args.objective, "cost_ratio": cost.cost_ratio, "actors": n,
               "batch_size": batch},
        {"machine": platform.node(), "python": platform.python_version(), "study": name,
         "run_dir": str(run_dir), **_versions()}, before.get("parent_run_id"))
    write_text(meta, json.dumps({"parent_run_id": parent, "study": name, "args": vars(args), "profile": profile,
                                 "runs_root": str(root.resolve())},  # where its references are (jobs.carry)
                                indent=1, default=str))  # default: the --config files' paths
    _save_config(run_dir, name, config_yaml, tracker)
    refs = References(settings, root, workers, items, batch=batch)
    return SweepState(settings=settings, name=name, root=root, dir=run_dir, items=items, pool=pool,
                      n_confirm=n_confirm, split=split, workers=workers, profile=profile, cost=cost, study=study,
                      tracker=tracker, refs=refs)


def batch_of(workers: list[Any], benchmark: str, items: list[Any], spec: Any) -> int:
    """The rows each CPU actor decodes at once (``--batch-size``; ``auto`` measured by each actor at the items'
    context), said once; the smallest where the actors differ (a shard is cut for all of them)."""
    from cluster.pool import batch_choices

    chosen = batch_choices(workers, benchmark, items, spec)
    size = min(c["batch_size"] for c in chosen)
    if size > 1 or any(c.get("choice") for c in chosen):
        why = chosen[0].get("choice") or {}
        log(f"batched CPU engine: {size} item(s) at once per actor, each row exact to batch 1"
            + (f" (auto: {why.get('why') or 'rows/s ' + str(why.get('rows_per_s'))} at {why.get('context')} positions)"
               if why else ""))
    return size


def _study_profile(recorded: dict[str, Any] | None, fresh: dict[str, Any], engine: str) -> dict[str, Any]:
    """The calibration a study models speed with: on the CPU engine, the one its first start recorded, so every trial
    of a resumed study is scored with one c and one v(L) (a profile measured again on resume, or the machine's
    memory rate moving between sessions, would otherwise score its later trials on another scale); said when this
    start's profile differs. Other engines take this start's (their c comes from --cost-ratio; an endpoint's profile
    carries what the server says it serves)."""
    if not engine_traits(engine).measures_cost or not isinstance(recorded, dict) or "cost_ratio" not in recorded:
        return fresh
    if recorded != fresh:
        log(f"resumed with the study's own calibration (c = {float(recorded['cost_ratio']):.3f}, measured at load "
            f"{float(recorded.get('load_1m') or 0):.2f}); this start's profile says c = {float(fresh['cost_ratio']):.3f}: "
            "one study, one cost model")
    return recorded


def _save_config(run_dir: Path, name: str, config_yaml: str, tracker: SweepTracker) -> None:
    """The effective config (file and flags merged, as resolved) as ``config.yaml`` in the run directory and on
    the parent MLflow run; a resumed sweep run with other options (more --trials, say) keeps the one before as
    ``config.prev.yaml``."""
    text = (f"# study {name}, every option as it ran: `python jobs/sweep.py --config <this file>` "
            f"resumes it\n{config_yaml}")
    path = run_dir / "config.yaml"
    if path.is_file() and path.read_text() != text:
        path.replace(run_dir / "config.prev.yaml")
    write_text(path, text)
    tracker.log_artifact(path)


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    return {f"version.{p}": md.version(p) for p in ("torch", "transformers", "ray", "optuna", "mlflow")}
