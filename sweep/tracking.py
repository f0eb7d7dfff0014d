"""MLflow for sweeps: a sqlite tracking store under the run directory (embedded default), one
parent run per sweep (reopened when a sweep resumes), one nested run per trial, named so the
MLflow UI's compare view lines trials up. The only module that imports mlflow (``jobs.tracking ui``
opens the UI over the same store).

MLflow 3's UI opens experiments in its GenAI view (traces, an empty overview) unless told
otherwise. The experiment carries ``mlflow.experimentKind = custom_model_development`` (set at
creation and whenever a sweep reopens an older store), which the UI reads where its global GenAI /
machine-learning switch is off.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

EXPERIMENT = "spectune-sweeps"
# The experiment kind MLflow's UI reads from this tag; the value for classic training-style runs.
KIND_TAG, KIND = "mlflow.experimentKind", "custom_model_development"


def tracking_uri(run_dir: Path) -> str:
    return f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"


def _seed_store(db: Path) -> None:
    """A new run directory's sqlite store starts as a copy of an empty store whose schema MLflow already built.

    MLflow builds a new sqlite store by running every one of its alembic migrations (seconds of CPU at each new
    sweep); the empty migrated store holds no path or run (its schema version and the default workspace row), so
    it is built once per MLflow version and user, in the temporary directory, and copied. Any failure here leaves
    the store to MLflow, which builds it as before."""
    import shutil
    import tempfile

    if db.exists():
        return
    try:
        import mlflow
        import sqlalchemy
        from mlflow.store.db.utils import _initialize_tables

        template = Path(tempfile.gettempdir()) / f"spectune-mlflow-{mlflow.__version__}-{os.getuid()}.db"
        if template.is_file() and template.stat().st_uid != os.getuid():
            raise PermissionError(f"{template} is not this user's")
        if not template.is_file():
            building = template.with_name(f"{template.name}.{os.getpid()}.tmp")
            building.unlink(missing_ok=True)
            engine = sqlalchemy.create_engine(f"sqlite:///{building}")
            try:
                _initialize_tables(engine)
            finally:
                engine.dispose()
            os.replace(building, template)  # whole, or not there: a concurrent sweep copies a finished one
        db.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(template, db)
    except Exception:  # noqa: BLE001 - a faster start only: MLflow creates the store itself
        db.unlink(missing_ok=True)


class SweepTracker:
    def __init__(self, run_dir: Path, uri: str | None = None) -> None:
        os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
        import mlflow

        self.mlflow = mlflow
        self.run_dir = run_dir
        if uri is None:
            _seed_store(run_dir / "mlflow.db")
        mlflow.set_tracking_uri(uri or tracking_uri(run_dir))
        exp = mlflow.get_experiment_by_name(EXPERIMENT)
        if exp is None:
            if uri is None or not uri.startswith(("http://", "https://")):
                # beside the run (a database URL has no artifact store of its own); an MLflow server keeps its own
                artifacts = (run_dir / "mlartifacts").resolve()
                artifacts.mkdir(parents=True, exist_ok=True)
                mlflow.create_experiment(EXPERIMENT, artifact_location=artifacts.as_uri(), tags={KIND_TAG: KIND})
            else:
                mlflow.create_experiment(EXPERIMENT, tags={KIND_TAG: KIND})
        elif exp.tags.get(KIND_TAG) != KIND:  # a store from before the tag: the runs view from now on
            mlflow.MlflowClient().set_experiment_tag(exp.experiment_id, KIND_TAG, KIND)
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

    def log_artifact(self, path: Path) -> None:
        """A file on the active (parent) run, e.g. the sweep's effective config."""
        self.mlflow.log_artifact(str(path))

    def log_trial(self, name: str, params: dict[str, Any], metrics: dict[str, float], tags: dict[str, str],
                  artifacts: dict[Path, str]) -> str:
        """A nested run per trial; ``artifacts``: file -> folder in the run's artifacts ("" the top)."""
        mlflow = self.mlflow
        with mlflow.start_run(run_name=name, nested=True) as run:
            mlflow.log_params({k: _param(v) for k, v in params.items()})
            mlflow.log_metrics({k: v for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)})
            mlflow.set_tags(tags)
            self.log_files(run.info.run_id, artifacts)
            return run.info.run_id

    def log_files(self, run_id: str, files: dict[Path, str]) -> None:
        """Files (those that exist) onto an existing run: file -> folder in its artifacts ("" the top)."""
        client = self.mlflow.MlflowClient()
        for path, folder in files.items():
            if path.is_file():
                client.log_artifact(run_id, str(path), artifact_path=folder or None)

    def log_report(self, report_dir: Path, chosen: dict[str, Any]) -> None:
        mlflow = self.mlflow
        mlflow.log_artifacts(str(report_dir), artifact_path="report")
        for budget, choice in chosen.items():
            mlflow.log_dict(choice, f"chosen/budget-{budget}.json")
            cert = choice.get("certification") or {}
            mlflow.set_tag(f"chosen.{budget}", json.dumps(
                {**{k: choice.get(k) for k in ("policy", "params", "draft_len", "trial", "certified")},
                 **{k: cert.get(k) for k in ("p_value", "bound", "alpha", "n", "discordance", "items_needed",
                                             "confirm_split", "pool", "evidence")}},
                default=str)[:5000])
            mlflow.set_tag(f"certified.{budget}", str(bool(choice.get("certified"))).lower())
            figures = {"p_value": cert.get("p_value"), "bound": cert.get("bound"), "n": cert.get("n"),
                       "discordance": cert.get("discordance"), "items_needed": cert.get("items_needed"),
                       "pool": cert.get("pool")}
            mlflow.log_metrics({f"confirm.budget_{budget}.{k}": float(v) for k, v in figures.items()
                                if isinstance(v, (int, float)) and math.isfinite(v)})

    def log_to_run(self, run_id: str, metrics: dict[str, float], tags: dict[str, str] | None = None) -> None:
        """Add metrics (and tags) to an existing run, e.g. a trial's confirmation figures."""
        client = self.mlflow.MlflowClient()
        for k, v in metrics.items():
            if isinstance(v, (int, float)) and math.isfinite(v):
                client.log_metric(run_id, k, float(v))
        for k, v in (tags or {}).items():
            client.set_tag(run_id, k, v)

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
