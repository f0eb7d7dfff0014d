"""The README's `ray job submit`, run as a user runs it rather than as the suite does: a copy of
the checkout as a fresh clone has it (no runs/), a shell without the venv on PATH,
`scripts/ray-head start`, the README's own submit command on the tiny pair. The job must run the
project's environment, write its run directory where the README says (the checkout's
runs/sweeps/<study>), end its log with that directory and the MLflow UI command, and a second
identical submit must resume the study instead of starting another."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TINY = "--pair tiny-random --dtype fp32 --items 3 --trials 2 --max-new-tokens 4 --actors 1"


def readme_submit(dashboard_port: int) -> str:
    """The README's submit command (with its line continuation), on our port, for the tiny pair."""
    text = (ROOT / "README.md").read_text()
    found = re.search(r"^RAY_AUTH_MODE=token \.venv/bin/ray job submit .*?python jobs/sweep\.py", text, re.M | re.S)
    assert found, "the README shows the `ray job submit ... python jobs/sweep.py` command"
    command = found.group(0)
    assert "http://127.0.0.1:8265" in command and "--working-dir ." in command, command
    return command.replace("http://127.0.0.1:8265", f"http://127.0.0.1:{dashboard_port}") + " " + TINY


def fresh_clone(dest: Path) -> Path:
    """The working tree's files that a clone would have (tracked + not ignored), and its .venv."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        src = ROOT / name
        if src.is_file():  # a tracked file deleted in the working tree is not there
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    (dest / ".venv").symlink_to(ROOT / ".venv")
    assert not (dest / "runs").exists()
    return dest


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def user_env(**extra: str) -> dict[str, str]:
    """A fresh login shell's environment: no venv on PATH, no VIRTUAL_ENV, no SPECTUNE_RUNS."""
    env = {"PATH": "/usr/bin:/bin", "HOME": os.environ["HOME"], "LANG": "C.UTF-8"}
    for name in ("SPECTUNE_CACHE", "TMPDIR"):  # where this machine keeps the fetched data, as the user's shell would
        if name in os.environ:
            env[name] = os.environ[name]
    return {**env, **extra}


def submit(clone: Path, command: str, env: dict[str, str]) -> str:
    done = subprocess.run(["bash", "-c", command], cwd=clone, env=env, capture_output=True, text=True, timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "succeeded" in out.lower(), out[-4000:]
    return out


def finished_trials(run_dir: Path) -> list:
    import optuna

    meta = json.loads((run_dir / "sweep.json").read_text())
    study = optuna.load_study(study_name=meta["study"], storage=f"sqlite:///{run_dir / 'optuna.db'}")
    return study.get_trials(deepcopy=False)


def test_readme_ray_job_submit_from_a_fresh_shell_writes_to_the_checkout_and_resumes(tmp_path):
    from workers.benchmarks import get_benchmark

    get_benchmark("gsm8k").items(limit=1)  # the data a user's `make test`/`make main` fetched already
    clone = fresh_clone(tmp_path / "spectune")
    gcs, dashboard, client, agent = free_ports(4)
    env = user_env(RAY_PORT=str(gcs), RAY_DASHBOARD_PORT=str(dashboard))
    command = readme_submit(dashboard)
    try:
        subprocess.run(["scripts/ray-head", "start", "--ray-client-server-port", str(client),
                        "--dashboard-agent-listen-port", str(agent)], cwd=clone, env=env, check=True,
                       capture_output=True, timeout=300)
        out = submit(clone, command, env)
        assert "will hang unless" not in out, "no Ray Data warning that reads as a hang"

        run_dirs = [p.parent for p in (clone / "runs" / "sweeps").glob("*/sweep.json")]
        assert len(run_dirs) == 1, f"one run directory under the clone's runs/sweeps: {run_dirs}\n{out[-3000:]}"
        run_dir = run_dirs[0].resolve()
        for name in ("optuna.db", "mlflow.db", "mlartifacts", "trials", "report/report.md"):
            assert (run_dir / name).exists(), name
        assert list((clone / "runs" / "references").iterdir()), "the reference cache is in the checkout too"
        sweep_lines = [line for line in out.splitlines() if line.startswith("[sweep ")]
        assert f"run directory: {run_dir}" in sweep_lines[-2], sweep_lines[-3:]
        assert sweep_lines[-1].endswith(f".venv/bin/python -m jobs.tracking ui --run-dir {run_dir}"), sweep_lines[-3:]
        trials = finished_trials(run_dir)
        assert len([t for t in trials if t.state.name in ("COMPLETE", "PRUNED")]) == 2
        parent = json.loads((run_dir / "sweep.json").read_text())["parent_run_id"]

        again = submit(clone, command, env)  # the same command: the same study, nothing redone
        assert "already has" in again, again[-3000:]
        assert len(finished_trials(run_dir)) == len(trials), "no new trials"
        assert json.loads((run_dir / "sweep.json").read_text())["parent_run_id"] == parent
        assert [p.parent for p in (clone / "runs" / "sweeps").glob("*/sweep.json")] == run_dirs
    finally:
        subprocess.run(["scripts/ray-head", "stop"], cwd=clone, env=env, capture_output=True, timeout=120)
    left = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("SPECTUNE_RAY_HEAD", "").startswith(f"{clone.resolve()}:"):
                left.append(proc.pid)
        except (psutil.Error, OSError):
            pass
    assert not left, f"`scripts/ray-head stop` left this head's processes running: {left}"
