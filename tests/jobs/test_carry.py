"""jobs.carry end to end: a tiny sweep packed, its machine's run directory, references and ledger wiped, unpacked,
and the same command resumes it: the finished trials are kept, not redone."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.jobs.test_sweep import ROOT, sweep, trials

pytestmark = pytest.mark.slow


def test_a_packed_sweep_resumes_on_a_bare_machine(tmp_path, capsys):
    import os

    from jobs import carry

    # one pair actor (the study's config.yaml keeps it, so the resumed process starts one too): what is carried
    # is the study, not how many actors evaluated it
    sweep(tmp_path, "--trials", "2", "--search-only", "--actors", "1")
    run_dir = tmp_path / "sweep"
    first = {t.number: (t.state.name, t.params) for t in trials(run_dir)}
    meta = json.loads((run_dir / "sweep.json").read_text())
    archive = tmp_path / "carried" / "study.tar.xz"
    assert carry.main(["pack", "--run-dir", str(run_dir), "--out", str(archive)]) == 0
    assert "packed study" in capsys.readouterr().out
    ledger = Path(os.environ["SPECTUNE_LEDGER"])
    for gone in (run_dir, tmp_path / "references", ledger):  # a new machine: none of it is there
        shutil.rmtree(gone, ignore_errors=True)
    assert carry.main(["unpack", str(archive)]) == 0
    assert "jobs/sweep.py --config" in capsys.readouterr().out
    # the references came back, so the resumed study evaluates no reference again
    assert list((tmp_path / "references").rglob("records.jsonl"))
    # resumed in a new process, as on the new machine (this one's MLflow client still holds the wiped database open)
    # with the command unpack printed (the study's own config.yaml), one more trial asked for
    done = subprocess.run([sys.executable, str(ROOT / "jobs" / "sweep.py"), "--config", str(run_dir / "config.yaml"),
                           "--trials", "3"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    meta2 = json.loads((run_dir / "sweep.json").read_text())
    assert meta2["parent_run_id"] == meta["parent_run_id"] and meta2["profile"] == meta["profile"]
    after = {t.number: (t.state.name, t.params) for t in trials(run_dir)}
    assert {n: after[n] for n in first} == first, "the carried trials are kept as they were"
    assert len([s for s, _ in after.values() if s in ("COMPLETE", "PRUNED")]) == 3
    # a second unpack over the resumed study is refused: the run directory has moved on
    assert carry.main(["unpack", str(archive)]) == 2
    assert "never overwritten" in capsys.readouterr().err
