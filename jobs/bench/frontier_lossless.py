"""Lossless speculative decoding at every draft length of an exported study, recomputed on the study's own
search items with this checkout's code, and the frontier page's lossless table rebuilt from it.

    python -m jobs.bench.frontier_lossless --from docs/results/gsm8k-int4-frontier [--runs-root DIR]
        [--actors 2] [--write]

``--from``: an exported study (``jobs.results export``): its ``sweep.json`` names the pair, dtype, benchmark,
draft-length range and decoding settings, ``search_items.txt`` the items its search used. The command opens the
sweep's own machinery on those settings (``sweep.settings.parse_settings``, pair actors on a local Ray, the
actors' calibration at the items' context as a sweep makes it, ``workers.evaluation.workload_profile``) and asks
``sweep.references.References.lossless_range``, as a sweep's search does: target-only decoding on the items (the
only decoding it does), then lossless at every L of the range by replay, one teacher-forced pass per item for all
of them (``cluster.pool.run_bundles``). Its records go to the reference stores under ``--runs-root``
(``<root>/references/``), so a rerun resumes where it stopped and, once they are complete, only prices them again.
Progress lines (items done, items/s, tokens/s, ETA) go to stderr.

Prints the lossless table at every L, the best lossless and the ceiling twice: priced with the study's own cost
model (its ``sweep.json`` profile: the c and v(L) its trials were priced with, so the page's rows compare) and with
this machine's calibration; writes both with their provenance (the code's commit and dirty files, the fast path's
numerics version, replay's version, the machine, its load before and after) to ``--out`` (default
``<runs root>/frontier-lossless/<study>.json``). ``--write`` rewrites the folder's ``frontier.json`` and
``frontier.md`` (``--result FILE``: from an earlier run's ``--out``, running nothing): the lossless table, the best lossless, the ceiling and v(L) from the recomputation (priced with
the study's cost model), ``lossless_source`` saying where they came from, everything else as it was.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from workers.cli import one_line_errors
from workers.engine_registry import engine_traits

ROOT = Path(__file__).resolve().parents[2]
KEEP = ("trials", "pareto", "budgets", "lost_items")  # the page's parts the recomputation leaves as they were


def log(msg: str) -> None:
    print(f"[frontier-lossless {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m jobs.bench.frontier_lossless",
                                 description="Recompute lossless at every L on an exported study's search items "
                                             "and rebuild its frontier page's lossless table.")
    ap.add_argument("--from", dest="folder", required=True,
                    help="an exported study (sweep.json, search_items.txt, frontier.json)")
    ap.add_argument("--runs-root", default=None,
                    help="where the reference stores go (default: $SPECTUNE_RUNS or ./runs); a rerun resumes there")
    ap.add_argument("--actors", type=int, default=None,
                    help="pair actors (default: as the study's sweep would start them here, one per CPU memory allows)")
    ap.add_argument("--out", default=None, help="the result as JSON (default <runs root>/frontier-lossless/<study>.json)")
    ap.add_argument("--write", action="store_true", help="rewrite the folder's frontier.json and frontier.md")
    ap.add_argument("--study-profile", default=None,
                    help="the study's calibration: a sweep.json holding its 'profile' (a run directory's), or the "
                         "profile itself (default: the folder's sweep.json, else frontier.json's cost_model.profile)")
    ap.add_argument("--study-code", default=None,
                    help="what code the study ran on, as its records name it (e.g. git:e001f3593e36): said on the page")
    ap.add_argument("--result", default=None,
                    help="with --write: rewrite the page from this earlier run's --out file, running nothing")
    return ap


# -- the study ---------------------------------------------------------------------------------------


def study_args(meta: Mapping[str, Any], runs_root: str | None, actors: int | None) -> argparse.Namespace:
    """The study's sweep options (``sweep.json``'s ``args``) over this checkout's defaults, without its config
    files, run directory or cluster address: a new run on this machine with the same settings."""
    from jobs.sweep_args import build_parser as sweep_parser

    ns = vars(sweep_parser().parse_args([]))
    known = {k: v for k, v in meta["args"].items() if k in ns}
    ns.update(known)
    ns.update(config=None, run_dir=None, address=None, runs_root=runs_root, actors=actors, trial_timeout=None)
    return argparse.Namespace(**ns)


def study_profile(folder: Path, given: str | None) -> dict[str, Any]:
    """The calibration the study priced its trials with: ``given`` (a sweep.json with a ``profile``, or a profile),
    else the folder's sweep.json ``profile``, else its frontier.json ``cost_model.profile`` (written there by
    ``--write``); an exported sweep.json may lack it."""
    def of(data: Mapping[str, Any]) -> dict[str, Any] | None:
        got = data.get("profile", data if "verify_s" in data else None)
        return dict(got) if isinstance(got, Mapping) and got.get("verify_s") else None

    if given is not None:
        found = of(json.loads(Path(given).read_text()))
        if found is None:
            raise ValueError(f"{given} holds no calibration profile (cost_ratio, verify_s)")
        return found
    found = of(json.loads((folder / "sweep.json").read_text())) or of(
        json.loads((folder / "frontier.json").read_text()).get("cost_model") or {})
    if found is None:
        raise ValueError(f"{folder} keeps no calibration profile of the study (sweep.json's profile, or frontier.json's "
                         "cost_model.profile): give --study-profile (the study's run directory's sweep.json), so the "
                         "table is priced as its trials were")
    return found


def study_items(settings: Any, folder: Path) -> list[Any]:
    """The study's search items, drawn as its sweep drew them, checked against the ids it exported."""
    args = settings.args
    items = settings.bench.items(limit=args.items or None, seed=args.subset_seed, split="search")
    listed = (folder / "search_items.txt").read_text().split()
    if [it.id for it in items] != listed:
        raise ValueError(f"{folder / 'search_items.txt'} lists {len(listed)} items that are not the {len(items)} this "
                         f"checkout draws for the study's settings (--items {args.items}, --subset-seed "
                         f"{args.subset_seed}): the benchmark's items or their order changed")
    return items


