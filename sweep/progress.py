"""The sweep's one log channel (:func:`log`), a live progress line for long evaluations (items done, items/s,
tokens/s, ETA), and a trial's ``timing.jsonl`` row (its log line and the search's cost: ``sweep.search``).

On a terminal the line is redrawn in place (``\\r``); in a log (``ray job logs``, CI, a file) a
line is printed at most every ``every_s`` seconds and at the end, so logs stay readable.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from workers.evaluation import Record


class Progress:
    def __init__(self, label: str, total: int, done: int = 0, extra: str = "", stream: TextIO | None = None,
                 every_s: float = 30.0) -> None:
        self.label, self.total, self.start_done, self.done, self.extra = label, total, done, done, extra
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every_s, self.t0, self.tokens, self.failed = every_s, time.perf_counter(), 0, 0
        self.last: float | None = None  # the first item always draws

    def update(self, record: Any = None) -> None:
        self.done += 1
        if record is not None:
            self.tokens += int(getattr(record, "tokens", 0) or 0)
            self.failed += bool(getattr(record, "failed", False))
        now = time.perf_counter()
        if self.tty or self.last is None or now - self.last >= self.every_s or self.done >= self.total:
            self.last = now
            self._draw(end="" if self.tty and self.done < self.total else "\n")

    def text(self) -> str:
        elapsed = max(1e-9, time.perf_counter() - self.t0)
        new = self.done - self.start_done
        rate = new / elapsed
        eta = (self.total - self.done) / rate if rate > 0 else float("nan")
        width = 20
        filled = int(width * self.done / self.total) if self.total else width
        bar = "#" * filled + "-" * (width - filled)
        parts = [f"{self.label} [{bar}] {self.done}/{self.total} items", f"{rate:.2f} items/s",
                 f"{self.tokens / elapsed:.1f} tok/s", f"ETA {eta / 60:.1f} min" if eta == eta else "ETA -"]
        if self.failed:
            parts.append(f"{self.failed} failed")
        if self.extra:
            parts.append(self.extra)
        return " | ".join(parts)

    def _draw(self, end: str) -> None:
        prefix = "\r\x1b[2K" if self.tty else ""
        print(f"{prefix}[{time.strftime('%H:%M:%S')}] {self.text()}", end=end, file=self.stream, flush=True)

    def close(self, note: str = "") -> None:
        """End the line (a terminal's in-place line gets its newline); ``note`` says why it ended early."""
        if self.tty and self.done < self.total:
            print("", file=self.stream, flush=True)
        if note:
            print(f"[{time.strftime('%H:%M:%S')}] {self.label}: {note}", file=self.stream, flush=True)


def log(msg: str) -> None:
    """One line of the sweep's log: ``[sweep HH:MM:SS] msg`` on stderr."""
    print(f"[sweep {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def trial_timing(path: Path, number: int, actors: int, run: Any, records: list[Record], total_s: float) -> None:
    """Where a trial's time went: generation in the engines, dispatch (Ray Data shards, actor
    calls, waiting on the slowest shard) and bookkeeping outside ``run_trial`` (Optuna ask/tell,
    aggregation, MLflow logging), tokens/s, and the 1-minute load average when the trial ended.
    Appended to ``timing.jsonl`` (``path``) in the run directory."""
    fresh = [r for r in records if r.wall_time_s > 0]
    gen = sum(r.wall_time_s for r in fresh)
    actors = max(1, actors)
    row = {"trial": number, "actors": actors, "items": len(fresh), "trial_wall_s": run.wall_s,
           "generation_s": gen, "dispatch_overhead_s": max(0.0, run.wall_s - gen / actors),
           "bookkeeping_s": max(0.0, total_s - run.wall_s), "items_per_s": len(fresh) / run.wall_s if run.wall_s else 0.0,
           "tokens": sum(r.tokens for r in fresh),
           "tokens_per_s": sum(r.tokens for r in fresh) / run.wall_s if run.wall_s else 0.0,
           # > 1 on batched engines (vLLM): requests overlap, so generation_s exceeds the wall time
           "request_concurrency": gen / (run.wall_s * actors) if run.wall_s else 0.0,
           "load_1m": os.getloadavg()[0], "cpus": os.cpu_count()}  # the driver's node: the machine's load
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
