"""The paired per-item evidence a confirmation is decided on: a reference and a candidate arm over the fixed
confirmation item set, nothing flipping sides (a failed reference item counts as right, a failed or missing
candidate item as wrong), a futility stop keeping the items up to its look, and the CSV anyone can recompute
a certificate from. :mod:`sweep.confirm` runs the evaluations and decides with these."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from workers.certify.decide import DropBound, drop_bound, first_prune
from workers.evaluation import Record
from workers.metrics.trial import score_of
from workers.results.flips import answer_of, divergence, reason_of
from workers.results.store import write_text


def made_by(r: Record | None) -> str:
    """How a record was made, as the evidence states it: ``decoded in full``, or ``replayed: <how>`` (its
    ``Record.replay``: ``exact``, or where live decoding took over, per turn; ``workers.replay``)."""
    if r is None:
        return ""
    return "decoded in full" if r.timed else f"replayed: {r.replay}"


def paired(reference: dict[str, Record], trial: dict[str, Record]) -> tuple[list[float], list[float]]:
    """Scores of the items both arms attempted, reference order; failures count as 0 in their arm."""
    keys = [k for k in reference if k in trial]
    return [score_of(reference[k]) for k in keys], [score_of(trial[k]) for k in keys]


def ordered_prefix(order: Sequence[str], reference: dict[str, Record], trial: dict[str, Record]
                   ) -> tuple[list[float], list[float]]:
    """Paired scores of the longest run of items, in the fixed item ``order``, that are all done.

    The anytime-valid prune test assumes the items arrive in an order fixed before their outcomes
    are seen; completion order is not (a long, wrong answer finishes late), so looks use only the
    completed prefix of the item order."""
    ref, got = [], []
    for key in order:
        if key not in trial:
            break
        if key in reference:
            ref.append(score_of(reference[key]))
            got.append(score_of(trial[key]))
    return ref, got


def bound_between(reference: dict[str, Record], trial: dict[str, Record], alpha: float) -> DropBound:
    ref, got = paired(reference, trial)
    return drop_bound(ref, got, alpha)


def confirmation_rows(order: Sequence[str], reference: dict[str, Record], trial: dict[str, Record],
                      futility: tuple[float, float] | None = None) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """The per-item evidence of a candidate's certificate, over the *whole* fixed confirmation item set.

    Nothing flips sides: a reference item that failed (or is missing) counts as right, so a candidate
    cannot win on it; a candidate item that failed or never came back (a timeout, an actor lost) counts
    as wrong. A candidate stopped for futility (``futility`` = (budget, alpha) of its prune test) keeps
    the items up to the first look at which the test fired and counts the rest as wrong: its evidence is
    then the same whatever finished after the stop. Returns one row per item (``item_id``,
    ``reference_score``, ``candidate_score``, ``reference``/``candidate`` status: ok, failed, missing, or
    after_stop; ``divergence``: the first output token position where the two differ, -1 if identical;
    ``candidate_made``: how the candidate's record was made, :func:`made_by`;
    ``*_answer`` / ``*_reason``: what each arm's scorer extracted and why it scored so)
    and the counts of ``reference_failed``, ``reference_missing``, ``candidate_failed``,
    ``candidate_missing``, ``kept`` and ``candidate_replayed`` (ok candidate records made by replay)."""
    keep = len(order)
    if futility is not None:
        a, b = ordered_prefix(order, reference, trial)
        fired = first_prune(a, b, futility[0], futility[1]) if a else None
        keep = len(order) if fired is None else fired
    counts = dict.fromkeys(("reference_failed", "reference_missing", "candidate_failed", "candidate_missing"), 0)
    rows = []
    for i, key in enumerate(order):
        r, t = reference.get(key), trial.get(key)
        ref_status = ("not_run" if i >= keep else "missing") if r is None else "failed" if r.failed else "ok"
        got_status = ("after_stop" if t is not None else "missing") if t is None or i >= keep else \
            "failed" if t.failed else "ok"
        if ref_status in ("missing", "failed"):
            counts[f"reference_{ref_status}"] += 1
        if got_status != "ok":
            counts["candidate_failed" if got_status == "failed" else "candidate_missing"] += 1
        where = divergence(r, t) if ref_status == "ok" and got_status == "ok" else None
        rows.append({"item_id": key, "reference_score": 1.0 if ref_status != "ok" else score_of(r),
                     "candidate_score": score_of(t) if got_status == "ok" else 0.0,
                     "reference": ref_status, "candidate": got_status, "divergence": where,
                     "candidate_made": made_by(t) if i < keep else "",
                     # why: what each arm's scorer extracted and said (an error for a failed item)
                     "reference_answer": answer_of(r), "candidate_answer": answer_of(t) if i < keep else "",
                     "reference_reason": reason_of(r), "candidate_reason": reason_of(t) if i < keep else ""})
    counts["kept"] = keep
    # how the evidence was made: the candidate's ok records that were replayed (workers.replay), not decoded
    counts["candidate_replayed"] = sum(r["candidate"] == "ok" and r["candidate_made"].startswith("replayed")
                                       for r in rows)
    return rows, counts


def refutation_pairs(order: Sequence[str], reference: dict[str, Record], trial: dict[str, Record]
                     ) -> tuple[list[float], list[float], int]:
    """(reference scores, candidate scores, failed items) a refutation rests on (``workers.certify.verdict``): the
    longest prefix of the fixed ``order`` on which both arms have a record, as observed (never the losses
    :func:`confirmation_rows` books past a futility stop, which certify nothing but would refute anything), a failed
    item turned against refutation, the reference wrong and the candidate right (a timeout never helps refute)."""
    ref, got, failed = [], [], 0
    for key in order:
        r, t = reference.get(key), trial.get(key)
        if r is None or t is None:
            break
        ref.append(0.0 if r.failed else score_of(r))
        got.append(1.0 if t.failed else score_of(t))
        failed += bool(r.failed or t.failed)
    return ref, got, failed


def confirmation_pairs(order: Sequence[str], reference: dict[str, Record], trial: dict[str, Record],
                       futility: tuple[float, float] | None = None) -> tuple[list[float], list[float], dict[str, int]]:
    """(reference scores, candidate scores, counts) of :func:`confirmation_rows`: what the certificate is
    decided on."""
    rows, counts = confirmation_rows(order, reference, trial, futility)
    return [r["reference_score"] for r in rows], [r["candidate_score"] for r in rows], counts


def write_evidence(path: Path, rows: list[dict[str, Any]]) -> None:
    """The per-item paired outcomes as CSV (via a temporary file): anyone can recompute the certificate."""
    import csv
    import io

    buf = io.StringIO()
    fields = ["item_id", "reference_score", "candidate_score", "reference", "candidate", "divergence",
              "candidate_made", "reference_answer", "candidate_answer", "reference_reason", "candidate_reason"]
    writer = csv.DictWriter(buf, fieldnames=fields, lineterminator="\n", extrasaction="ignore")
    writer.writeheader()
    writer.writerows({**dict.fromkeys(fields, ""), **r, "divergence": "" if r["divergence"] is None else r["divergence"]}
                     for r in rows)
    write_text(path, buf.getvalue())
