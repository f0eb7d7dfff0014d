"""MLflow as users expect: the sweeps experiment opens in the runs (model training) view, new or resumed."""

from __future__ import annotations

from sweep import tracking


def kind(run_dir) -> str | None:
    import mlflow

    mlflow.set_tracking_uri(tracking.tracking_uri(run_dir))
    return mlflow.get_experiment_by_name(tracking.EXPERIMENT).tags.get(tracking.KIND_TAG)


def test_the_experiment_is_a_model_development_one_new_or_resumed(tmp_path):
    import mlflow

    fresh = tmp_path / "fresh"
    tracking.SweepTracker(fresh)
    assert kind(fresh) == "custom_model_development"

    old = tmp_path / "old"  # a store written before the tag existed: tagged when a sweep reopens it
    old.mkdir()
    mlflow.set_tracking_uri(tracking.tracking_uri(old))
    mlflow.create_experiment(tracking.EXPERIMENT, artifact_location=(old / "mlartifacts").as_uri())
    assert kind(old) is None
    tracking.SweepTracker(old)
    assert kind(old) == "custom_model_development"