# -- where it ran ------------------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    """The CPU, whether it has avx512_bf16, how many CPUs, and the load (``uptime``)."""
    model, flags = "unknown", ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model == "unknown":
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = line
    except OSError:
        pass
    try:
        uptime = subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        uptime = ""
    return {"cpu": model, "cpus": os.cpu_count(), "avx512_bf16": "avx512_bf16" in flags.split(),
            "load_1m": os.getloadavg()[0], "uptime": uptime}


def code() -> dict[str, Any]:
    """This checkout's commit, the tracked files changed from it when the run started, and the versions that
    key the fast path's outputs and replay's semantics."""
    from workers.models.pair import FAST_NUMERICS
    from workers.replay import REPLAY_VERSION

    def git(*argv: str) -> str:
        try:
            return subprocess.run(["git", "-C", str(ROOT), *argv], capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.TimeoutExpired):
            return ""

    dirty = [line[3:] for line in git("status", "--porcelain", "--untracked-files=no").splitlines() if line.strip()]
    return {"commit": git("rev-parse", "HEAD").strip(), "dirty_files": dirty, "fast_numerics": FAST_NUMERICS,
            "replay_version": REPLAY_VERSION}


# -- the numbers -------------------------------------------------------------------------------------


def cost_model(profile: Mapping[str, Any]) -> Any:
    from workers.metrics.cost import CostModel

    return CostModel.from_profile(profile)


def priced(lossless: Mapping[int, Mapping[str, Any]], profile: Mapping[str, Any]) -> dict[str, Any]:
    """The frontier's lossless part (``workers.metrics.frontier.summary``: lossless at every L, the best, the
    ceiling, c and v(L)) of ``lossless`` (L -> records; L 0 target-only) priced with ``profile``'s cost model."""
    from workers.metrics.frontier import summary

    cm = cost_model(profile)
    s = summary(lossless=lossless, cost_ratio=cm.cost_ratio, verify_factor=cm.verify, frame=None, chosen={},
                profile=profile)
    return {k: s[k] for k in ("cost_model", "lossless", "best_lossless", "ceiling", "ceiling_best")}


