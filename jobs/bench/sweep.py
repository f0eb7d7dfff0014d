"""Benchmark: sweep throughput with 1 vs 2 pair actors, and where a trial's time goes.

    python -m jobs.bench.sweep [--pair tiny-random] [--items 24] [--trials 4] [--max-new-tokens 32]

Runs the same small sweep (same items, same seeded trial sequence, references computed before
the first trial) once per actor count in one process, one after the other, and reads each
sweep's ``timing.jsonl``: items/s per trial, generation seconds in the engines, dispatch
overhead (trial wall time minus generation time per actor: Ray Data shards, actor calls, the
wait for the slowest shard) and bookkeeping outside the trial (Optuna ask/tell, aggregation,
MLflow logging). Prints a markdown table with the machine's CPU count and load. No assertions.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


def run_sweep(root: Path, actors: int, args: argparse.Namespace) -> list[dict]:
    from jobs import sweep as sweep_job

    run_dir = root / f"actors-{actors}"
    argv = ["--benchmark", "gsm8k", "--pair", args.pair, "--dtype", args.dtype, "--items", str(args.items),
            "--max-new-tokens", str(args.max_new_tokens), "--actors", str(actors), "--cpus-per-actor",
            str(args.cpus_per_actor), "--trials", str(args.trials), "--policies", "kl_judge,top_k",
            "--draft-len", "3", "--cost-ratio", "0.4", "--budgets", "0.99", "--min-items-to-prune", "1000",
            "--runs-root", str(root), "--run-dir", str(run_dir)]
    if sweep_job.main(argv) != 0:
        raise SystemExit(f"the sweep with {actors} actor(s) failed")
    return [json.loads(line) for line in (run_dir / "timing.jsonl").read_text().splitlines()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", default="tiny-random")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--items", type=int, default=24)
    ap.add_argument("--trials", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--cpus-per-actor", type=float, default=1.0)
    ap.add_argument("--actors", default="1,2", help="actor counts to compare")
    args = ap.parse_args(argv)
    try:
        counts = [int(a) for a in args.actors.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1 or args.items < 1 or args.trials < 1 or args.max_new_tokens < 1:
        ap.error(f"--actors must be comma-separated integers >= 1 (got {args.actors!r}); --items, --trials, "
                 "--max-new-tokens >= 1")
    rows: dict[int, list[dict]] = {}
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="bench-sweep-") as tmp:
        for n in counts:
            t0 = time.perf_counter()
            rows[n] = run_sweep(Path(tmp), n, args)
            load.append(os.getloadavg()[0])
            print(f"{n} actor(s): {len(rows[n])} trials in {time.perf_counter() - t0:.0f}s", file=sys.stderr)
    lines = [f"pair {args.pair} {args.dtype}, {args.items} GSM8K items x {args.trials} trials, max_new_tokens "
             f"{args.max_new_tokens}, {args.cpus_per_actor} CPU per actor; {os.cpu_count()} CPUs, load(1m) "
             f"{min(load):.2f}–{max(load):.2f}", "",
             "| actors | items/s (mean of trials) | trial wall s | generation s (sum over items) | dispatch overhead s "
             "| bookkeeping s per trial | speedup vs 1 actor |", "|---:|---:|---:|---:|---:|---:|---:|"]
    base = statistics.mean(r["items_per_s"] for r in rows[counts[0]])
    for n in counts:
        r = rows[n]

        def mean(k: str, r: list[dict] = r) -> float:
            return statistics.mean(x[k] for x in r)

        lines.append(f"| {n} | {mean('items_per_s'):.2f} | {mean('trial_wall_s'):.1f} | {mean('generation_s'):.1f} | "
                     f"{mean('dispatch_overhead_s'):.2f} | {mean('bookkeeping_s'):.2f} | {mean('items_per_s') / base:.2f}x |")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
