"""A live progress line for long evaluations: items done, items/s, tokens/s, ETA; a sweep's per-trial line
and ``timing.jsonl`` row.

On a terminal the line is redrawn in place (``\\r``); in a log (``ray job logs``, CI, a file) a
line is printed at most every ``every_s`` seconds and at the end, so logs stay readable.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from workers.evaluation import DecodeSpec, Record
    from workers.metrics import TrialMetrics


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


def trial_timing(sweep: Any, number: int, run: Any, records: list[Record], total_s: float) -> None:
    """Where a trial's time went: generation in the engines, dispatch (Ray Data shards, actor
    calls, waiting on the slowest shard) and bookkeeping outside ``run_trial`` (Optuna ask/tell,
    aggregation, MLflow logging), tokens/s, and the 1-minute load average when the trial ended.
    Appended to ``timing.jsonl`` in the run directory."""
    fresh = [r for r in records if r.wall_time_s > 0]
    gen = sum(r.wall_time_s for r in fresh)
    actors = max(1, len(sweep.workers))
    row = {"trial": number, "actors": actors, "items": len(fresh), "trial_wall_s": run.wall_s,
           "generation_s": gen, "dispatch_overhead_s": max(0.0, run.wall_s - gen / actors),
           "bookkeeping_s": max(0.0, total_s - run.wall_s), "items_per_s": len(fresh) / run.wall_s if run.wall_s else 0.0,
           "tokens": sum(r.tokens for r in fresh),
           "tokens_per_s": sum(r.tokens for r in fresh) / run.wall_s if run.wall_s else 0.0,
           # > 1 on batched engines (vLLM): requests overlap, so generation_s exceeds the wall time
           "request_concurrency": gen / (run.wall_s * actors) if run.wall_s else 0.0,
           "load_1m": os.getloadavg()[0], "cpus": os.cpu_count()}  # the driver's node: the machine's load
    with open(sweep.dir / "timing.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


def trial_line(sweep: Any, number: int, spec: DecodeSpec, m: TrialMetrics, state: str, wall: float) -> None:
    done, total = sweep.finished(), sweep.args.trials
    sweep.elapsed.append(wall)
    eta = sum(sweep.elapsed) / len(sweep.elapsed) * max(0, total - done)
    in_situ = (f", modelled with the c seen in this trial {m.cost_ratio_in_situ:.2f}: "
               f"{m.speedup_vs_ar_modelled_in_situ:.2f}x" if m.cost_ratio_in_situ > 0 else "")  # vLLM: not timed
    from jobs.sweep_args import log

    t = sweep.study.trials[number].user_attrs
    log(f"trial {number} [{done}/{total}] {state} {spec.label()}: acc {m.accuracy:.3f} drop {m.accuracy_drop:+.3f} "
        f"speedup over the best lossless (L {t.get('best_lossless_draft_len')}) "
        f"{t.get('speedup_vs_best_lossless_modelled', math.nan):.2f}x modelled, over target-only "
        f"{m.speedup_vs_ar_modelled:.2f}x (measured {m.speedup_vs_ar_measured:.2f}x{in_situ}) MAL "
        f"{m.mean_acceptance_length:.2f} | replayed {t.get('replayed_exact', 0)} items with nothing decoded, "
        f"{t.get('replayed_decoded', 0)} decoded from a divergence, {t.get('decoded_in_full', 0)} in full | "
        f"{m.items / wall if wall else 0:.2f} items/s | {sweep.best_text()} | "
        f"ETA {eta / 60:.1f} min + confirmation")


def search_cost(sweep: Any) -> None:
    """What the search cost, against what decoding every item of every trial in full would have: items
    replayed with nothing decoded (one teacher-forced pass each), replayed and decoded from a divergence,
    and decoded in full."""
    from jobs.sweep_args import log

    totals = {"replayed_exact": 0, "replayed_decoded": 0, "decoded_in_full": 0}
    for t in sweep.study.get_trials(deepcopy=False):
        for k in totals:
            totals[k] += int(t.user_attrs.get(k, 0))
    n = sum(totals.values())
    if n:
        log(f"search cost: {n:,} item evaluations: {totals['replayed_exact']:,} replayed with nothing decoded "
            f"(a teacher-forced pass each), {totals['replayed_decoded']:,} decoded from the round that left the "
            f"target-only output, {totals['decoded_in_full']:,} decoded in full; full decoding would have decoded "
            f"all {n:,}")
