"""A sweep carried to another machine: its run directory, the reference records it reads and the ledger's attempts
in one verified archive, unpacked where the sweep resumes.

A study that takes hours outlives the machine it started on (a spot node, a VM whose disk is not kept, a CI
runner): rerunning the same command resumes it only where its run directory, its reference caches (under the
runs root, shared by studies over the same pair) and the certificate ledger (with the asset cache) are. ``pack``
puts the three in one ``.tar.xz`` with a manifest of every file's sha256; ``unpack`` checks every file against it
and every destination before writing anything, refuses to overwrite a run directory file or a reference cache that
differs (a cache that holds every record of the archive's, and more, is kept), and merges the ledger rows the
machine lacks under the ledger's lock (the ledger only grows: an item an attempt used on the first machine stays
used on the second).

The run directory is unpacked at the absolute path it was packed from: its MLflow store records absolute
artifact locations, and the study keys its resume on that path (``workers.results.ledger.Plan.run_dir``).
Knows the run directory's layout (``sweep.json``) and the runs root's; nothing about Ray or the models.
"""

from __future__ import annotations

import hashlib
import io
import json
import lzma
import os
import sqlite3
import tarfile
import tempfile
import time
from pathlib import Path, PurePosixPath
from typing import Any

from workers.results.store import reference_root

MANIFEST = "carry.json"
FORMAT = 1
PARTS = ("run", "references", "ledger")
# what a writer leaves beside its files for a moment: SQLite's journals (a backup copy carries the database whole),
# atomic writes' temporaries
TRANSIENT = (".db-journal", ".db-wal", ".db-shm", ".tmp", ".partial")


def _read(path: Path) -> bytes | None:
    """A file's bytes, None where it vanished since it was listed (a temporary); an SQLite database (Optuna's,
    MLflow's) through SQLite's backup, so a sweep writing it while it is packed leaves a consistent copy."""
    try:
        if path.suffix != ".db":
            return path.read_bytes()
        with tempfile.TemporaryDirectory() as tmp:
            copy = Path(tmp) / path.name
            # not read-only: a journal a crashed writer left is SQLite's to roll back first (a live writer's is
            # locked: the backup waits for its transaction)
            src, dst = sqlite3.connect(path, timeout=60), sqlite3.connect(copy)
            try:
                src.backup(dst)
            finally:
                dst.close()
                src.close()
            return copy.read_bytes()
    except FileNotFoundError:
        return None
    except sqlite3.DatabaseError as err:
        raise ValueError(f"{path} is not a readable SQLite database ({err})") from None


def _dump(path: Path) -> list[str]:
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return list(db.iterdump())
    finally:
        db.close()


def _same(path: Path, blob: bytes) -> bool:
    """Whether ``path`` holds ``blob``: the same bytes, or for an SQLite database the same rows (a backup's pages
    need not be the original's bytes)."""
    if not path.is_file():
        return False
    if path.read_bytes() == blob:
        return True
    if path.suffix != ".db":
        return False
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / path.name
        copy.write_bytes(blob)
        try:
            return _dump(path) == _dump(copy)
        except sqlite3.DatabaseError:
            return False


def _holds(path: Path, blob: bytes) -> bool:
    """Whether the reference file ``path`` already holds every record of ``blob``: the same bytes, or (a cache that
    grew since, on this machine or by an earlier carry) a records.jsonl with every line of the archive's, or a
    parquet whose records.jsonl does (the parquet is rebuilt from it)."""
    if _same(path, blob):
        return True
    if path.name == "records.jsonl" and path.is_file():
        have = set(path.read_text(errors="replace").splitlines())
        return all(line in have for line in blob.decode(errors="replace").splitlines() if line.strip())
    return path.name == "records.parquet" and path.with_name("records.jsonl").is_file()


def _files(base: Path) -> list[Path]:
    return sorted(p for p in base.rglob("*") if p.is_file() and not p.name.endswith(TRANSIENT))


def _reference_dirs(root: Path, args: dict[str, Any]) -> list[Path]:
    """The runs root's reference caches for the study's pair and dtype (every benchmark: a few MB at most)."""
    base = reference_root(root, args["pair"], args["dtype"], args.get("engine", "cpu"))
    return [base] if base.is_dir() else []


