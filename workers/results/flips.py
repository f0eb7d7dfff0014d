"""Which items a rule flipped, and why: one row per item both arms ran, as ``flips.parquet``.

A trial's (search split) and a confirmed candidate's (confirmation split) records are paired with
the target-only references they were judged against. Each row says the two scores, whether the item
was lost (the candidate scored lower), won or the same, what each arm's scorer extracted and why it
scored so, whether the candidate's tokens diverged from target-only and at which output token, and
both outputs in full. ``dashboards.flips`` turns the flipped items into ``report/flips.md``, the two
texts side by side. Descriptions of what happened, not certificates: the decision lives in the evidence CSVs.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from workers.evaluation import Record
from workers.metrics.trial import score_of
from workers.results.store import atomic_path

COLUMNS = ("item_id", "reference_score", "candidate_score", "flip", "diverged", "divergence", "reference_answer",
           "candidate_answer", "reference_reason", "candidate_reason", "reference_failed", "candidate_failed",
           "reference_text", "candidate_text")


def divergence(reference: Record, candidate: Record) -> int:
    """The first output token (over every turn, in order) where the two differ; -1 if identical."""
    a = [x for turn in reference.output_token_ids or [] for x in turn]
    b = [x for turn in candidate.output_token_ids or [] for x in turn]
    return next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                -1 if len(a) == len(b) else min(len(a), len(b)))


def answer_of(r: Record | None) -> str:
    """What the scorer extracted (cut to 200 characters)."""
    return "" if r is None or r.extracted is None else str(r.extracted)[:200]


def reason_of(r: Record | None) -> str:
    """Why the item scored so, or the error of a failed item (cut to 300 characters)."""
    if r is None:
        return ""
    return (f"failed: {r.error}" if r.failed and r.error else r.reason or "")[:300]


def text_of(r: Record) -> str:
    return "\n\n".join(r.outputs or [])


def flip_rows(order: Sequence[str], reference: dict[str, Record], candidate: dict[str, Record]) -> list[dict[str, Any]]:
    """One row per item of ``order`` both arms have (see the module docstring); a failed item scores 0."""
    rows = []
    for key in order:
        r, c = reference.get(key), candidate.get(key)
        if r is None or c is None:
            continue
        a, b = score_of(r), score_of(c)
        where = -1 if r.failed or c.failed else divergence(r, c)
        rows.append({"item_id": key, "reference_score": a, "candidate_score": b,
                     "flip": "lost" if b < a else "won" if b > a else "same", "diverged": where >= 0,
                     "divergence": where, "reference_answer": answer_of(r), "candidate_answer": answer_of(c),
                     "reference_reason": reason_of(r), "candidate_reason": reason_of(c),
                     "reference_failed": r.failed, "candidate_failed": c.failed,
                     "reference_text": text_of(r), "candidate_text": text_of(c)})
    return rows


def write_flips(path: Path, rows: list[dict[str, Any]]) -> Path:
    """``rows`` as parquet at ``path`` (via a temporary file: never half written)."""
    import polars as pl

    schema = {c: pl.Float64 if c.endswith("_score") else pl.Int64 if c == "divergence"
              else pl.Boolean if c in ("diverged", "reference_failed", "candidate_failed") else pl.Utf8 for c in COLUMNS}
    frame = pl.DataFrame(rows, schema=schema) if rows else pl.DataFrame(schema=schema)
    with atomic_path(path) as tmp:
        frame.write_parquet(tmp)
    return path
