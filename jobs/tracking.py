"""MLflow for sweeps: a sqlite tracking store under the run directory (embedded default), one
parent run per sweep (reopened when a sweep resumes), one nested run per trial, named so the
MLflow UI's compare view lines trials up. The only module that imports mlflow.

    python -m jobs.tracking ui --run-dir runs/sweeps/<study>   # MLflow UI on 127.0.0.1
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

EXPERIMENT = "spectune-sweeps"


def tracking_uri(run_dir: Path) -> str:
    return f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"


class SweepTracker:
    def __init__(self, run_dir: Path, uri: str | None = None) -> None:
        os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
        import mlflow

        self.mlflow = mlflow
        self.run_dir = run_dir
        mlflow.set_tracking_uri(uri or tracking_uri(run_dir))
        exp = mlflow.get_experiment_by_name(EXPERIMENT)
        if exp is None:
            artifacts = (run_dir / "mlartifacts").resolve()
            artifacts.mkdir(parents=True, exist_ok=True)
            mlflow.create_experiment(EXPERIMENT, artifact_location=artifacts.as_uri())
        mlflow.set_experiment(EXPERIMENT)
        self.parent_id: str | None = None

    def start_parent(self, name: str, params: dict[str, Any], tags: dict[str, str], resume_id: str | None) -> str:
        mlflow = self.mlflow
        if resume_id:
            run = mlflow.start_run(run_id=resume_id)
        else:
            run = mlflow.start_run(run_name=name)
            mlflow.log_params({k: _param(v) for k, v in params.items()})
        mlflow.set_tags(tags)
        self.parent_id = run.info.run_id
        return self.parent_id

    def log_trial(self, name: str, params: dict[str, Any], metrics: dict[str, float], tags: dict[str, str],
                  artifacts: list[Path]) -> str:
        mlflow = self.mlflow
        with mlflow.start_run(run_name=name, nested=True) as run:
            mlflow.log_params({k: _param(v) for k, v in params.items()})
            mlflow.log_metrics({k: v for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)})
            mlflow.set_tags(tags)
            for path in artifacts:
                if path.is_file():
                    mlflow.log_artifact(str(path))
            return run.info.run_id

    def log_report(self, report_dir: Path, chosen: dict[str, Any]) -> None:
        mlflow = self.mlflow
        mlflow.log_artifacts(str(report_dir), artifact_path="report")
        for budget, choice in chosen.items():
            mlflow.log_dict(choice, f"chosen/budget-{budget}.json")
            mlflow.set_tag(f"chosen.{budget}", json.dumps(
                {k: choice.get(k) for k in ("policy", "params", "draft_len", "trial")}, default=str)[:5000])

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.mlflow.log_metrics({k: v for k, v in metrics.items() if math.isfinite(v)}, step=step)

    def end(self, status: str = "FINISHED") -> None:
        self.mlflow.end_run(status=status)


def _param(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text[:6000]


def load_chosen(run_id: str, budget: float, uri: str) -> dict[str, Any]:
    """The chosen policy a sweep wrote for ``budget`` (for the serving side)."""
    import mlflow

    mlflow.set_tracking_uri(uri)
    return mlflow.artifacts.load_dict(f"runs:/{run_id}/chosen/budget-{budget}.json")


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
    print(f"MLflow UI: http://{args.host}:{args.port}  (Ctrl-C to stop)", file=sys.stderr)
    return subprocess.call(cmd, env=env)


if __name__ == "__main__":
    raise SystemExit(main())
