"""The MLflow UI over a sweep's tracking store, on 127.0.0.1.

    python -m jobs.tracking ui --run-dir runs/sweeps/<study>

MLflow 3's UI opens experiments in its GenAI view unless told otherwise: ``ui`` prints the link to the runs
view with ``workflowType=machine_learning`` (in MLflow 3.17's UI that global GenAI / machine-learning switch,
default GenAI and kept in the browser, decides the default tab; the experiment's kind tag, set by
``sweep.tracking``, is read where the switch is off).
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import sys
from contextlib import closing
from pathlib import Path

from sweep.tracking import EXPERIMENT, tracking_uri


def experiment_id(run_dir: Path) -> str | None:
    """The sweeps experiment's id in a run directory's store (read-only, closed before exec)."""
    uri = f"file:{(run_dir / 'mlflow.db').resolve()}?mode=ro"
    try:
        with closing(sqlite3.connect(uri, uri=True)) as db:
            row = db.execute("SELECT experiment_id FROM experiments WHERE name = ?", (EXPERIMENT,)).fetchone()
    except sqlite3.Error:
        return None
    return None if row is None else str(row[0])


def ui_url(host: str, port: int, exp_id: str | None) -> str:
    """The experiment's runs view (MLflow's machine-learning workflow, not the GenAI overview)."""
    page = f"experiments/{exp_id}/runs" if exp_id else "experiments"
    return f"http://{host}:{port}/#/{page}?workflowType=machine_learning"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="MLflow UI for a sweep's tracking store (127.0.0.1).")
    ap.add_argument("command", choices=["ui"])
    ap.add_argument("--run-dir", required=True, help="the sweep's run directory (holds mlflow.db)")
    ap.add_argument("--port", type=int, default=5000)
    ap.add_argument("--host", default="127.0.0.1")
    args = ap.parse_args(argv)
    run_dir = Path(args.run_dir)
    if not (run_dir / "mlflow.db").is_file():
        print(f"error: no MLflow store at {run_dir / 'mlflow.db'} (is --run-dir a sweep's run directory?)", file=sys.stderr)
        return 2
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", tracking_uri(run_dir),
           "--host", args.host, "--port", str(args.port), "--workers", "1"]
    print(f"MLflow UI: {ui_url(args.host, args.port, experiment_id(run_dir))}  (pid {os.getpid()}; Ctrl-C or "
          f"SIGTERM stops it)", file=sys.stderr, flush=True)
    sys.stdout.flush()
    # This process becomes the MLflow server (same pid): a signal to it reaches the server, which
    # forwards it to its uvicorn child, so nothing is left running when either is stopped.
    os.execve(sys.executable, cmd, env)
    return 0  # not reached


if __name__ == "__main__":
    raise SystemExit(main())
