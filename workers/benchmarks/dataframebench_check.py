"""``python -m workers.benchmarks.dataframebench_check [--write]``: run every DataFrameBench task's reference
solution three times in the data sandbox; a task failing any run is excluded. ``--write`` writes
``dataframebench_excluded.json`` (committed: each excluded task with its reason, the command that recomputes it).

Tasks that need a library the sandbox venv leaves out (``constraints/sandbox.txt``) are excluded without a run.
Every finished task is appended to a log (``--log``, default ``<cache>/benchmarks/dataframebench/check-log.jsonl``)
so a cut-short check resumes where it stopped; a task the log does not hold yet is excluded as "not checked"
(a task is an item only once its reference has passed every run). CI rechecks a sample
(``tests/workers/benchmarks/test_dataframebench.py``), not all 825: three runs of every task take over an hour
on two cores.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from workers.benchmarks.base import Item
from workers.benchmarks.data import benchmark_dir
from workers.benchmarks.dataframebench import CHECK_RUNS, EXCLUDED_FILE, DataFrameBench, missing_module

# import names the sandbox venv provides (constraints/sandbox.txt); with the standard library, what a task may need
SANDBOX_MODULES = frozenset("pandas numpy matplotlib seaborn scipy sklearn scikit-learn dateutil pytz".split())


def lacking(item: Item) -> list[str]:
    """The task's libraries that are neither standard nor in the sandbox venv."""
    return sorted(set(item.reference["libs"]) - set(sys.stdlib_module_names) - SANDBOX_MODULES)


def check_one(bench: DataFrameBench, item: Item, runs: int = CHECK_RUNS) -> dict:
    """``{id, runs, reason (None: passed every run), wall_s}`` for one task."""
    t0 = time.perf_counter()
    if need := lacking(item):
        return {"id": item.id, "runs": 0, "reason": f"needs {', '.join(need)}, which the sandbox venv leaves out",
                "wall_s": 0.0}
    for run in range(runs):
        res = bench.run(item, item.reference["solution"])
        if not res.passed:
            why = f"missing module {mod}" if (mod := missing_module(res)) else f"{res.status}: {res.reason}"
            return {"id": item.id, "runs": run + 1, "reason": f"run {run + 1}/{runs}: {why}"[:300],
                    "wall_s": round(time.perf_counter() - t0, 2)}
    return {"id": item.id, "runs": runs, "reason": None, "wall_s": round(time.perf_counter() - t0, 2)}


def check(bench: DataFrameBench, items: list[Item], runs: int = CHECK_RUNS, workers: int = 2,
          log: Path | None = None) -> dict[str, dict]:
    """Check every item not already in ``log`` (appending each result); ``{id: result}`` of all checked."""
    done: dict[str, dict] = {}
    if log is not None and log.exists():
        for line in log.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                done[row["id"]] = row
    todo = [it for it in items if it.id not in done]
    with ThreadPoolExecutor(workers) as pool:
        futures = [pool.submit(check_one, bench, it, runs) for it in todo]
        for n, fut in enumerate(as_completed(futures), 1):
            row = fut.result()
            done[row["id"]] = row
            if log is not None:
                log.parent.mkdir(parents=True, exist_ok=True)
                with log.open("a") as f:
                    f.write(json.dumps(row) + "\n")
            if n % 10 == 0:
                bad = sum(r["reason"] is not None for r in done.values())
                print(f"[dataframebench check] {n}/{len(todo)} checked, {bad} excluded", file=sys.stderr, flush=True)
    return done


def exclusion(items: list[Item], done: dict[str, dict], runs: int) -> dict:
    excluded = {it.id: done[it.id]["reason"] if it.id in done else "not checked yet (rerun the command)"
                for it in items if it.id not in done or done[it.id]["reason"] is not None}
    reasons: dict[str, int] = {}
    for why in excluded.values():
        key = (why.split(": ", 1)[1] if why.startswith("run ") else why).split(",")[0].split(" (")[0][:60]
        reasons[key] = reasons.get(key, 0) + 1
    return {"command": f"python -m workers.benchmarks.dataframebench_check --runs {runs} --write",
            "runs": runs, "tasks": len(items), "checked": sum(it.id in done for it in items),
            "excluded_count": len(excluded), "by_reason": dict(sorted(reasons.items(), key=lambda kv: -kv[1])),
            "excluded": dict(sorted(excluded.items()))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.benchmarks.dataframebench_check",
                                     description="Run every task's reference solution in the data sandbox and "
                                                 "write the exclusion list (tasks failing any run).")
    parser.add_argument("--runs", type=int, default=CHECK_RUNS)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--limit", type=int, default=None, help="only the first N tasks (a sample; writes nothing)")
    parser.add_argument("--log", type=Path, default=None, help="resumable log (default: in the benchmark's cache)")
    parser.add_argument("--write", action="store_true", help=f"write {EXCLUDED_FILE.name} (all tasks only)")
    parser.add_argument("--cache-dir", default=None)
    args = parser.parse_args(argv)
    if args.write and args.limit is not None:
        parser.error("--write needs every task (no --limit)")
    bench = DataFrameBench()
    items = bench.all_items(args.cache_dir)[:args.limit]
    log = args.log or benchmark_dir("dataframebench", args.cache_dir) / f"check-log-runs{args.runs}.jsonl"
    t0 = time.perf_counter()
    done = check(bench, items, args.runs, args.workers, None if args.limit is not None else log)
    ran = [r for r in done.values() if r["runs"]]
    per_run = sum(r["wall_s"] for r in ran) / max(1, sum(r["runs"] for r in ran))
    result = exclusion(items, done, args.runs)
    print(f"{len(items)} tasks, {result['checked']} checked ({args.runs} runs each) in {time.perf_counter() - t0:.0f}s "
          f"with {args.workers} workers (~{per_run:.1f}s per reference run); {result['excluded_count']} excluded: "
          f"{result['by_reason']}")
    if args.write:
        EXCLUDED_FILE.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {EXCLUDED_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