def page(old: Mapping[str, Any], study: Mapping[str, Any], here: Mapping[str, Any],
         source: Mapping[str, Any]) -> dict[str, Any]:
    """The frontier page's numbers with the recomputed lossless part: ``study`` (priced with the study's cost model,
    :func:`priced`) in place of the page's lossless table, best lossless, ceiling and v(L); ``here`` (priced with this
    machine's calibration) and where both came from under ``lossless_source``; the trials, the Pareto front, the
    budgets and the lost items as the page had them."""
    if not study["lossless"] or not math.isfinite(study["best_lossless"]["tokens_per_cost"]):
        raise ValueError("the recomputed lossless table is empty: nothing to write")
    cm = dict(old["cost_model"])
    if not math.isclose(cm["cost_ratio"], study["cost_model"]["cost_ratio"], rel_tol=1e-9):
        raise ValueError(f"the page prices with c = {cm['cost_ratio']}, the study's profile says "
                         f"{study['cost_model']['cost_ratio']}: not the study's cost model")
    cm["verify_factor"] = study["cost_model"]["verify_factor"]
    if "study_profile" in source:
        cm["profile"] = source["study_profile"]  # the study's calibration (c, v(L)): a rerun prices with it again
    return {"cost_model": cm, **{k: study[k] for k in ("lossless", "best_lossless", "ceiling", "ceiling_best")},
            **{k: old[k] for k in KEEP if k in old},
            "lossless_source": {**source, "this_machine": {k: here[k] for k in
                                                           ("cost_model", "lossless", "best_lossless", "ceiling_best")}}}


def table(part: Mapping[str, Any]) -> str:
    rows = [f"{'L':>3} {'acc.len':>8} {'accepted':>9} {'vs target-only':>15} {'vs best':>8} {'ceiling vs best':>16}"]
    for r, c in zip(part["lossless"], part["ceiling"], strict=True):
        rows.append(f"{r['draft_len']:>3} {r['acceptance_length']:>8.2f} {r['accepted_share']:>9.1%} "
                    f"{r['vs_target_only']:>14.2f}x {r['vs_best_lossless']:>7.2f}x {c['vs_best_lossless']:>15.2f}x")
    best = part["best_lossless"]
    n = part["lossless"][0]["items"] if part["lossless"] else 0
    rows.append(f"n = {n}; best lossless L {best['draft_len']} at {best['tokens_per_cost']:.2f}x target-only; "
                f"ceiling {part['ceiling_best']:.2f}x the best lossless (c = {part['cost_model']['cost_ratio']:.3f})")
    return "\n".join(rows)


# -- the run -----------------------------------------------------------------------------------------


