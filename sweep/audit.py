"""The replay audit of a confirmation: full decodes of a candidate's replayed confirmation records against the records
the certificate reads (:func:`audit_replayed`), and whether a certificate may stand on what was audited
(:func:`audit_withholds`). Replay's misses are one-sided (a pass that wrongly keeps a round on the target-only output
is never decoded again, and moves the candidate toward the reference), so a certificate never stands on an unaudited
or contradicted replay. Called by :mod:`sweep.confirm` before the ledger hears a budget's decision."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from sweep.progress import log
from sweep.search import spec_of

if TYPE_CHECKING:
    from sweep.state import SweepState
    from workers.benchmarks.base import Item
    from workers.evaluation import Record


AUDIT_MIN = 30  # replayed confirmation records of a candidate decoded in full to audit them, at least
AUDIT_SHARE = 0.1  # ... or this share of the items its decision used, whichever is more


def audit_replayed(state: SweepState, items: list[Item], row: dict[str, Any], records: dict[str, Record],
                   reference: dict[str, Record], used: int, check: dict[str, Any]) -> dict[str, Any]:
    """The replay audit beyond the timed items: the candidate of trial ``row`` decoded in full on its replayed
    confirmation records, in the confirmation order (``items``, fixed before any outcome), until ``max(AUDIT_MIN, AUDIT_SHARE x
    used)`` of its records are audited with the timed ones (``check``, :func:`workers.metrics.speed.replay_check`),
    each compared token for token and count for count with the record the certificate reads. Replay's misses are
    one-sided (toward the reference), so the audit is aimed at the records replay made; records decoded in full
    need none. An audit that cannot run (no actor left) adds nothing: ``audit_withholds`` then decides on what was
    audited."""
    from cluster.pair_actor import run_trial
    from workers.metrics.speed import audit_against, settle

    check = {"items": 0, "replayed": 0, "replayed_differ": [], "full_differ": [], "candidate_items": [], **check}
    replayed = [it for it in items[:used] if it.id in records and not records[it.id].timed]
    done = {k for k in check["candidate_items"] if k in records and not records[k].timed}  # replayed ones only
    want = max(AUDIT_MIN, math.ceil(AUDIT_SHARE * used))
    todo = [it for it in replayed if it.id not in done][:max(0, want - len(done))]
    # what the audit owes: this many of the candidate's replayed records decoded in full (all, where fewer)
    check["audit_wanted"], check["audit_done"], check["extra_items"] = min(want, len(replayed)), len(done), 0
    if not todo:
        return check
    s = state.settings
    spec = spec_of(s, row)
    log(f"replay audit: decoding {len(todo)} more of {spec.label()}'s replayed confirmation records in full "
        f"({len(done)} audited by the timed run; {check['audit_wanted']} in all)")
    try:
        run = run_trial(state.workers, f"audit-{spec.key()}", s.bench.ref, spec, todo,
                        {k: r.outputs for k, r in reference.items()})
    except Exception as err:  # noqa: BLE001 - a lost audit is reported; audit_withholds counts what it owed
        first = (str(err).splitlines() or [""])[0][:160]
        log(f"replay audit: lost ({type(err).__name__}: {first})")
        return check
    decoded = [run.records[it.id] for it in todo if it.id in run.records]
    audit_against(check, decoded, records, "candidate")
    check["extra_items"] = len(decoded)
    check["audit_done"] = len(done) + len(decoded)
    return settle(check)


def audit_withholds(check: dict[str, Any], records: dict[str, Any]) -> str | None:
    """Why a certificate must not stand on its replay audit (``workers.metrics.speed.replay_check`` of the timed
    items), or None: a replayed confirmation record that differs from its full decode (replay was not exact on this
    machine), or replayed records that no full decode audited (nothing timed: ``--speed-items 0``, or the timing
    was lost). Replay's errors are one-sided (a pass that wrongly keeps a round on the target-only output is never
    decoded again, and moves the candidate toward the reference), so an unaudited replay is no evidence."""
    if check.get("replayed_differ"):
        return (f"not certified: a replayed confirmation record differs from its full decode "
                f"({', '.join(check['replayed_differ'][:4])}): replay was not exact on this machine, so the evidence "
                "is not full decoding's; rerun with --replay off")
    replayed = sum(not getattr(r, "timed", True) for r in records.values())
    eager = sorted(k for k, r in records.items() if not getattr(r, "timed", True) and getattr(r, "fused_off", ""))
    if eager:  # made in this run (a resume would have made them again: sweep.references.held)
        return (f"not certified: {len(eager)} of its replayed confirmation records (e.g. {eager[0]}) were decided by "
                "the eager kernels after the fused ones failed in their process, not in full decoding's arithmetic; "
                "rerun to make them again, or use --replay off")
    owed, done = check.get("audit_wanted"), check.get("audit_done", 0)
    if replayed and owed is not None and done < owed:
        return (f"not certified: the replay audit decoded {done} of the {owed} replayed confirmation records it owes "
                "in full (the audit was lost part-way); rerun to finish it, or use --replay off")
    if replayed and not check.get("items"):
        return (f"not certified: {replayed} of its confirmation records were replayed and no full decode audited "
                "them (nothing timed: --speed-items 0, or the timing was lost); rerun with --speed-items N > 0, or "
                "--replay off")
    return None


def audit_pending(check: dict[str, Any], records: dict[str, Any]) -> bool:
    """Whether :func:`audit_withholds` withholds only for want of audit (lost part-way, or nothing audited), with no
    full decode contradicting a replayed record: then the budget's decision waits for the audit (the ledger is not
    told, so a rerun of the same attempt, on the same records, finishes it) instead of being fixed as refused."""
    if check.get("replayed_differ") or audit_withholds(check, records) is None:
        return False
    return True
