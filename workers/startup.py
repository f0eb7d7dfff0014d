"""What a process is doing while it starts, as lines a newcomer can watch: what is loading, converting or
calibrating, for how long so far, and an ETA where the phase's length is known.

A phase (:func:`phase`) says one line when it starts (with its ETA), one every ``every_s`` seconds while it runs
(elapsed, what is left) and one when it ends. Its ETA is, best first: the phase's own progress (a calibration knows
how many rounds it times, :meth:`Phase.progress`), the same phase's duration the last time it ran on this machine
(kept per :func:`host_fingerprint` in a small JSON file beside the pair, :func:`record`), or an estimate the caller
gives (from the bytes it will read, say). Where none is known the line says so.

Lines go to whoever listens (:func:`listen`): nothing is printed by default, so a library call stays silent. A pair
actor forwards them to its driver (``cluster.startup``), a command prints them (:func:`to_stderr`). This module
knows no Ray and no model.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

TIMINGS = "startup-timings.json"  # beside a pair (its cache directory): phase -> seconds, per host fingerprint
EVERY_S = 10.0  # a running phase says how far it is this often

_listeners: list[Callable[[str], None]] = []
_lock = threading.Lock()


def listen(fn: Callable[[str], None]) -> Callable[[], None]:
    """Send every line to ``fn`` from now on; returns the call that stops it."""
    with _lock:
        _listeners.append(fn)

    def stop() -> None:
        with _lock:
            if fn in _listeners:
                _listeners.remove(fn)

    return stop


def listening() -> bool:
    return bool(_listeners)


def say(line: str) -> None:
    """One line to every listener (a listener that fails is skipped: progress never breaks a start)."""
    with _lock:
        fns = list(_listeners)
    for fn in fns:
        try:
            fn(line)
        except Exception:  # noqa: BLE001 - a lost progress line must not fail a model load
            pass


def warn(line: str) -> None:
    """A line that matters beyond progress (a calibration not stored, say): on stderr always, and to listeners."""
    print(line, file=sys.stderr, flush=True)
    say(line)


@contextmanager
def to_stderr(prefix: str = "") -> Iterator[None]:
    """Print the lines on stderr while the block runs (a command's own start)."""
    stop = listen(lambda line: print(f"{prefix}{line}", file=sys.stderr, flush=True))
    try:
        yield
    finally:
        stop()


def cpu_flags() -> list[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return sorted(set(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return []


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def host() -> dict[str, Any]:
    """What a step's time on this machine depends on, short of the model: the CPU (model, flags, count), the torch
    build and the kernels ATen dispatches to (``ATEN_CPU_CAPABILITY`` included), transformers' version (the float
    dtypes run its modelling code). A calibration adds the thread count, dtype and layers (``calibrate``)."""
    import torch

    try:
        import transformers

        tf = transformers.__version__
    except ImportError:  # pragma: no cover - a vLLM-only environment
        tf = ""
    return {"cpu": cpu_model(), "cpus": os.cpu_count() or 0,
            "flags": hashlib.sha256(" ".join(cpu_flags()).encode()).hexdigest()[:12],
            "torch": torch.__version__, "aten": torch.backends.cpu.get_cpu_capability(), "transformers": tf}


def fingerprint(fields: dict[str, Any]) -> str:
    """A short, stable digest of ``fields`` (a JSON object)."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:12]


def host_fingerprint() -> str:
    return fingerprint(host())


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def last_time(where: str | os.PathLike[str] | None, key: str) -> float | None:
    """How long phase ``key`` took the last time it ran on this host with its timings kept in ``where`` (a directory);
    None where it never did."""
    if where is None:
        return None
    got = _read(Path(where) / TIMINGS).get(host_fingerprint(), {}).get(key)
    return float(got) if isinstance(got, int | float) and got >= 0 else None


def record(where: str | os.PathLike[str] | None, key: str, seconds: float) -> None:
    """Keep ``seconds`` as phase ``key``'s last duration on this host (best effort: a read-only volume keeps none)."""
    if where is None:
        return
    path = Path(where) / TIMINGS
    try:
        data = _read(path)
        data.setdefault(host_fingerprint(), {})[key] = round(float(seconds), 2)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        tmp.replace(path)
    except OSError:
        pass


def _secs(s: float) -> str:
    return f"{s:.0f} s" if s < 90 else f"{int(s // 60)} min {int(s % 60):02d} s"


class Phase:
    """A running phase: what it is, when it began, its ETA and how it knows it."""

    def __init__(self, what: str, eta_s: float | None, source: str) -> None:
        self.what, self.eta_s, self.source = what, eta_s, source
        self.t0 = time.perf_counter()
        self.done: tuple[float, float] | None = None  # (done, total) from the phase itself
        self.origin: tuple[float, float] | None = None  # (when, done) its count last stood still: the rate's start
        self.detail = ""

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def progress(self, done: float, total: float, detail: str = "") -> None:
        """The phase's own count (rounds timed, layers converted): once it moves, the ETA is its rate since it
        started moving (the count's first value is its origin, moved on while the count stands still)."""
        now = time.perf_counter()
        if self.origin is None or (self.done is not None and float(done) == self.origin[1] == self.done[0]):
            self.origin = (now, float(done))
        self.done, self.detail = (float(done), float(total)), detail

    def left(self) -> tuple[float | None, str]:
        """Seconds left and how that is known."""
        elapsed = self.elapsed()
        if self.done is not None and self.origin is not None and self.done[0] > self.origin[1]:
            rate = (self.done[0] - self.origin[1]) / max(1e-9, time.perf_counter() - self.origin[0])
            return max(0.0, (self.done[1] - self.done[0]) / rate), "at its rate so far"
        if self.eta_s is not None:
            return max(0.0, self.eta_s - elapsed), self.source
        return None, ""

    def line(self) -> str:
        parts = [f"{self.what}: {_secs(self.elapsed())}"]
        if self.done is not None:
            parts.append(f"{self.done[0]:.0f}/{self.done[1]:.0f}{' ' + self.detail if self.detail else ''}")
        left, how = self.left()
        if left is not None:
            over = how != "at its rate so far" and self.eta_s is not None and self.elapsed() > self.eta_s
            parts.append(f"past its ETA ({how})" if over else f"ETA {_secs(left)} ({how})")
        return ", ".join(parts)


@contextmanager
def phase(what: str, *, key: str | None = None, where: str | os.PathLike[str] | None = None,
          estimate_s: float | None = None, estimate: str = "an estimate", every_s: float = EVERY_S) -> Iterator[Phase]:
    """Say ``what`` is starting, how far it is every ``every_s`` seconds, and when it ended; ``key``/``where``: keep
    its duration (:func:`record`) and take the last one as its ETA; ``estimate_s``: the ETA where none was kept
    (``estimate`` says what it rests on)."""
    last = last_time(where, key) if key else None
    eta, source = (last, "the last time on this machine") if last is not None else (estimate_s, estimate)
    running = Phase(what, eta, source)
    stop = threading.Event()
    ticker = None
    if listening():
        say(f"{what}: started, " + (f"ETA {_secs(eta)} ({source})" if eta is not None else "no ETA yet (its first "
                                                                                            "time on this machine)"))
        if every_s > 0:
            def tick() -> None:
                while not stop.wait(every_s):
                    say(running.line())

            ticker = threading.Thread(target=tick, name="startup-progress", daemon=True)
            ticker.start()
    try:
        yield running
    except BaseException:
        stop.set()
        say(f"{what}: failed after {_secs(running.elapsed())}")
        raise
    finally:
        stop.set()
        if ticker is not None:
            ticker.join(timeout=1.0)
    took = running.elapsed()
    say(f"{what}: done in {_secs(took)}")
    if key:
        record(where, key, took)