def recompute(folder: Path, runs_root: str | None, actors: int | None) -> dict[str, Any]:
    """Target-only and lossless at every L of the study's range on its search items (resumable), with the actors'
    calibration at the items' context and where it ran."""
    from cluster.pair_actor import make_workers, profile_of, release
    from cluster.runtime import default_num_actors, init_ray
    from sweep.references import References
    from sweep.settings import parse_settings
    from workers.evaluation import TARGET_ONLY, DecodeSpec
    from workers.results.store import runs_root as resolve_root

    meta = json.loads((folder / "sweep.json").read_text())
    settings = parse_settings(study_args(meta, runs_root, actors))
    args = settings.args
    if not engine_traits(args.engine).exact_replay or settings.decode["temperature"] != 0.0:
        raise ValueError(f"lossless at every L by replay needs the CPU engine at T = 0; the study ran --engine "
                         f"{args.engine} at T = {settings.decode['temperature']}")
    items = study_items(settings, folder)
    root = resolve_root(args.runs_root)
    started = {"machine": machine(), "code": code(), "at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    log(f"study {meta['study']}: {len(items)} search items, {args.pair} {args.dtype}, {args.benchmark} "
        f"{settings.decode['shots']}-shot, T = {settings.decode['temperature']}, max_new_tokens "
        f"{settings.decode['max_new_tokens']}, L {settings.lengths[0]}..{settings.lengths[-1]}; references under {root}")
    m, c = started["machine"], started["code"]
    log(f"machine: {m['cpu']}, {m['cpus']} CPUs, avx512_bf16 {'yes' if m['avx512_bf16'] else 'no'}; {m['uptime']}")
    log(f"code: {c['commit'][:12]}{' + ' + str(len(c['dirty_files'])) + ' changed file(s)' if c['dirty_files'] else ''}"
        f", FAST_NUMERICS {c['fast_numerics']}, REPLAY_VERSION {c['replay_version']}")
    t0 = time.perf_counter()
    init_ray(None)
    n = args.actors or default_num_actors(int(args.actor_memory_gb * 2**30), max(1, int(args.cpus_per_actor)))
    log(f"starting {n} pair actor(s), {max(1, int(args.cpus_per_actor))} thread(s) each")
    workers = make_workers(n, args.pair, args.dtype, cpus_per_actor=args.cpus_per_actor, engine=args.engine,
                           draft_len=settings.draft_len[0])
    try:
        log("calibrating at the items' context (workers.evaluation.workload_profile, as a sweep does)")
        profile = profile_of(workers[0], settings.bench.ref, items, DecodeSpec.make(TARGET_ONLY, **settings.decode))
        cm = cost_model(profile)
        log(f"c = {cm.cost_ratio:.3f} at {profile['context']} positions, load {profile['load_1m']:.2f}; v(L): "
            + ", ".join(f"{n}: {cm.verify(n):.2f}" for n in settings.lengths))
        refs = References(settings, root, workers, items)
        lossless = refs.lossless_range()
    finally:
        release(workers)
    return {"study": meta["study"], "settings": {**settings.decode, "pair": args.pair, "dtype": args.dtype,
                                                 "benchmark": args.benchmark, "lengths": settings.lengths,
                                                 "items": len(items), "actors": n,
                                                 "threads_per_actor": max(1, int(args.cpus_per_actor))},
            "started": started, "ended": {"machine": machine(), "wall_s": time.perf_counter() - t0},
            "profile": profile, "records": lossless, "root": str(root)}


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    folder = Path(args.folder)
    for name in ("sweep.json", "search_items.txt", "frontier.json"):
        if not (folder / name).is_file():
            raise ValueError(f"{folder} has no {name}: give an exported study (jobs.results export)")
    if args.result is not None:
        if not args.write:
            raise ValueError("--result goes with --write (it rewrites the page from an earlier run's result)")
        saved = json.loads(Path(args.result).read_text())
        if args.study_code is not None:
            saved["source"]["study_code"] = args.study_code
        write_page(folder, saved["study_cost_model"], saved["this_machine"], saved["source"])
        return 0
    profile = study_profile(folder, args.study_profile)  # before an hour of decoding, not after
    run = recompute(folder, args.runs_root, args.actors)
    run["study_profile"] = profile
    records = run.pop("records")
    failed = {n: sum(r.failed for r in recs.values()) for n, recs in records.items()}
    if any(failed.values()):
        log(f"failed items per L: {failed}")
    study, here = priced(records, run["study_profile"]), priced(records, run["profile"])
    print("priced with the study's cost model (its sweep.json profile):\n" + table(study))
    print("priced with this machine's calibration:\n" + table(here))
    source = {"study": run["study"], "settings": run["settings"], "code": run["started"]["code"],
              "machine": {**run["started"]["machine"], "load_1m_after": run["ended"]["machine"]["load_1m"],
                          "uptime_after": run["ended"]["machine"]["uptime"]},
              "at": run["started"]["at"], "wall_s": run["ended"]["wall_s"], "calibration": run["profile"],
              "study_profile": run["study_profile"],
              "records_code": sorted({r.code for recs in records.values() for r in recs.values()}),
              "failed_items": failed, **({"study_code": args.study_code} if args.study_code else {})}
    out = Path(args.out) if args.out else Path(run["root"]) / "frontier-lossless" / f"{run['study']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"source": source, "study_cost_model": study, "this_machine": here}, indent=1,
                              default=str, allow_nan=True) + "\n")
    log(f"written: {out}")
    if args.write:
        write_page(folder, study, here, source)
    return 0


def write_page(folder: Path, study: Mapping[str, Any], here: Mapping[str, Any], source: Mapping[str, Any]) -> None:
    from dashboards import frontier as frontier_page
    from workers.models.calibrate import under_load

    cal = source.get("calibration") or {}
    # a calibration timed beside other work times the contention: the page says so beside its figures
    source = {**source, "calibration_under_load": under_load(float(cal.get("load_1m") or 0.0),
                                                             (source.get("machine") or {}).get("cpus"))}

    old = json.loads((folder / "frontier.json").read_text())
    frontier_page.write(page(old, study, here, source), folder, source["study"])
    log(f"rewritten: {folder / 'frontier.json'}, {folder / 'frontier.md'}")


if __name__ == "__main__":
    raise SystemExit(main())