def _ledger_files(url: str) -> dict[str, bytes]:
    """The ledger's rows (every benchmark and pair it holds, the shipped history's included) as JSON-lines files,
    one per (benchmark, pair), named as the ledger files of earlier versions were."""
    from workers.results.ledger_store import store
    from workers.results.store import slug

    files: dict[str, list[str]] = {}
    for row in store(url).all_rows():
        tag = hashlib.sha256(str(row["pair_id"]).encode()).hexdigest()[:16]
        files.setdefault(f"{slug(str(row['benchmark']), 60)}-{tag}.jsonl", []).append(json.dumps(row))
    return {name: "".join(line + "\n" for line in lines).encode() for name, lines in files.items()}


def _study_rows(files: dict[str, bytes], study: str | None) -> int:
    rows = 0
    for blob in files.values():
        for line in blob.decode(errors="replace").splitlines():
            try:
                rows += json.loads(line).get("study") == study
            except (json.JSONDecodeError, AttributeError):
                continue
    return rows


def pack(run_dir: Path, out: Path, runs_root: Path | None = None, ledger: Path | str | None = None) -> dict[str, Any]:
    """Write ``out`` (.tar.xz): the run directory, its reference caches and the ledger's files; returns the manifest
    (``study_ledger_rows``: the ledger rows naming this study). ``runs_root``: where the references are (default:
    the one the study recorded in ``sweep.json``); ``ledger``: the ledger's URL or folder (default: this
    machine's, ``$SPECTUNE_LEDGER``), whose rows are packed as JSON lines. Refuses a study whose references or ledger rows it cannot find where it needs them."""
    from workers.results.ledger_store import ledger_url, shown

    run_dir = run_dir.expanduser().resolve()
    meta_path = run_dir / "sweep.json"
    if not meta_path.is_file():
        raise ValueError(f"{run_dir} is not a sweep's run directory: it has no sweep.json")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{meta_path} is not JSON ({err})") from None
    args = meta.get("args") or {}
    server = meta.get("mode") == "server-config"  # a fixed server's comparison: no reference caches of its own
    if not server and not {"pair", "dtype"} <= set(args):
        raise ValueError(f"{meta_path} names no pair and dtype: not a sweep's record")
    given = runs_root or (Path(meta["runs_root"]) if meta.get("runs_root") else None)
    if given is None and not server:
        raise ValueError(f"{meta_path} does not record its runs root (a study started before jobs.carry): "
                         "name it with --runs-root (where its references/ folder is)")
    root = given.expanduser().resolve() if given is not None else run_dir
    url = ledger_url(ledger)
    parts: list[tuple[str, Path, Path]] = [("run", run_dir, p) for p in _files(run_dir)]
    refs = [] if server else _reference_dirs(root, args)
    if not server and not refs and (run_dir / "trials").is_dir():
        raise ValueError(f"no reference records for {args['pair']} ({args['dtype']}) under {root / 'references'}, "
                         "though the study ran trials: name the runs root it used with --runs-root")
    for ref in refs:
        parts += [("references", root, p) for p in _files(ref)]
    ledger_files = _ledger_files(url)
    study_rows = _study_rows(ledger_files, meta.get("study"))
    if (run_dir / "confirm").is_dir() and not study_rows:
        raise ValueError(f"the study has started confirmation ({run_dir / 'confirm'}) but the ledger at {shown(url)} "
                         "holds none of its attempts: name the ledger it used with --ledger ($SPECTUNE_LEDGER)")
    read = [(part, base, p, _read(p)) for part, base, p in parts]
    read += [("ledger", Path("/ledger"), Path("/ledger") / name, blob) for name, blob in sorted(ledger_files.items())]
    kept = [(part, base, p, blob) for part, base, p, blob in read if blob is not None]
    files = [{"part": part, "path": p.relative_to(base).as_posix(), "bytes": len(blob),
              "sha256": hashlib.sha256(blob).hexdigest()} for part, base, p, blob in kept]
    manifest = {"format": FORMAT, "packed_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "study": meta.get("study"),
                "run_dir": str(run_dir), "runs_root": str(root), "study_ledger_rows": study_rows, "files": files}
    out = out.expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".partial")
    now = int(time.time())
    with tarfile.open(tmp, "w:xz") as tar:
        for name, blob in [(MANIFEST, json.dumps(manifest, indent=1).encode()),
                           *((f"{e['part']}/{e['path']}", k[3]) for e, k in zip(files, kept, strict=True))]:
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(blob), now
            tar.addfile(info, io.BytesIO(blob))
    tmp.replace(out)
    return manifest


def _checked_path(archive: Path, part: str, path: str) -> None:
    """A manifest entry that writes only where its part lives: the run directory's tree, ``references/`` under the
    runs root, a ``*.jsonl`` file directly in the ledger folder."""
    pure = PurePosixPath(path)
    bad = (part not in PARTS or pure.is_absolute() or ".." in pure.parts or not path
           or (part == "references" and pure.parts[0] != "references")
           or (part == "ledger" and (len(pure.parts) != 1 or pure.suffix != ".jsonl")))
    if bad:
        raise ValueError(f"{archive}: the manifest names {part}/{path}, outside what an archive may write")


