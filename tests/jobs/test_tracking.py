"""`python -m jobs.tracking ui` opens the runs view and becomes the MLflow server, so a SIGTERM to the pid it
prints stops the server with nothing left behind."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from jobs import tracking
from sweep.tracking import SweepTracker

ROOT = Path(__file__).resolve().parents[2]


def test_ui_link_opens_the_runs_view():
    url = tracking.ui_url("127.0.0.1", 5000, "1")
    assert url == "http://127.0.0.1:5000/#/experiments/1/runs?workflowType=machine_learning"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.slow
def test_ui_hands_its_process_to_the_server_and_sigterm_stops_it(tmp_path):
    run_dir = tmp_path / "sweep"
    tracker = SweepTracker(run_dir)
    exp_id = tracker.mlflow.get_experiment_by_name(tracking.EXPERIMENT).experiment_id
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "jobs.tracking", "ui", "--run-dir", str(run_dir), "--port", str(port)],
                            cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        banner = proc.stderr.readline()
        assert f"/#/experiments/{exp_id}/runs?workflowType=machine_learning" in banner, banner
        assert f"pid {proc.pid}" in banner, banner
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, "the server exited early"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the MLflow server did not answer in 120 s"
            time.sleep(0.5)
        server = psutil.Process(proc.pid)
        assert "mlflow" in server.cmdline() and "server" in server.cmdline(), "the printed pid is the server itself"
        family = server.children(recursive=True)
        assert family, "mlflow server runs uvicorn as its child"

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) is not None
        _, alive = psutil.wait_procs(family, timeout=30)
        assert not alive, f"left running after SIGTERM: {[p.cmdline() for p in alive]}"
        assert not port_open(port), "the port is closed"
    finally:
        if proc.poll() is None:
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
            proc.kill()
        proc.stderr.close()


def test_ui_without_a_store_says_so(tmp_path, capsys):
    assert tracking.main(["ui", "--run-dir", str(tmp_path)]) == 2
    assert re.search(r"no MLflow store at .*mlflow\.db", capsys.readouterr().err)
