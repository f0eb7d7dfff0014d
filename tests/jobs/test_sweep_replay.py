"""A sweep replays its T = 0 trials on the CPU engine (workers.replay) and gets exactly the records full
decoding gets; its objective is the modelled speedup over lossless at lossless's fastest L on the same items,
with the speedup over target-only reported beside it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

FIELDS = ("output_token_ids", "outputs", "score", "tokens", "num_drafts", "num_draft_tokens", "num_accepted_tokens",
          "accepted_per_position", "target_forwards", "draft_forwards", "finish_reasons")


def run(root: Path, *extra: str) -> Path:
    from jobs import sweep as sweep_job

    rc = sweep_job.main(["--benchmark", "gsm8k", "--pair", "tiny-random", "--dtype", "fp32", "--items", "5",
                         "--max-new-tokens", "24", "--actors", "1", "--budgets", "0.2", "--policies", "kl_judge",
                         "--draft-len", "2,4", "--cost-ratio", "0.4", "--trials", "1", "--search-only",
                         "--enqueue", "kl_judge:threshold=2.0,confidence=1.0", "--runs-root", str(root),
                         "--run-dir", str(root / "sweep"), *extra])
    assert rc == 0
    return root


def records(directory: Path) -> dict[str, dict]:
    return {row["item_id"]: row for row in (json.loads(line) for line in (directory / "records.jsonl").read_text().splitlines())}


def test_replayed_trials_equal_decoded_ones_and_rank_against_the_best_lossless(tmp_path):
    import optuna

    replayed, decoded = run(tmp_path / "replay"), run(tmp_path / "full", "--replay", "off")
    (a,), (b,) = (list((root / "sweep" / "trials").glob("*")) for root in (replayed, decoded))
    got, want = records(a), records(b)
    assert got.keys() == want.keys() and len(got) == 5
    for item in got:
        for f in FIELDS:
            assert got[item][f] == want[item][f], (item, f)
        assert got[item]["replay"] and not want[item]["replay"], "how each record was made is recorded"
    # lossless references at every L of the range, replayed: nothing decoded, identical to decoding them
    for n in (2, 3, 4):
        (x,) = (replayed / "references").rglob(f"lossless-L{n}-*")
        (y,) = (decoded / "references").rglob(f"lossless-L{n}-*")
        rx, ry = records(x), records(y)
        assert all(rx[i][f] == ry[i][f] for i in rx for f in FIELDS) and all(r["replay"] == "exact" for r in rx.values())
    meta = json.loads((replayed / "sweep" / "sweep.json").read_text())
    study = optuna.load_study(study_name=meta["study"], storage=f"sqlite:///{replayed / 'sweep' / 'optuna.db'}")
    (trial,) = [t for t in study.trials if t.state.name in ("COMPLETE", "PRUNED")]
    attrs = trial.user_attrs
    assert attrs["best_lossless_draft_len"] in (0, 2, 3, 4) and attrs["speedup_vs_best_lossless_modelled"] > 0
    assert attrs["replayed_exact"] + attrs["replayed_decoded"] == 5 and attrs["decoded_in_full"] == 0
    if trial.state.name == "COMPLETE":
        assert trial.values[0] == pytest.approx(attrs["speedup_vs_best_lossless_modelled"]), "the objective"


def test_each_chosen_rule_states_its_speed_over_the_best_lossless_modelled_and_measured_like_for_like(tmp_path):
    root = tmp_path / "s"
    from jobs import sweep as sweep_job

    rc = sweep_job.main(["--benchmark", "gsm8k", "--pair", "tiny-random", "--dtype", "fp32", "--items", "4",
                         "--max-new-tokens", "16", "--actors", "1", "--budgets", "0.5", "--policies", "kl_judge",
                         "--draft-len", "2,3", "--cost-ratio", "0.4", "--trials", "1", "--confirm-items", "3",
                         "--speed-items", "2", "--skip-noise-floor", "--runs-root", str(root),
                         "--run-dir", str(root / "sweep")])
    assert rc == 0
    cert = json.loads((root / "sweep" / "report" / "certification.json").read_text())
    (choice,) = cert["budgets"].values()
    vl, va = choice["vs_lossless"], choice["vs_target_only"]
    # the fastest lossless: target-only (L 0) or lossless at 2 or 3, whichever is fastest on these items
    assert vl["draft_len"] in (0, 2, 3) and vl["items"] == 3 and vl["modelled"] > 0 and va["modelled"] > 0
    assert vl["measured"] > 0 and va["measured"] > 0, "timed like for like on 2 items"
    assert vl["timed"]["items"] == 2 and vl["timed"]["concurrency"] == 1 and len(vl["timed"]["load_1m"]) == 2
    # the stated figure: modelled where the model agreed with the measurement within 15%, else measured
    assert vl["model_agrees"] == (abs(vl["modelled_timed"] / vl["measured"] - 1) <= 0.15)
    assert vl["stated"] == (vl["modelled"] if vl["model_agrees"] else vl["measured"])
    # the frontier beside the certificates: lossless and the accept-everything ceiling at every L of the range
    frontier = json.loads((root / "sweep" / "report" / "frontier.json").read_text())
    assert [r["draft_len"] for r in frontier["lossless"]] == [0, 2, 3] == [r["draft_len"] for r in frontier["ceiling"]]
    assert frontier["best_lossless"]["draft_len"] == vl["draft_len"], "the same best lossless as the certificate's"
    assert all(c["vs_best_lossless"] >= 1.0 for c in frontier["ceiling"] if c["draft_len"] == vl["draft_len"])
    assert len(frontier["trials"]) == 1 and len(frontier["budgets"]) == 1
    assert "## The budgets" in (root / "sweep" / "report" / "frontier.md").read_text()
