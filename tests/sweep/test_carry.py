"""sweep.carry: a run directory, its references and the ledger in one verified archive, restored as they were."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import sqlite3
import tarfile
from pathlib import Path

import pytest

from sweep.carry import pack, unpack
from workers.results.store import reference_root, slug


def make_study(root: Path, ledger: Path) -> Path:
    run = root / "sweeps" / "study-a"
    (run / "trials" / "t0").mkdir(parents=True)
    (run / "sweep.json").write_text(json.dumps({"study": "study-a", "runs_root": str(root), "args": {
        "pair": "tiny-random", "dtype": "int8", "engine": "cpu"}}))
    with sqlite3.connect(run / "optuna.db") as db:  # a real database: packed through SQLite's backup
        db.execute("create table trials (number integer, value real)")
        db.execute("insert into trials values (0, 1.25)")
    db.close()
    (run / "trials" / "t0" / "records.jsonl").write_text('{"item_id": "a"}\n')
    ref = reference_root(root, "tiny-random", "int8") / "gsm8k" / "target-only-x"
    ref.mkdir(parents=True)
    (ref / "records.jsonl").write_text('{"item_id": "a", "tokens": [1, 2]}\n')
    other = root / "references" / slug("tiny-random-fp32") / "gsm8k" / "target-only-x"
    other.mkdir(parents=True)
    (other / "records.jsonl").write_text("another dtype's: not carried\n")
    ledger.mkdir(parents=True, exist_ok=True)
    (ledger / "gsm8k-abc.jsonl").write_text(json.dumps(row("a1", "q1")) + "\n")  # an older version's ledger file
    return run


def row(attempt: str, item: str) -> dict:
    return {"event": "opened", "attempt": attempt, "benchmark": "gsm8k", "pair_id": "pair:abc", "study": "study-a",
            "budgets": [0.05], "items": [item], "search_items": []}


def attempts(ledger: Path) -> list[str]:
    from workers.results.ledger import AttemptLedger

    return list(AttemptLedger("gsm8k", "pair:abc", ledger).attempts())


def test_pack_then_unpack_on_a_bare_machine_restores_the_study(tmp_path):
    root, ledger = tmp_path / "runs", tmp_path / "ledger"
    run = make_study(root, ledger)
    archive = tmp_path / "carried" / "study-a.tar.xz"
    manifest = pack(run, archive, ledger=ledger)
    parts = sorted((f["part"], f["path"]) for f in manifest["files"])
    where = reference_root(root, "tiny-random", "int8").relative_to(root).as_posix()
    assert ("references", f"{where}/gsm8k/target-only-x/records.jsonl") in parts
    assert not any("fp32" in p for _, p in parts), "only the study's pair and dtype"
    assert ("ledger", f"gsm8k-{hashlib.sha256(b'pair:abc').hexdigest()[:16]}.jsonl") in parts
    assert ("run", "optuna.db") in parts and manifest["study_ledger_rows"] == 1
    def files() -> dict[Path, bytes]:
        return {p: p.read_bytes() for p in sorted(tmp_path.rglob("*"))
                if p.is_file() and "carried" not in p.parts and "ledger" not in p.parts and p.suffix != ".db"}

    before = files()
    shutil.rmtree(root)
    shutil.rmtree(ledger)
    got = unpack(archive, ledger=ledger)
    assert (got["run"], got["references"], got["ledger rows"]) == (3, 1, 1)
    assert attempts(ledger) == ["a1"], "the carried attempt is in this machine's ledger database"
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
    shutil.rmtree(ledger)
    from workers.results.ledger import AttemptLedger

    AttemptLedger("gsm8k", "pair:abc", ledger).store.import_rows([row("a9", "q9")], "this machine's own attempt")
    unpack(archive, ledger=ledger)
    assert attempts(ledger) == ["a9", "a1"], "rows are added, never replaced"


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
    ref = reference_root(root, "tiny-random", "int8") / "gsm8k" / "target-only-x" / "records.jsonl"
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
    with pytest.raises(ValueError, match="not a readable carried sweep"):
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


def test_carried_rows_go_into_the_ledger_database_once_and_a_grown_cache_is_kept(tmp_path):
    root, ledger = tmp_path / "runs", tmp_path / "ledger"
    run = make_study(root, ledger)
    archive = tmp_path / "a.tar.xz"
    pack(run, archive, ledger=ledger)  # the old ledger file was imported into the database when packing
    shutil.rmtree(run)
    (ledger / "more.jsonl").write_text('{"event": "dec')  # a line torn by a crash in an older version's file
    ref = reference_root(root, "tiny-random", "int8") / "gsm8k" / "target-only-x" / "records.jsonl"
    ref.write_text(ref.read_text() + '{"item_id": "b", "tokens": [3]}\n')  # this machine's cache grew since
    got = unpack(archive, ledger=ledger)
    assert got["ledger rows"] == 0 and got["references"] == 0, "the database holds every carried row already"
    assert attempts(ledger) == ["a1"]
    assert '"b"' in ref.read_text(), "the grown cache is kept as it is"


def test_an_unpack_cut_short_finishes_when_run_again(tmp_path):
    root, ledger = tmp_path / "runs", tmp_path / "ledger"
    run = make_study(root, ledger)
    archive = tmp_path / "a.tar.xz"
    pack(run, archive, ledger=ledger)
    (run / "trials" / "t0" / "records.jsonl").unlink()  # as if the first unpack stopped before this file
    assert unpack(archive, ledger=ledger)["run"] == 1
    assert (run / "trials" / "t0" / "records.jsonl").read_text() == '{"item_id": "a"}\n'


def test_transient_files_are_not_packed_and_a_study_without_its_references_is_refused(tmp_path):
    root, ledger = tmp_path / "runs", tmp_path / "ledger"
    run = make_study(root, ledger)
    (run / "optuna.db-journal").write_bytes(b"a write in flight")
    (run / "report.md.tmp").write_text("half")
    names = {f["path"] for f in pack(run, tmp_path / "a.tar.xz", ledger=ledger)["files"]}
    assert "optuna.db-journal" not in names and "report.md.tmp" not in names and "optuna.db" in names
    with pytest.raises(ValueError, match="no reference records"):
        pack(run, tmp_path / "b.tar.xz", runs_root=tmp_path / "elsewhere", ledger=ledger)
    (run / "confirm").mkdir()
    with pytest.raises(ValueError, match="name the ledger it used"):
        pack(run, tmp_path / "b.tar.xz", ledger=tmp_path / "another-ledger")
    meta = json.loads((run / "sweep.json").read_text())
    del meta["runs_root"]
    (run / "sweep.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="--runs-root"):
        pack(run, tmp_path / "b.tar.xz", ledger=ledger)


def test_a_fixed_server_study_packs_its_run_directory_and_ledger(tmp_path):
    run, ledger = tmp_path / "runs" / "sweeps" / "server-a", tmp_path / "ledger"
    run.mkdir(parents=True)
    (run / "sweep.json").write_text(json.dumps({"study": "server-a", "mode": "server-config"}))
    ledger.mkdir()
    (ledger / "gsm8k-x.jsonl").write_text(json.dumps({**row("s1", "q1"), "pair_id": "endpoint:srv",
                                                     "study": "server-a"}) + "\n")
    manifest = pack(run, tmp_path / "s.tar.xz", ledger=ledger)
    assert {f["part"] for f in manifest["files"]} == {"run", "ledger"} and manifest["study_ledger_rows"] == 1


def test_an_archive_that_would_write_outside_its_parts_is_refused(tmp_path):
    root, ledger = tmp_path / "runs", tmp_path / "ledger"
    run = make_study(root, ledger)
    good = tmp_path / "a.tar.xz"
    pack(run, good, ledger=ledger)
    with tarfile.open(good, "r:xz") as tar:
        manifest = json.loads(tar.extractfile("carry.json").read())
    for part, path in (("references", ".ssh/authorized_keys"), ("ledger", "../x.jsonl"), ("other", "a"),
                       ("run", "../../escape")):
        bad = tmp_path / "evil.tar.xz"
        entry = {"part": part, "path": path, "bytes": 1, "sha256": "0" * 64}
        blob = json.dumps({**manifest, "files": [entry]}).encode()
        with tarfile.open(bad, "w:xz") as tar:
            info = tarfile.TarInfo("carry.json")
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))
        with pytest.raises(ValueError, match="outside what an archive may write"):
            unpack(bad, ledger=ledger)
