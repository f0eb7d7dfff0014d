"""``python -m workers.benchmarks.dataframebench_check [--write]``: run every DataFrameBench task's reference
solution three times in the data sandbox; the tasks failing any run are excluded (``dataframebench_excluded.json``,
committed, with the reason and the command that recomputes it). CI checks a sample (tests/.../test_dataframebench.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from workers.benchmarks.base import Item
from workers.benchmarks.dataframebench import CHECK_RUNS, EXCLUDED_FILE, DataFrameBench, missing_module


def check(bench: DataFrameBench, items: list[Item], runs: int = CHECK_RUNS, workers: int = 2
          ) -> tuple[dict[str, str], list[float]]:
    """Run every item's reference ``runs`` times; ``({id: reason} of those failing any run, wall seconds)``."""
    def one(item: Item) -> tuple[str, str | None, float]:
        t0 = time.perf_counter()
        for run in range(runs):
            res = bench.run(item, item.reference["solution"])
            if not res.passed:
                why = f"missing module {mod}" if (mod := missing_module(res)) else f"{res.status}: {res.reason}"
                return item.id, f"run {run + 1}/{runs}: {why}"[:300], time.perf_counter() - t0
        return item.id, None, time.perf_counter() - t0

    bad: dict[str, str] = {}
    walls: list[float] = []
    with ThreadPoolExecutor(workers) as pool:
        for n, (item_id, why, wall) in enumerate(pool.map(one, items), 1):
            walls.append(wall)
            if why is not None:
                bad[item_id] = why
            if n % 25 == 0:
                print(f"[dataframebench check] {n}/{len(items)} done, {len(bad)} excluded", file=sys.stderr, flush=True)
    return bad, walls


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.benchmarks.dataframebench_check",
                                     description="Run every task's reference solution in the data sandbox and "
                                                 "write the exclusion list (tasks failing any run).")
    parser.add_argument("--runs", type=int, default=CHECK_RUNS)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--limit", type=int, default=None, help="only the first N tasks (a sample; writes nothing)")
    parser.add_argument("--write", action="store_true", help=f"write {EXCLUDED_FILE.name} (all tasks only)")
    parser.add_argument("--cache-dir", default=None)
    args = parser.parse_args(argv)
    bench = DataFrameBench()
    items = bench.all_items(args.cache_dir)[:args.limit]
    t0 = time.perf_counter()
    bad, walls = check(bench, items, args.runs, args.workers)
    wall = time.perf_counter() - t0
    per_run = sum(walls) / max(1, len(walls)) / args.runs
    print(f"{len(items)} tasks x {args.runs} runs in {wall:.0f}s with {args.workers} workers "
          f"(~{per_run:.1f}s per reference run); {len(bad)} excluded")
    for item_id, why in sorted(bad.items()):
        print(f"  {item_id}: {why}")
    if args.write:
        if args.limit is not None:
            parser.error("--write needs every task (no --limit)")
        EXCLUDED_FILE.write_text(json.dumps({
            "command": f"python -m workers.benchmarks.dataframebench_check --runs {args.runs} --write",
            "runs": args.runs, "tasks": len(items), "excluded_count": len(bad),
            "excluded": dict(sorted(bad.items()))}, indent=1) + "\n")
        print(f"wrote {EXCLUDED_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
