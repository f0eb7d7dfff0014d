"""A live progress line for long evaluations: items done, items/s, tokens/s, ETA.

On a terminal the line is redrawn in place (``\\r``); in a log (``ray job logs``, CI, a file) a
line is printed at most every ``every_s`` seconds and at the end, so logs stay readable.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO


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
