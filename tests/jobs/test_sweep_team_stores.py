"""A team's stores: a tiny-pair sweep with its certificate ledger, Optuna study and MLflow runs all on one Postgres
server (started by ``scripts/team-db`` as docs/usage.md shows), confirmed, then a second sweep's attempt on the same
server refused on the same items: the ledger is shared, not a file on one machine."""

from __future__ import annotations

import pytest

from tests.jobs.test_sweep_ledger import certification, run
from tests.workers.results.test_ledger_postgres import team_db  # noqa: F401 - the fixture

pytestmark = pytest.mark.slow


def test_a_sweep_keeps_its_ledger_study_and_runs_on_a_teams_postgres(tmp_path, team_db):  # noqa: F811
    import mlflow
    import optuna

    from workers.models.tiny import save_tiny_pair

    draft, target = save_tiny_pair(tmp_path / "pair", head_dim=16)
    pair = f"{draft}+{target}"
    stores = ("--ledger", team_db["ledger"], "--optuna-storage", team_db["optuna_storage"],
              "--tracking-uri", team_db["tracking_uri"])
    first = certification(run(tmp_path / "a", pair, *stores))
    assert first["attempt"] and first["family"]["number"] == 1 and first["family"]["level"] == 0.025
    studies = optuna.get_all_study_summaries(team_db["optuna_storage"])
    assert len(studies) == 1 and studies[0].n_trials >= 1, "the study lives on the server"
    mlflow.set_tracking_uri(team_db["tracking_uri"])
    assert len(mlflow.search_runs(experiment_names=["spectune-sweeps"])) >= 2, "the runs live on the server"
    # another machine's sweep (another runs root) on the same ledger: refused on the same items
    again = certification(run(tmp_path / "b", pair, "--ledger", team_db["ledger"], "--budgets", "0.25"))
    assert again["reason"].startswith("refused:") and first["attempt"] in again["reason"]
