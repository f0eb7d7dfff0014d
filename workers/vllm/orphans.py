"""vLLM's processes leave with the process that started them (no vLLM import).

A process holding a spectune vLLM engine that is stopped (SIGTERM from ``timeout`` or a job scheduler)
or killed (SIGKILL, the OOM killer) exits without shutting its engine down: vLLM 0.32/0.33's engine-core
process does not watch its parent, so it — and the worker processes under it — ran on, reparented to
init, with their memory (measured on a GPU: a 20 GB worker spinning at 186% CPU).

Each process vLLM starts for a spectune engine watches the process that started it (the engine core
its owner, a TP worker its engine core) and leaves when that one is gone, whatever signal ended it:

- :func:`arm` (the owner, before it starts vLLM) names the owner in the environment (:data:`OWNER_ENV`),
  which vLLM's processes inherit, and registers :func:`watch_parent` to run in every child this
  process forks (``os.register_at_fork``; vLLM forks its engine core and workers unless it must spawn).
- :func:`watch_parent` also runs in the plugin's ``register`` (spawned children load the plugin; a
  forked child does not: vLLM's "plugins loaded" flag is copied into it). In the owner itself, and in
  processes of engines spectune did not start (no :data:`OWNER_ENV`), it does nothing.
- The watcher is a daemon thread that checks ``os.getppid()`` once per ``period`` s. When the parent is
  gone (the process was reparented) it sends itself SIGTERM — vLLM's own handlers shut the engine core
  and its workers down — and after ``grace`` s, if still running (a step stuck in the device), SIGKILLs
  its own children and exits.

Unlike ``PR_SET_PDEATHSIG``, which fires when the *thread* that forked the child exits (an asyncio
``to_thread`` worker starting a reference engine, say), this follows the parent process only.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

OWNER_ENV = "SPECTUNE_VLLM_OWNER_PID"  # the process that started the engine; set by arm()
PERIOD_S = 1.0
GRACE_S = 10.0

_watching: int | None = None  # the pid whose watcher runs (a forked child inherits the parent's value)
_at_fork = False
_lock = threading.Lock()


def arm() -> None:
    """In the process about to start vLLM engines: name it as their owner and watch its forked children."""
    global _at_fork
    os.environ[OWNER_ENV] = str(os.getpid())
    with _lock:
        if not _at_fork and hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=watch_parent)
            _at_fork = True


def watch_parent(period: float | None = None, grace: float | None = None) -> bool:
    """Start this process's parent watch if it descends from a spectune engine's owner; idempotent per
    process. Returns whether a watch runs. Never raises (it runs in fork hooks and vLLM's plugin load)."""
    global _watching, _at_fork
    try:
        owner = int(os.environ.get(OWNER_ENV, "0") or 0)
        pid = os.getpid()
        if not owner or owner == pid:
            return False
        if _watching == pid:
            return True
        parent = os.getppid()
        _watching = pid
        period = PERIOD_S if period is None else period
        grace = GRACE_S if grace is None else grace
        if not _at_fork and hasattr(os, "register_at_fork"):  # its own forked children (TP workers) too
            os.register_at_fork(after_in_child=watch_parent)
            _at_fork = True
        threading.Thread(target=_watch, args=(parent, period, grace), daemon=True,
                         name="spectune-parent-watch").start()
        return True
    except Exception:  # noqa: BLE001 - a watch that cannot start must not break vLLM's start
        return False


def _watch(parent: int, period: float, grace: float) -> None:
    while os.getppid() == parent:
        time.sleep(period)
    _leave(parent, grace)


def _leave(parent: int, grace: float) -> None:
    logging.getLogger("vllm.spectune").warning(
        "spectune: process %d's parent %d is gone (stopped or killed without shutting its vLLM engine down): "
        "this process leaves too", os.getpid(), parent)
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # vLLM's handlers: the engine core shuts its workers down
    except OSError:
        pass
    time.sleep(grace)
    for child in children(os.getpid()):
        try:
            os.kill(child, signal.SIGKILL)
        except OSError:
            pass
    os._exit(1)


def children(pid: int) -> list[int]:
    """The direct children of ``pid`` (a /proc scan; [] where there is no /proc)."""
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 1 and fields[1] == str(pid):
            found.append(int(name))
    return found
