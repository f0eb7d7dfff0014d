"""docs/endpoints.md's stock-``vllm serve`` block, run as the page writes it: its ``bash`` block under "spectune's rules
inside a stock `vllm serve`" is read from the page, each line run in order from the checkout (a line ending in
``&`` is a server, waited for until its ``ready:`` line), and each ``# ends with `...` `` comment checked against
the output of the command before it (``...`` stands for anything, ``N`` for a number; ``exit 3`` for the exit
code, 0 otherwise). What changes: free ports for 8000-8002, and ``rule.json``, the asset cache and the runs root in
a scratch folder. The servers: the plugin with a rule per request, the same without the plugin, the plugin with a
rule file, started together as a shell would (a command waits for the servers above it to be ready); the
commands: the knob check "applied", "ignored" twice, and ``jobs/sweep.py --server-config`` certifying a fixed
configuration (not at n = 16). Runs in .vllm-venv (marker vllm), ~3 minutes.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.workers.vllm.test_vllm_serve_cli import Launched, free_port, launcher_env

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[3]
HEADING = "### spectune's rules inside a stock `vllm serve`"
ENDS = re.compile(r"^# ends with `(.+?)`(.*)$")


def page_steps() -> list[tuple[str, str | None, int]]:
    """(command, the pattern its output must hold or None, its exit code) for every line of the block."""
    text = (ROOT / "docs" / "endpoints.md").read_text()
    start = text.index("```bash\n", text.index(HEADING)) + len("```bash\n")
    block = text[start:text.index("```", start)].replace("\\\n", " ")
    steps: list[tuple[str, str | None, int]] = []
    for line in block.splitlines():
        line = line.strip()
        ends = ENDS.match(line)
        if ends:
            cmd, _, _ = steps[-1]
            pattern = re.escape(ends.group(1)).replace(r"\.\.\.", ".*")
            pattern = re.sub(r"\bN\b", r"\\d+", pattern)
            steps[-1] = (cmd, pattern, 3 if "exit 3" in ends.group(2) else 0)
        elif line and not line.startswith("#"):
            steps.append((re.sub(r" +", " ", line), None, 0))
    return steps


def test_the_page_names_what_it_runs():
    steps = page_steps()
    servers = [c for c, _, _ in steps if c.endswith("&")]
    assert len(servers) == 3 and all("-m jobs.vllm_serve" in c for c in servers)
    assert sum(p is not None for _, p, _ in steps) == 4
    assert any("--server-config" in c for c, _, _ in steps)


def writes_a_file(cmd: str) -> bool:
    return re.search(r"\s>\s*\S", cmd) is not None


def test_the_endpoints_page_runs_as_written(tmp_path):
    """Like a shell, a server line does not block: every server starts as soon as the file-writing lines above it
    have run (their starts overlap: each is mostly a single-threaded import), and each other command first waits
    for the ``ready:`` line of every server above it."""
    ports = {p: str(free_port()) for p in ("8000", "8001", "8002")}
    env = launcher_env(SPECTUNE_CACHE=str(tmp_path / "cache"), SPECTUNE_RUNS=str(tmp_path / "runs"))
    steps = page_steps()
    servers: dict[int, Launched] = {}

    def here(cmd: str) -> str:
        for port, free in ports.items():
            cmd = re.sub(rf"\b{port}\b", free, cmd)
        return re.sub(r"(?<![\w/])rule\.json\b", str(tmp_path / "rule.json"), cmd)

    def launch_from(first: int) -> None:
        """Start the servers from step ``first`` on, up to the next line that writes a file."""
        for n in range(first, len(steps)):
            cmd = steps[n][0]
            if writes_a_file(cmd):
                return
            if cmd.endswith("&") and n not in servers:
                servers[n] = Launched(["bash", "-c", "exec " + here(cmd[:-1].strip())], tmp_path / f"server-{n}.log",
                                      env)

    try:
        launch_from(0)
        for n, (cmd, pattern, code) in enumerate(steps):
            if cmd.endswith("&"):
                continue
            for server in (s for m, s in servers.items() if m < n):
                assert server.wait_ready(timeout=600).startswith("ready: "), server.tail()
            got = subprocess.run(["bash", "-c", here(cmd)], cwd=ROOT, env=env, capture_output=True, text=True,
                                 timeout=900)
            out = got.stdout + got.stderr
            assert got.returncode == code, (cmd, got.returncode, got.stdout[-3000:], got.stderr[-3000:])
            if pattern is not None:
                assert re.search(pattern, out), (cmd, pattern, got.stdout[-3000:], got.stderr[-3000:])
            if writes_a_file(cmd):
                launch_from(n + 1)
        assert len(servers) == 3
    finally:
        for server in servers.values():
            server.stop()
