"""Test-only fault injection for the vLLM plugin: the failures a batched engine meets, on demand.

``SPECTUNE_VLLM_TEST_FAULTS`` names a JSON file the plugin re-reads when it changes (unset, always
outside tests: one env read per step). The tests use it to reproduce vLLM's own "missing cached draft
probabilities" path, a rule that raises, missing hidden states, and a worker that stalls — the step
that runs past vLLM's step timeout, or the moment a test kills a worker or the engine core.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

FAULTS_ENV = "SPECTUNE_VLLM_TEST_FAULTS"


class _Faults:
    """Test-only fault injection (``SPECTUNE_VLLM_TEST_FAULTS`` names a JSON file, re-read when it
    changes): ``{"drop_draft_probs_every": n}`` makes vLLM itself lose a request's cached draft
    probabilities on every n-th step with drafts (vLLM then logs "Missing cached draft probabilities
    ... falling back to legacy speculative rejection behavior" and passes ``draft_probs=None``, as it
    does in batched runs); ``drop_hidden_every`` withholds DropMatch's hidden states;
    ``raise_every`` makes the rule raise; ``{"stall_s": s, "stall_times": k}`` makes the worker sleep s
    seconds in a speculative step, k times in all across the engine's processes and their
    replacements (each stall appends ``pid ppid`` to ``<file>.stalled`` first, so a test knows when
    and whom to kill; delete that file with the spec). Unset (always, outside tests): no cost beyond
    one env read."""

    def __init__(self) -> None:
        self.stamp: tuple[int, int] | None = None
        self.spec: dict[str, int] = {}
        self.steps = 0

    def current(self) -> dict[str, int]:
        path = os.environ.get(FAULTS_ENV)
        if not path:
            return {}
        try:
            st = os.stat(path)
        except OSError:
            self.stamp, self.spec = None, {}
            return {}
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp != self.stamp:
            try:
                self.spec = {k: int(v) for k, v in json.loads(Path(path).read_text()).items()}
            except (OSError, ValueError, AttributeError):
                self.spec = {}
            self.stamp, self.steps = stamp, 0
        return self.spec

    def hit(self, name: str) -> bool:
        every = self.current().get(name, 0)
        return every > 0 and self.steps % every == every - 1

    def stall(self) -> None:
        """Sleep ``stall_s`` if the spec asks for more stalls than ``<file>.stalled`` records."""
        spec = self.current()
        seconds = spec.get("stall_s", 0)
        if seconds <= 0:
            return
        log = Path(f"{os.environ[FAULTS_ENV]}.stalled")
        try:
            done = len(log.read_text().splitlines()) if log.exists() else 0
            if done >= spec.get("stall_times", 1):
                return
            with log.open("a") as f:
                f.write(f"{os.getpid()} {os.getppid()}\n")
        except OSError:
            return
        time.sleep(seconds)


FAULTS = _Faults()


class _FaultyRule:
    """A rule that raises (fault injection for the guard)."""

    name = "faulty"

    def __init__(self, policy: Any) -> None:
        self.config = policy.config

    def decide(self, batch: Any) -> Any:
        raise RuntimeError("injected fault (SPECTUNE_VLLM_TEST_FAULTS raise_every)")
