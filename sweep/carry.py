"""A sweep carried to another machine: its run directory, the reference records it reads and the ledger's attempts
in one verified archive, unpacked where the sweep resumes.

A study that takes hours outlives the machine it started on (a spot node, a VM whose disk is not kept, a CI
runner): rerunning the same command resumes it only where its run directory, its reference caches (under the
runs root, shared by studies over the same pair) and the certificate ledger (with the asset cache) are. ``pack``
puts the three in one ``.tar.xz`` with a manifest of every file's sha256; ``unpack`` checks every file against it,
refuses to overwrite a run directory or a reference file that differs, and appends the ledger rows this machine
lacks (the ledger only grows: an item an attempt used on the first machine stays used on the second).

The run directory is unpacked at the absolute path it was packed from: its MLflow store records absolute
artifact locations, and the study keys its resume on that path (``workers.results.ledger.Plan.run_dir``).
Knows the run directory's layout (``sweep.json``) and the runs root's; nothing about Ray or the models.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
import time
from pathlib import Path
from typing import Any

from workers.results.store import slug

MANIFEST = "carry.json"
FORMAT = 1


def _read(path: Path) -> bytes:
    """A file's bytes; an SQLite database (Optuna's, MLflow's) through SQLite's backup, so a sweep writing it while
    it is packed leaves a consistent copy, never a torn one."""
    if path.suffix != ".db":
        return path.read_bytes()
    import sqlite3
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / path.name
        src, dst = sqlite3.connect(f"file:{path}?mode=ro", uri=True), sqlite3.connect(copy)
        try:
            src.backup(dst)
        finally:
            dst.close()
            src.close()
        return copy.read_bytes()


def _dump(path: Path) -> list[str]:
    import sqlite3

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
    import sqlite3
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / path.name
        copy.write_bytes(blob)
        try:
            return _dump(path) == _dump(copy)
        except sqlite3.DatabaseError:
            return False


def _files(base: Path) -> list[Path]:
    return sorted(p for p in base.rglob("*") if p.is_file())


def _reference_dirs(root: Path, args: dict[str, Any]) -> list[Path]:
    """The runs root's reference caches for the study's pair and dtype (every benchmark: a few MB at most)."""
    pair = args["pair"] if args.get("engine", "cpu") == "cpu" else f"{args['pair']}@{args['engine']}"
    base = root / "references" / slug(f"{pair}-{args['dtype']}")
    return [base] if base.is_dir() else []


def pack(run_dir: Path, out: Path, runs_root: Path | None = None, ledger: Path | None = None) -> dict[str, Any]:
    """Write ``out`` (.tar.xz): the run directory, its reference caches and the ledger's files; returns the manifest.
    ``runs_root``: where the references are (default: the study's recorded ``--runs-root``, else the run
    directory's grandparent, ``<root>/sweeps/<study>``); ``ledger``: the ledger's folder (default: this machine's)."""
    from workers.results.ledger import ledger_root

    run_dir = run_dir.expanduser().resolve()
    meta_path = run_dir / "sweep.json"
    if not meta_path.is_file():
        raise ValueError(f"{run_dir} is not a sweep's run directory: it has no sweep.json")
    meta = json.loads(meta_path.read_text())
    args = meta.get("args") or {}
    if not {"pair", "dtype"} <= set(args):
        raise ValueError(f"{meta_path} names no pair and dtype: not a CPU or vLLM study's record")
    root = (runs_root or (Path(args["runs_root"]) if args.get("runs_root") else run_dir.parent.parent))
    root = root.expanduser().resolve()
    ledger = (ledger or ledger_root()).expanduser().resolve()
    parts: list[tuple[str, Path, Path]] = [("run", run_dir, p) for p in _files(run_dir)]
    for ref in _reference_dirs(root, args):
        parts += [("references", root, p) for p in _files(ref)]
    if ledger.is_dir():
        parts += [("ledger", ledger, p) for p in _files(ledger) if p.suffix == ".jsonl"]
    blobs = [_read(p) for _, _, p in parts]
    files = [{"part": part, "path": p.relative_to(base).as_posix(), "bytes": len(blob),
              "sha256": hashlib.sha256(blob).hexdigest()} for (part, base, p), blob in zip(parts, blobs, strict=True)]
    manifest = {"format": FORMAT, "packed_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "study": meta.get("study"),
                "run_dir": str(run_dir), "runs_root": str(root), "files": files}
    out = out.expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".partial")
    now = int(time.time())
    with tarfile.open(tmp, "w:xz") as tar:
        for name, blob in [(MANIFEST, json.dumps(manifest, indent=1).encode()),
                           *((f"{e['part']}/{e['path']}", b) for e, b in zip(files, blobs, strict=True))]:
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(blob), now
            tar.addfile(info, io.BytesIO(blob))
    tmp.replace(out)
    return manifest


def unpack(archive: Path, ledger: Path | None = None, run_dir: Path | None = None) -> dict[str, Any]:
    """Restore ``archive`` where it was packed from: the run directory (refused where it exists with other files),
    the reference files (an identical one is kept, a differing one refused, a missing one written) and the ledger
    rows this machine lacks. Every file is checked against the manifest's sha256 before anything is written.
    ``run_dir``: must equal the packed one where given (a check, not a move). Returns counts per part."""
    from workers.results.ledger import ledger_root

    archive = archive.expanduser()
    if not archive.is_file():
        raise ValueError(f"no such archive: {archive}")
    try:
        tar = tarfile.open(archive, "r:xz")
    except (tarfile.TarError, EOFError, OSError) as err:
        raise ValueError(f"{archive} is not a carried sweep (.tar.xz): {err}") from None
    with tar:
        try:
            manifest = json.loads(tar.extractfile(MANIFEST).read())  # type: ignore[union-attr]
        except (KeyError, AttributeError, json.JSONDecodeError):
            raise ValueError(f"{archive} has no readable {MANIFEST}: not made by `jobs.carry pack`") from None
        if manifest.get("format") != FORMAT:
            raise ValueError(f"{archive}: carry format {manifest.get('format')!r}, this version reads {FORMAT}")
        target = Path(manifest["run_dir"])
        if run_dir is not None and run_dir.expanduser().resolve() != target:
            raise ValueError(f"{archive} holds the run directory {target}: it unpacks there (its MLflow store and "
                             f"ledger plan record that path), not at {run_dir}")
        blobs: dict[tuple[str, str], bytes] = {}
        for entry in manifest["files"]:
            member = f"{entry['part']}/{entry['path']}"
            if ".." in Path(entry["path"]).parts or Path(entry["path"]).is_absolute():
                raise ValueError(f"{archive}: unsafe path {member!r}")
            try:
                data = tar.extractfile(member).read()  # type: ignore[union-attr]
            except (KeyError, AttributeError):
                raise ValueError(f"{archive} lacks {member}, which its manifest lists") from None
            if hashlib.sha256(data).hexdigest() != entry["sha256"]:
                raise ValueError(f"{archive}: {member} does not match its sha256 in the manifest (corrupt archive)")
            blobs[(entry["part"], entry["path"])] = data
    bases = {"run": target, "references": Path(manifest["runs_root"]),
             "ledger": (ledger or ledger_root()).expanduser().resolve()}
    # check everything before writing anything: a refused unpack leaves this machine as it was
    if target.exists() and any(target.iterdir()):
        same = all(_same(target / p, b) for (part, p), b in blobs.items() if part == "run")
        if not same:
            raise ValueError(f"{target} exists and holds other files than the archive's: move it away first "
                             "(a run directory is never overwritten)")
    for (part, p), data in blobs.items():
        dest = bases[part] / p
        if part == "references" and dest.is_file() and dest.read_bytes() != data:
            raise ValueError(f"{dest} exists with other records than the archive's: the reference caches disagree")
    counts = {"run": 0, "references": 0, "ledger rows": 0}
    for (part, p), data in blobs.items():
        dest = bases[part] / p
        dest.parent.mkdir(parents=True, exist_ok=True)
        if part == "ledger":
            have = set(dest.read_text().splitlines()) if dest.is_file() else set()
            new = [line for line in data.decode().splitlines() if line.strip() and line not in have]
            if new:
                with dest.open("a") as f:
                    f.write("".join(line + "\n" for line in new))
            counts["ledger rows"] += len(new)
            continue
        if _same(dest, data):
            continue
        tmp = dest.with_name(dest.name + ".partial")
        tmp.write_bytes(data)
        tmp.replace(dest)
        counts[part] += 1
    return {"study": manifest.get("study"), "run_dir": str(target), "runs_root": manifest["runs_root"],
            "packed_at": manifest.get("packed_at"), **counts}
