"""Results folders: every committed certificate under docs/results/ recomputes from its own per-item
evidence, and a folder whose evidence was edited is caught."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jobs.evidence import write_evidence
from jobs.results import main, recompute
from workers.certify.decide import certifies, sequential_bound
from workers.certify.sequential import look_plan

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = sorted(p.parent for p in (ROOT / "docs" / "results").glob("*/certification.json"))


def _folder(tmp_path: Path, lost: int = 1, n: int = 80) -> Path:
    rows = [{"item_id": f"i{k}", "reference_score": 1.0, "candidate_score": 0.0 if k < lost else 1.0,
             "reference": "ok", "candidate": "ok", "divergence": None} for k in range(n)]
    write_evidence(tmp_path / "evidence" / "trial-0.csv", rows)
    plan = look_plan(n, 2, 0.05, budget=0.1)
    got = sequential_bound([1.0] * n, [r["candidate_score"] for r in rows], plan, 0.1)
    seq = {**plan.to_dict(), "look": got.look, "stopped_at": None}
    cert = {"certified": certifies(got), "alpha": 0.05, "n": got.n, "p_value": got.p_value, "bound": got.upper,
            "discordance": got.discordance, "evidence": "evidence/trial-0.csv", "sequential": seq,
            "steps": [{"candidate": "trial-0", "losses": got.losses, "wins": got.wins, "look": got.look}]}
    choice = {"budget": 0.1, "certified": cert["certified"], "policy": "kl_judge", "params": {"threshold": 0.1},
              "draft_len": 5, "certification": cert, "confirm": {"speed.modelled_per_token": 1.5}}
    (tmp_path / "certification.json").write_text(json.dumps({"budgets": {"0.1": choice}}))
    return tmp_path


def test_a_folder_recomputes_and_an_edited_one_is_caught(tmp_path, capsys):
    folder = _folder(tmp_path)
    assert [r["matches"] for r in recompute(folder)] == [True]
    assert main(["check", str(folder)]) == 0 and "matches the certificate" in capsys.readouterr().out
    csv = folder / "evidence" / "trial-0.csv"
    csv.write_text(csv.read_text().replace("i5,1.0,1.0", "i5,1.0,0.0"))  # one more item lost
    assert main(["check", str(folder)]) == 1 and "DOES NOT MATCH" in capsys.readouterr().out


@pytest.mark.parametrize("folder", FOLDERS, ids=[p.name for p in FOLDERS])
def test_committed_results_recompute_from_their_evidence(folder):
    rows = recompute(folder)
    assert rows and all(r["matches"] for r in rows), rows
    assert (folder / "search_items.txt").is_file() and (folder / "table.md").is_file()
    searched = set((folder / "search_items.txt").read_text().split())
    for path in (folder / "evidence").glob("*.csv"):
        confirmed = {line.split(",")[0] for line in path.read_text().splitlines()[1:]}
        assert not confirmed & searched, "a confirmation item the search used"
