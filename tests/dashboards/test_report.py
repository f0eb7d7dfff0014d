"""write_report: the artifact set, degenerate sweeps, the noise-floor note and the offline CLI."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import polars as pl
import pytest

from dashboards.report import main, noise_floor_note, write_report
from dashboards.tables import budget_winners
from tests.dashboards.trialdata import assert_png, frame, sweep, trial

BUDGETS = [0.01, 0.02, 0.05]
NOISE = {"items": 200, "divergence_rate": 0.08, "accuracy_diff": 0.005, "accuracy_diff_ci": [-0.01, 0.015]}
ACCEPTANCE = {"kl_judge": (100, [80, 60, 40, 20, 10]), "lossless": (120, [70, 40, 20, 5, 1])}
ALWAYS = {"trials.parquet", "trials.csv", "pareto.png", "pareto.csv", "budget_table.md", "budget_winners.csv",
          "report.md"}
REPO = Path(__file__).resolve().parents[2]


def _full(out: Path) -> dict[str, Path]:
    return write_report(sweep(), out, reference_accuracy=0.62, budgets=BUDGETS, winners_acceptance=ACCEPTANCE,
                        noise_floor=NOISE, title="gsm8k sweep")


def test_full_report_writes_every_artifact(tmp_path):
    paths = _full(tmp_path / "report")
    assert set(paths) == ALWAYS | {"acceptance_hist.png", "per_position.png", "acceptance.json", "noise_floor.json"}
    assert all(p.parent == tmp_path / "report" and p.stat().st_size > 0 for p in paths.values())
    for name in ("pareto.png", "acceptance_hist.png", "per_position.png"):
        assert_png(paths[name])
    assert pl.read_csv(paths["pareto.csv"])["trial"].to_list() == [0, 1, 4]
    saved = pl.read_csv(paths["budget_winners.csv"])
    assert saved["trial"].to_list() == budget_winners(sweep(), BUDGETS)["trial"].to_list()
    assert pl.read_parquet(paths["trials.parquet"]).height == sweep().height


def test_report_markdown_content(tmp_path):
    text = _full(tmp_path)["report.md"].read_text()
    assert text.startswith("# gsm8k sweep")
    assert "8 trials: 6 complete, 1 pruned, 1 failed" in text
    assert "| 5% | — | 1.90x (τ=0.5, conf=0.9, L=5) | 1.50x (L=5) | 2.40x (k=8, L=6) | — | 2.40x top_k (k=8, L=6) |" in text
    assert "Search split, bootstrap 95% upper bound" in text and "(not certificates)" in text
    assert "cannot be told apart from zero: 1%." in text, "the floor (1.5%) covers 1% but not 2%"
    for image in ("pareto.png", "acceptance_hist.png", "per_position.png"):
        assert f"]({image})" in text
    table = (tmp_path / "budget_table.md").read_text()
    assert "| budget | dropmatch | kl_judge | lossless | top_k | typical | best |" in table


def test_certified_table_comes_first_and_is_written_beside(tmp_path):
    from dashboards.tables import certification_table

    choice = {"budget": 0.05, "policy": "top_k", "params": {"k": 8}, "draft_len": 6, "certified": True,
              "certification": {"alpha": 0.05, "bound": 0.031, "drop": 0.004, "n": 500, "discordance": 0.12,
                                "items_needed": None, "p_value": 0.0123},
              "confirm": {"speed.modelled_per_token": 1.8, "speed.modelled_per_token_lo": 1.7,
                          "speed.modelled_per_token_hi": 1.9}}
    floor = {"draft_len": 6, "items": 500, "output_divergence": 0.08, "bound.upper": 0.012, "bound.drop": -0.002,
             "bound.discordance": 0.03}
    table = certification_table([choice, {**choice, "budget": 0.01, "certified": False,
                                          "certification": {**choice["certification"], "items_needed": 5000}}], [floor])
    assert "| 5% | **yes** | top_k (k=8, L=6) | 0.0123 | 3.10% | +0.40% | 500 | 0.120 | — | — | 1.80x [1.70, 1.90] |" in table
    assert "| 1% | no |" in table and "5,000" in table, "an uncertified budget says the items a certificate needs"
    assert "noise floor (lossless L=6)" in table and "outputs differ on 8.00%" in table
    paths = write_report(frame(trial(0, "top_k", 2.0, 0.6)), tmp_path, reference_accuracy=0.6, budgets=[0.05],
                         certification=table)
    text = paths["report.md"].read_text()
    assert text.index("## Certified budgets") < text.index("on the search split (not certificates)")
    assert paths["certification.md"].read_text() == table


@pytest.mark.parametrize("trials", [
    pl.DataFrame(),
    frame(trial(0, "dropmatch", 2.0, 0.5, state="PRUNED"), trial(1, "top_k", float("nan"), float("nan"), state="FAIL")),
    frame(trial(0, "kl_judge", float("nan"), 0.61)),
], ids=["empty", "pruned-and-failed-only", "nan-speedup-only"])
def test_no_completed_trial_still_reports(tmp_path, trials):
    paths = write_report(trials, tmp_path, reference_accuracy=0.62, budgets=BUDGETS)
    assert set(paths) == ALWAYS
    assert_png(paths["pareto.png"])
    assert "No trial completed" in paths["report.md"].read_text()
    assert pl.read_csv(paths["budget_winners.csv"]).height == 0
    assert pl.read_csv(paths["pareto.csv"]).height == 0


def test_single_trial(tmp_path):
    paths = write_report(frame(trial(3, "top_k", 1.3, 0.615, params={"k": 2})), tmp_path,
                         reference_accuracy=0.62, budgets=[0.01])
    text = paths["report.md"].read_text()
    assert "1 trial: 1 complete" in text and "1.30x top_k (k=2, L=5)" in text


def test_bad_acceptance_counts_skip_plots_not_the_report(tmp_path):
    with pytest.warns(UserWarning, match="acceptance plots skipped"):
        paths = write_report(sweep(), tmp_path, reference_accuracy=0.62, budgets=BUDGETS,
                             winners_acceptance={"broken": (10, [3, 5])})
    assert "acceptance_hist.png" not in paths and "Acceptance plots skipped" in paths["report.md"].read_text()


def test_noise_floor_note():
    assert "No noise-floor run" in noise_floor_note(None, BUDGETS)
    wide = {"items": 50, "divergence_rate": 0.02, "accuracy_diff_ci_lo": -0.002, "accuracy_diff_ci_hi": 0.004,
            "accuracy_diff": 0.001}
    assert noise_floor_note(wide, BUDGETS).startswith("Every budget is wider")
    noisy = {**NOISE, "accuracy_diff_ci": [-0.03, 0.02]}
    assert noise_floor_note(noisy, BUDGETS).endswith("cannot be told apart from zero: 1%, 2%.")

    @dataclass
    class Floor:  # shaped like workers.metrics.NoiseFloor, which dashboards does not import
        items: int
        divergence_rate: float
        accuracy_diff: float
        accuracy_diff_ci: tuple[float, float]

    assert "differ on 8.0% of 200 items" in noise_floor_note(Floor(200, 0.08, 0.0, (-0.01, 0.01)), BUDGETS)
    assert "could not be measured" in noise_floor_note({"items": 0, "divergence_rate": float("nan"),
                                                        "accuracy_diff": float("nan"),
                                                        "accuracy_diff_ci": [float("nan")] * 2}, BUDGETS)


def test_cli_rebuilds_the_same_report_offline(tmp_path):
    first = _full(tmp_path / "first")
    second = tmp_path / "second"
    cmd = [sys.executable, "-m", "dashboards.report", "--trials", str(first["trials.parquet"]), "--out", str(second),
           "--reference-accuracy", "0.62", "--budgets", "0.01,0.02,0.05", "--title", "gsm8k sweep",
           "--noise-floor", str(first["noise_floor.json"]), "--acceptance", str(first["acceptance.json"])]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    for name in ("report.md", "budget_table.md", "budget_winners.csv", "pareto.csv", "trials.csv"):
        assert (second / name).read_text() == first[name].read_text(), f"{name} differs after the rebuild"
    assert_png(second / "acceptance_hist.png")


def test_cli_reads_csv_frames(tmp_path, capsys):
    first = _full(tmp_path / "first")
    assert main(["--trials", str(first["trials.csv"]), "--out", str(tmp_path / "csv"), "--reference-accuracy", "0.62",
                 "--budgets", "0.01, 0.05"]) == 0
    assert "report.md" in capsys.readouterr().out
    assert (pl.read_csv(tmp_path / "csv" / "budget_winners.csv")["trial"].to_list()
            == budget_winners(sweep(), [0.01, 0.05])["trial"].to_list())


def test_nested_columns_survive_csv(tmp_path):
    # A sweep may keep TrialMetrics.acceptance_per_position in the frame; CSV cannot hold lists.
    trials = sweep().with_columns(acceptance_per_position=pl.lit([0.8, 0.5], dtype=pl.List(pl.Float64)))
    paths = write_report(trials, tmp_path, reference_accuracy=0.62, budgets=[0.01])
    assert pl.read_csv(paths["trials.csv"])["acceptance_per_position"][0] == "[0.8, 0.5]"
    assert pl.read_parquet(paths["trials.parquet"])["acceptance_per_position"][0].to_list() == [0.8, 0.5]


def test_dashboards_import_no_cluster_tracking_or_model_stack():
    code = ("import sys, dashboards.report; "
            "print(sorted(m for m in ('ray', 'mlflow', 'optuna', 'torch') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", "dashboards/ must stay importable without ray, mlflow, optuna or torch"


def test_cli_rebuilds_in_place(tmp_path):
    # The command report.md prints runs inside the report folder and overwrites trials.parquet.
    first = _full(tmp_path)
    before = first["report.md"].read_text()
    line = next(x for x in before.splitlines() if x.startswith("Rebuild offline"))
    args = line.split("`")[1].split()[3:]  # drop "python -m dashboards.report"
    args = [str(tmp_path / a) if a.endswith((".parquet", ".json")) or a == "." else a for a in args]
    assert main(args[:args.index("--title")] + ["--title", "gsm8k sweep"]) == 0
    assert first["report.md"].read_text() == before