def unpack(archive: Path, ledger: Path | str | None = None, run_dir: Path | None = None) -> dict[str, Any]:
    """Restore ``archive`` where it was packed from: the run directory's files (one that exists with other content
    is refused; missing ones are written, so an unpack cut short finishes when run again), the reference files (one
    that holds the archive's records, or more, is kept; another is refused) and the ledger rows this machine lacks.
    Every file and destination is checked before anything is written. ``run_dir``: must equal the packed one where
    given (a check, not a move). Returns counts per part and the command that resumes the study."""
    from workers.results.ledger_store import ledger_url, parse_lines, store

    archive = archive.expanduser()
    if not archive.is_file():
        raise ValueError(f"no such archive: {archive}")
    try:
        with tarfile.open(archive, "r:xz") as tar:
            try:
                manifest = json.loads(tar.extractfile(MANIFEST).read())  # type: ignore[union-attr]
                target, root, entries = Path(manifest["run_dir"]), Path(manifest["runs_root"]), manifest["files"]
            except (KeyError, AttributeError, TypeError, json.JSONDecodeError):
                raise ValueError(f"{archive} has no readable {MANIFEST}: not made by `jobs.carry pack`") from None
            if manifest.get("format") != FORMAT:
                raise ValueError(f"{archive}: carry format {manifest.get('format')!r}, this version reads {FORMAT}")
            blobs: dict[tuple[str, str], bytes] = {}
            for entry in entries:
                part, path = entry.get("part"), entry.get("path")
                _checked_path(archive, str(part), str(path))
                member = f"{part}/{path}"
                try:
                    data = tar.extractfile(member).read()  # type: ignore[union-attr]
                except (KeyError, AttributeError):
                    raise ValueError(f"{archive} lacks {member}, which its manifest lists") from None
                if hashlib.sha256(data).hexdigest() != entry.get("sha256"):
                    raise ValueError(f"{archive}: {member} does not match its sha256 in the manifest (corrupt archive)")
                blobs[(part, path)] = data
    except (tarfile.TarError, lzma.LZMAError, EOFError, OSError) as err:
        raise ValueError(f"{archive} is not a readable carried sweep (.tar.xz): {err}") from None
    if run_dir is not None and run_dir.expanduser().resolve() != target:
        raise ValueError(f"{archive} holds the run directory {target}: it unpacks there (its MLflow store and "
                         f"ledger plan record that path), not at {run_dir}")
    url = ledger_url(ledger)
    bases = {"run": target, "references": root, "ledger": Path("/ledger")}
    # check everything before writing anything: a refused unpack leaves this machine as it was
    writes: list[tuple[str, Path, bytes]] = []
    for (part, p), data in blobs.items():
        dest = bases[part] / p
        if part == "ledger":
            writes.append((part, dest, data))
        elif part == "run":
            if dest.exists() and not _same(dest, data):
                raise ValueError(f"{dest} exists with other content than the archive's: the study has moved on "
                                 "here (a run directory is never overwritten; move it away to unpack)")
            if not dest.exists():
                writes.append((part, dest, data))
        elif dest.exists():
            if not _holds(dest, data):
                raise ValueError(f"{dest} exists with other records than the archive's: the reference caches "
                                 "disagree (move that cache away to unpack)")
        else:
            writes.append((part, dest, data))
    for folder in {bases[part] for part, _, _ in writes if part != "ledger"}:
        probe = folder
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        if not os.access(probe, os.W_OK):
            raise ValueError(f"cannot write under {folder} (no permission at {probe})")
    counts = {"run": 0, "references": 0, "ledger rows": 0}
    for part, dest, data in writes:
        if part == "ledger":  # into the ledger's database: rows it lacks, each once
            counts["ledger rows"] += store(url).import_rows(parse_lines(data.decode(errors="replace").splitlines()),
                                                            f"carried:{archive.name}")
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(dest.name + ".partial")
        tmp.write_bytes(data)
        tmp.replace(dest)
        counts[part] += 1
    config = target / "config.yaml"
    return {"study": manifest.get("study"), "run_dir": str(target), "runs_root": str(root),
            "packed_at": manifest.get("packed_at"), **counts,
            "resume": f"python jobs/sweep.py --config {config}" if (target / "config.yaml").is_file() else None}
