"""sweep.carry: a run directory, its references and the ledger in one verified archive, restored as they were."""

from __future__ import annotations

import io
import json
import shutil
import sqlite3
import tarfile
from pathlib import Path

import pytest

from sweep.carry import pack, unpack
from workers.results.store import slug


def make_study(root: Path, ledger: Path) -> Path:
    run = root / "sweeps" / "study-a"
    (run / "trials" / "t0").mkdir(parents=True)
    (run / "sweep.json").write_text(json.dumps({"study": "study-a", "args": {
        "pair": "tiny-random", "dtype": "int8", "engine": "cpu", "runs_root": str(root)}}))
    with sqlite3.connect(run / "optuna.db") as db:  # a real database: packed through SQLite's backup
        db.execute("create table trials (number integer, value real)")
        db.execute("insert into trials values (0, 1.25)")
    db.close()
    (run / "trials" / "t0" / "records.jsonl").write_text('{"item_id": "a"}\n')
    ref = root / "references" / slug("tiny-random-int8") / "gsm8k" / "target-only-x"
    ref.mkdir(parents=True)
    (ref / "records.jsonl").write_text('{"item_id": "a", "tokens": [1, 2]}\n')
    other = root / "references" / slug("tiny-random-fp32") / "gsm8k" / "target-only-x"
    other.mkdir(parents=True)
    (other / "records.jsonl").write_text("another dtype's: not carried\n")
    ledger.mkdir(parents=True, exist_ok=True)
    (ledger / "gsm8k-abc.jsonl").write_text('{"event": "opened", "items": ["q1"]}\n')
    return run


def test_pack_then_unpack_on_a_bare_machine_restores_the_study(tmp_path):
    root, ledger = tmp_path / "runs", tmp_path / "ledger"
    run = make_study(root, ledger)
    archive = tmp_path / "carried" / "study-a.tar.xz"
    manifest = pack(run, archive, ledger=ledger)
    parts = sorted((f["part"], f["path"]) for f in manifest["files"])
    assert ("references", f"references/{slug('tiny-random-int8')}/gsm8k/target-only-x/records.jsonl") in parts
    assert not any("fp32" in p for _, p in parts), "only the study's pair and dtype"
    assert ("ledger", "gsm8k-abc.jsonl") in parts and ("run", "optuna.db") in parts
    def files() -> dict[Path, bytes]:
        return {p: p.read_bytes() for p in sorted(tmp_path.rglob("*"))
                if p.is_file() and "carried" not in p.parts and p.suffix != ".db"}

    before = files()
    shutil.rmtree(root)
    shutil.rmtree(ledger)
    got = unpack(archive, ledger=ledger)
    assert (got["run"], got["references"], got["ledger rows"]) == (3, 1, 1)
    assert {p: b for p, b in before.items() if "fp32" not in str(p)} == files()
    db = sqlite3.connect(run / "optuna.db")
    assert db.execute("select number, value from trials").fetchall() == [(0, 1.25)]
    db.close()
    # unpacking again changes nothing (identical files kept, no ledger row twice)
    again = unpack(archive, ledger=ledger)
    assert (again["run"], again["references"], again["ledger rows"]) == (0, 0, 0)


def test_the_ledger_is_merged_never_replaced(tmp_path):
    root, ledger = tmp_path / "runs", tmp_path / "ledger"
    run = make_study(root, ledger)
    archive = tmp_path / "a.tar.xz"
    pack(run, archive, ledger=ledger)
    (ledger / "gsm8k-abc.jsonl").write_text('{"event": "opened", "items": ["q9"]}\n')  # this machine's own attempt
    unpack(archive, ledger=ledger)
    rows = (ledger / "gsm8k-abc.jsonl").read_text().splitlines()
    assert rows == ['{"event": "opened", "items": ["q9"]}', '{"event": "opened", "items": ["q1"]}']


def test_refusals_name_the_problem_and_write_nothing(tmp_path):
    root, ledger = tmp_path / "runs", tmp_path / "ledger"
    run = make_study(root, ledger)
    archive = tmp_path / "a.tar.xz"
    pack(run, archive, ledger=ledger)
    # a run directory that holds other files is never overwritten
    (run / "optuna.db").write_bytes(b"a later state")
    with pytest.raises(ValueError, match="never overwritten"):
        unpack(archive, ledger=ledger)
    assert (run / "optuna.db").read_bytes() == b"a later state"
    # a reference cache that disagrees is refused
    shutil.rmtree(run)
    ref = root / "references" / slug("tiny-random-int8") / "gsm8k" / "target-only-x" / "records.jsonl"
    ref.write_text("other tokens\n")
    with pytest.raises(ValueError, match="reference caches disagree"):
        unpack(archive, ledger=ledger)
    assert not run.exists(), "nothing written before every check passed"
    # the run directory unpacks where it was packed from
    with pytest.raises(ValueError, match="unpacks there"):
        unpack(archive, ledger=ledger, run_dir=tmp_path / "elsewhere")
    # not a sweep's run directory; not an archive; a corrupt member
    with pytest.raises(ValueError, match="no sweep.json"):
        pack(tmp_path / "nothing", tmp_path / "b.tar.xz", ledger=ledger)
    (tmp_path / "junk.tar.xz").write_bytes(b"not xz")
    with pytest.raises(ValueError, match="not a carried sweep"):
        unpack(tmp_path / "junk.tar.xz", ledger=ledger)
    with pytest.raises(ValueError, match="no such archive"):
        unpack(tmp_path / "missing.tar.xz", ledger=ledger)
    with tarfile.open(archive, "r:xz") as tar:
        members = [(m, tar.extractfile(m).read() if m.isfile() else None) for m in tar.getmembers()]
    bad = tmp_path / "bad.tar.xz"
    with tarfile.open(bad, "w:xz") as tar:
        for m, data in members:
            if m.name == "run/optuna.db":
                data = b"flipped bytes!!"
                m.size = len(data)
            tar.addfile(m, io.BytesIO(data) if data is not None else None)
    with pytest.raises(ValueError, match="sha256"):
        unpack(bad, ledger=ledger)
