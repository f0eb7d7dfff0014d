"""The pair actors' start, shown on the driver as it happens: what each actor is loading, converting or calibrating,
with an ETA (the lines :mod:`workers.startup` makes).

The driver's Ray runs quiet (``cluster.runtime``: no actor output reaches it), so the lines travel through a small
channel of their own: a board actor (no CPU reserved) named in the job's namespace. :func:`attach`, run first in a
pair actor's ``__init__``, finds the board and sends it every line; :class:`Watch`, on the driver around the actors'
start and calibration, prints what the board holds as it arrives, and says so when nothing has come for a while
(Ray starting the actors' processes, say). Without a board (an actor made outside a watch) nothing is sent.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

import ray

NAME = "spectune-startup"  # the board's name in the job's namespace (each driver's own)
QUIET_S = 10.0  # the driver says it is still waiting when no line came for this long


@ray.remote(num_cpus=0)
class Board:
    """The lines the actors sent, in the order each sent them: (seconds since the epoch, source, line). One call at a
    time (no ``max_concurrency``): Ray runs one caller's calls in the order it made them only on such an actor."""

    def __init__(self) -> None:
        self.lines: list[tuple[float, str, str]] = []

    def say(self, source: str, line: str) -> None:
        self.lines.append((time.time(), source, line))

    def since(self, n: int) -> list[tuple[float, str, str]]:
        return self.lines[n:]

    def count(self) -> int:
        return len(self.lines)


_attached: list[Callable[[], None]] = []


def attach() -> bool:
    """Send this process's start-up lines to the driver's board, if it has one (once per process)."""
    from workers import startup

    if _attached:
        return True
    try:
        board = ray.get_actor(NAME)
    except ValueError:  # no watch on the driver: the lines stay unsaid
        return False
    source = f"pid {os.getpid()}"
    _attached.append(startup.listen(lambda line: board.say.remote(source, line)))
    startup.say("actor process up: loading the engine's code")
    return True


def board() -> Any:
    """The driver's board (made on first use; it lives as long as the job)."""
    return Board.options(name=NAME, get_if_exists=True, lifetime=None).remote()


class Watch:
    """On the driver: print the actors' start-up lines while the block runs (``printer``: one line each), a line of
    its own when none came for ``quiet_s`` seconds, and what is left on the board when the block ends."""

    def __init__(self, printer: Callable[[str], None], what: str = "the pair actors", every_s: float = 1.0,
                 quiet_s: float = QUIET_S) -> None:
        self.printer, self.what, self.every_s, self.quiet_s = printer, what, every_s, quiet_s
        self.stop = threading.Event()
        self.names: dict[str, str] = {}
        self.offset = 0
        self.thread: threading.Thread | None = None

    def __enter__(self) -> Watch:
        try:
            self.board = board()
            self.offset = ray.get(self.board.count.remote(), timeout=60)
        except Exception as err:  # noqa: BLE001 - the start must go on without its progress lines
            self.printer(f"(no start-up progress from {self.what}: {type(err).__name__}: {err})")
            self.board = None
            return self
        self.t0 = self.heard = time.monotonic()
        self.thread = threading.Thread(target=self._run, name="startup-watch", daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(timeout=10)
            self._drain()

    def _source(self, source: str) -> str:
        if source not in self.names:
            self.names[source] = f"actor {len(self.names) + 1} ({source})"
        return self.names[source]

    def _drain(self) -> int:
        try:
            lines = ray.get(self.board.since.remote(self.offset), timeout=30)
        except Exception:  # noqa: BLE001 - a slow board this round: the next one catches up
            return 0
        self.offset += len(lines)
        for _, source, line in lines:
            self.printer(f"{self._source(source)}: {line}")
        return len(lines)

    def _run(self) -> None:
        while not self.stop.wait(self.every_s):
            now = time.monotonic()
            if self._drain():
                self.heard = now
            elif now - self.heard >= self.quiet_s:
                self.heard = now
                self.printer(f"waiting for {self.what}: {now - self.t0:.0f} s so far, nothing new in the last "
                             f"{self.quiet_s:.0f} s" + ("" if self.names else " (Ray is starting their processes)"))
