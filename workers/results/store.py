"""Where records live: an append-only JSONL per run (resumable: a rerun skips items already
there; a torn last line from a crash is ignored) and a parquet copy for analysis. Every whole-file write
of a run's results goes through :func:`atomic_path` (a temporary file, then a rename: a reader never sees
half a file). Plus the reference-run cache layout: target-only and lossless runs keyed by (pair, dtype,
benchmark, decoding settings).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import polars as pl

from workers.engine_registry import engine_traits
from workers.evaluation import DecodeSpec, Record

# Where Ray unpacks a job's ``--working-dir`` (inside the Ray session's temporary directory, garbage
# collected when Ray likes): nothing meant to last may be written below it.
RAY_WORKING_DIR_MARK = "runtime_resources/working_dir_files"
# The runs root of a Ray job that names none: per user and persistent, like Ray Tune's ~/ray_results.
RAY_JOB_DEFAULT = "~/spectune_runs"


@contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """A temporary path beside ``path`` to write the whole file to; renamed onto ``path`` when the block ends
    without an error (a reader sees the old file or the new one, never half of one; a failed write leaves no
    temporary behind)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        yield tmp
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text(path: str | os.PathLike[str], text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_json(path: str | os.PathLike[str], data: object) -> None:
    """``data`` as indented JSON (``default=str``), whole or not at all."""
    write_text(path, json.dumps(data, indent=1, default=str))


def in_ray_working_dir(path: str | os.PathLike[str]) -> bool:
    return RAY_WORKING_DIR_MARK in Path(path).resolve().as_posix()


def runs_root(explicit: str | os.PathLike[str] | None = None) -> Path:
    """Where run directories go: ``explicit`` (``--runs-root``), else ``$SPECTUNE_RUNS``, else ``./runs``.

    A Ray job submitted with ``--working-dir`` runs in Ray's unpacked copy of the checkout, a
    temporary directory: there the default is ``~/spectune_runs`` on the node that runs the driver
    (``scripts/ray-head`` sets ``SPECTUNE_RUNS`` to the checkout's ``runs/`` for its jobs, the
    KubeRay manifests to the shared volume), and a relative root that would land inside the copy
    is refused rather than lost."""
    given = explicit or os.environ.get("SPECTUNE_RUNS")
    if given:
        return persistent_dir(given, "--runs-root" if explicit else "SPECTUNE_RUNS")
    if in_ray_working_dir(Path.cwd()):
        return Path(RAY_JOB_DEFAULT).expanduser().resolve()
    return Path("runs").resolve()


def persistent_dir(path: str | os.PathLike[str], what: str) -> Path:
    """``path`` resolved; a ValueError naming ``what`` when that lies in a Ray job's temporary copy."""
    resolved = Path(path).expanduser().resolve()
    if in_ray_working_dir(resolved):
        raise ValueError(f"{what} {str(path)!r} resolves to {resolved}, inside Ray's temporary copy of the job's "
                         f"working_dir (deleted when Ray likes): give an absolute path (or unset it: a Ray job's "
                         f"default is $SPECTUNE_RUNS on the head, else {RAY_JOB_DEFAULT})")
    return resolved


def slug(text: str, limit: int = 80) -> str:
    """A file-name-safe, readable form of ``text`` that never merges two texts: where characters had to be
    replaced or the name cut to ``limit``, a hash of the whole text is appended (two long local pair paths,
    or one pair in bf16 and fp32, once shared a study and a reference cache through the cut)."""
    safe = re.sub(r"[^A-Za-z0-9._+-]+", "_", text).strip("_")
    if safe == text and len(safe) <= limit:
        return safe
    return f"{safe[: limit - 11]}-{hashlib.sha1(text.encode()).hexdigest()[:10]}"


class RecordStore:
    """Records of one (benchmark, spec) run in ``directory``: records.jsonl + records.parquet."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.dir = Path(directory)
        self.jsonl = self.dir / "records.jsonl"
        self.parquet = self.dir / "records.parquet"

    def load(self) -> dict[str, Record]:
        records: dict[str, Record] = {}
        if not self.jsonl.is_file():
            return records
        self._drop_torn_tail()
        with self.jsonl.open() as fh:
            for line in fh:
                try:
                    rec = Record.from_row(json.loads(line))
                except (json.JSONDecodeError, TypeError, KeyError):
                    continue  # a line torn by a crash mid-write: that item is simply redone
                records[rec.item_id] = rec
        return records

    def _drop_torn_tail(self) -> None:
        """A crash mid-write leaves a last line without its newline; cut it so the next append
        starts on a fresh line instead of gluing a good record onto the torn one."""
        data = self.jsonl.read_bytes()
        if data and not data.endswith(b"\n"):
            with self.jsonl.open("r+b") as fh:
                fh.truncate(data.rfind(b"\n") + 1)

    def append(self, record: Record) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        with self.jsonl.open("a") as fh:
            fh.write(json.dumps(record.to_row(), default=_nan_safe) + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def write_parquet(self, records: Iterable[Record] | None = None) -> Path:
        rows = [r.to_row() for r in (records if records is not None else self.load().values())]
        with atomic_path(self.parquet) as tmp:
            records_frame(rows).write_parquet(tmp)
        return self.parquet


def _nan_safe(value: object) -> object:
    return str(value)


def records_frame(rows: list[dict]) -> pl.DataFrame:
    if not rows:
        return pl.DataFrame()
    flat = []
    for row in rows:
        row = dict(row)
        row["decode_time_s"] = row["wall_time_s"] - row["prefill_time_s"]
        row["output_token_ids"] = json.dumps(row["output_token_ids"])
        flat.append(row)
    return pl.DataFrame(flat, infer_schema_length=None)


def reference_root(root: Path, pair: str, dtype: str, engine: str = "cpu") -> Path:
    """Where a pair's reference runs (every benchmark's) are cached: per engine off the CPU engine (the same greedy
    tokens up to kernels, other timings), and per version of the fast path's arithmetic (``FAST_NUMERICS``: its
    references from before a change that moved outputs are not this code's)."""
    from workers.models.pair import FAST_NUMERICS, FAST_TAGS

    traits = engine_traits(engine)
    name = pair if traits.reference else f"{pair}@{engine}"
    if traits.fast_path and dtype in FAST_TAGS and FAST_NUMERICS > 1:
        dtype = f"{dtype}-n{FAST_NUMERICS}"
    return root / "references" / slug(f"{name}-{dtype}")


def reference_dir(root: Path, pair: str, dtype: str, benchmark: str, spec: DecodeSpec, engine: str = "cpu") -> Path:
    """Cache directory of a reference run (target-only, or lossless at one draft length)."""
    kind = "target-only" if spec.draft_len == 0 else f"lossless-L{spec.draft_len}"
    return reference_root(root, pair, dtype, engine) / benchmark / f"{kind}-{spec.key()}"
