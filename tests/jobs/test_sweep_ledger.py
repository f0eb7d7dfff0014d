"""The certificate ledger end to end: a tiny-pair sweep confirms once; a second sweep that changes the budget,
alpha, dtype, --subset-seed, --runs-root or the spelling of the pair is refused on the same confirmation items
(every attempt's items come from the pool's fixed order); with --new-items it confirms on unused items and its
certificate lists the earlier attempt. Then `python -m jobs.results export` of the first sweep ships its attempt
(one sweep serves both claims: an export needs a confirmed sweep, and that is the first one above)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def run(root: Path, pair: str, *extra: str) -> dict:
    from jobs import sweep as sweep_job

    rc = sweep_job.main(["--benchmark", "gsm8k", "--pair", pair, "--dtype", "fp32", "--items", "2", "--max-new-tokens",
                         "4", "--actors", "1", "--budgets", "0.2", "--policies", "kl_judge", "--draft-len", "2",
                         "--cost-ratio", "0.4", "--trials", "1", "--confirm-items", "3", "--confirm-candidates", "1",
                         "--skip-noise-floor", "--runs-root", str(root), "--run-dir", str(root / "sweep"), *extra])
    assert rc == 0
    return {Path(p).name: json.loads(Path(p).read_text()) for p in (root / "sweep" / "report").glob("chosen-budget-*.json")}


def certification(chosen: dict) -> dict:
    (only,) = chosen.values()
    return only["certification"]


def test_one_attempt_per_item_whatever_changes_and_new_items_confirms_elsewhere(tmp_path, capsys):
    import os

    from jobs.results import main as results
    from workers.models.tiny import save_tiny_pair
    from workers.results.history import read_rows

    draft, target = save_tiny_pair(tmp_path / "pair", head_dim=16)
    (tmp_path / "alias").symlink_to(tmp_path / "pair")
    pair = f"{draft}+{target}"
    first = certification(run(tmp_path / "a", pair))
    assert first["attempt"] and first["steps"] and not first["reason"].startswith("refused"), first["reason"]
    items = [r.split(",")[0] for r in (tmp_path / "a" / "sweep" / "report" / first["evidence"]).read_text().splitlines()[1:]]
    assert len(items) == 3
    # the same command again: the same attempt, resumed (reported again, nothing refused)
    assert certification(run(tmp_path / "a", pair))["attempt"] == first["attempt"]
    alias = f"{tmp_path / 'alias' / 'draft'},{tmp_path / 'alias' / 'target'}"
    for n, (spelling, extra) in enumerate([(pair, ("--budgets", "0.2000001")), (pair, ("--alpha", "0.1")),
                                           (pair, ("--dtype", "bf16")), (pair, ("--subset-seed", "5")),
                                           (alias, ())]):
        got = certification(run(tmp_path / f"other-root-{n}", spelling, *extra))
        assert got["reason"].startswith("refused:") and first["attempt"] in got["reason"], (extra, got["reason"])
        assert "--new-items" in got["reason"] and not got["certified"] and not got["steps"]
    fresh = certification(run(tmp_path / "b", pair, "--budgets", "0.2000001", "--new-items"))
    assert fresh["attempt"] != first["attempt"] and fresh["steps"] and fresh["new_items"]
    new_items = [r.split(",")[0] for r in (tmp_path / "b" / "sweep" / "report" / fresh["evidence"]).read_text().splitlines()[1:]]
    assert len(new_items) == 3 and not set(new_items) & set(items)
    assert any(first["attempt"] in e for e in fresh["earlier_attempts"])

    # exporting a result ships its attempt and the folder then checks: `python -m jobs.results export` writes the
    # attempt's ledger rows into the shipped history (here the session's copy, $SPECTUNE_HISTORY), so the exported
    # folder's `check` finds its attempt there
    history = Path(os.environ["SPECTUNE_HISTORY"])
    assert not [r for r in read_rows(history) if r.get("attempt") == first["attempt"]]
    capsys.readouterr()
    out = tmp_path / "exported"
    rc = results(["export", "--run-dir", str(tmp_path / "a" / "sweep"), "--out", str(out)])
    said = capsys.readouterr().out
    rows = [r for r in read_rows(history) if r.get("attempt") == first["attempt"]]
    assert {r["event"] for r in rows} == {"opened", "decided"} and "row(s) of this result's attempt added" in said
    assert "ledger: ok" in said and rc == 0, said
