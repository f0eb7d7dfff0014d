"""Results folders: every committed certificate under docs/results/ recomputes from its own per-item
evidence, and a folder whose evidence was edited is caught."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jobs.results import main, recompute
from workers.certify.decide import certifies, sequential_bound
from workers.certify.sequential import look_plan
from workers.results.evidence import write_evidence

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


def test_a_fixed_sequence_that_certifies_two_candidates_is_checked_and_shown_by_the_chosen_one(tmp_path, capsys):
    """The chosen candidate of a fixed sequence that passed twice is the last; its evidence is what the certificate
    names, so the check and the tables read its step, not the first one's (a frontier once showed the first's
    3 lost beside the chosen's 0)."""
    from jobs.results import table
    from workers.metrics.frontier import budget_rows

    folder = _folder(tmp_path, lost=0)
    cert = json.loads((folder / "certification.json").read_text())
    cert_fields = cert["budgets"]["0.1"]["certification"]
    first = {"candidate": "trial-9", "losses": 3, "wins": 0, "look": 1}
    cert_fields["steps"] = [first, *cert_fields["steps"]]
    (folder / "certification.json").write_text(json.dumps(cert))
    assert [r["matches"] for r in recompute(folder)] == [True]
    assert "| 0 / 0 |" in table(folder) and "| 3 / 0 |" not in table(folder)
    assert budget_rows(cert["budgets"])[0]["lost"] == 0
    cert_fields["candidate"] = "trial-9"  # a certificate that names the other candidate reads its step
    assert budget_rows(cert["budgets"])[0]["lost"] == 3


def _gsm8k_folder(tmp_path: Path, ids: list[str], search: list[str]) -> Path:
    folder = _folder(tmp_path, n=len(ids))
    csv = folder / "evidence" / "trial-0.csv"
    lines = csv.read_text().splitlines()
    csv.write_text("\n".join([lines[0]] + [f"{i}," + line.split(",", 1)[1] for i, line in zip(ids, lines[1:], strict=True)]) + "\n")
    (folder / "sweep.json").write_text(json.dumps({"study": "s", "args": {"benchmark": "gsm8k"}}))
    (folder / "search_items.txt").write_text("".join(f"{i}\n" for i in search))
    return folder


def test_check_recomputes_the_design_and_the_pool_front_instead_of_trusting_them(tmp_path, capsys):
    """The check once trusted the recorded thresholds and never looked at which items were used: it now
    recomputes the design, and checks the items are the pool's first N in its fixed order, none searched."""
    from workers.benchmarks import get_benchmark

    bench = get_benchmark("gsm8k")
    search = bench.items(limit=6, seed=0, split="search")
    pool = [it.id for it in bench.confirmation_pool(search)[0]]
    searched = [it.id for it in search]
    folder = _gsm8k_folder(tmp_path / "ok", pool[:80], searched)
    assert [(r["matches"], r["design_matches"], r["pool_front"], r["disjoint"]) for r in recompute(folder)] == \
        [(True, True, True, True)]
    assert main(["check", str(folder)]) == 0 and "are the pool front in its fixed order" in capsys.readouterr().out
    # items picked out of order (the pool's 2nd..81st), or with a search item among them: caught
    shifted = _gsm8k_folder(tmp_path / "shifted", pool[1:81], searched)
    assert main(["check", str(shifted)]) == 1 and "are NOT the pool front" in capsys.readouterr().out
    leaked = _gsm8k_folder(tmp_path / "leaked", pool[:79] + searched[:1], searched)
    assert main(["check", str(leaked)]) == 1 and "SHARED WITH THE SEARCH" in capsys.readouterr().out
    # items an earlier attempt used are skipped in the front, as certification.json records them
    skipping = _gsm8k_folder(tmp_path / "skipping", pool[3:83], searched)
    cert = json.loads((skipping / "certification.json").read_text())
    (skipping / "certification.json").write_text(json.dumps({**cert, "pool": {"skipped": pool[:3]}}))
    assert [r["pool_front"] for r in recompute(skipping)] == [True]
    # an edited threshold no longer recomputes, even where the decision happens not to change
    cert = json.loads((folder / "certification.json").read_text())
    design = cert["budgets"]["0.1"]["certification"]["sequential"]
    design["thresholds"] = [z - 0.5 if z is not None else None for z in design["thresholds"]]
    (folder / "certification.json").write_text(json.dumps(cert))
    assert [r["design_matches"] for r in recompute(folder)] == [False]


@pytest.mark.parametrize("folder", FOLDERS, ids=[p.name for p in FOLDERS])
def test_committed_results_recompute_from_their_evidence(folder):
    rows = recompute(folder)
    assert rows and all(r["matches"] and r["design_matches"] and r["disjoint"] for r in rows), rows
    if (folder / "SUPERSEDED.md").is_file():  # made under an older pool order: the check says so and fails
        assert main(["check", str(folder)]) == 1
    else:
        assert all(r["ok"] for r in rows), rows
    assert (folder / "search_items.txt").is_file() and (folder / "table.md").is_file()
    searched = set((folder / "search_items.txt").read_text().split())
    for path in (folder / "evidence").glob("*.csv"):
        confirmed = {line.split(",")[0] for line in path.read_text().splitlines()[1:]}
        assert not confirmed & searched, "a confirmation item the search used"
