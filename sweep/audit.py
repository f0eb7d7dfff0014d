"""The replay audit of a confirmation: full decodes of a candidate's replayed confirmation records against the records
the certificate reads (:func:`audit_replayed`), and whether a certificate may stand on what was audited
(:func:`audit_withholds`, :func:`audit_pending`). Called by :mod:`sweep.confirm` before the ledger hears a budget's
decision.

Replay's misses are one-sided: a pass that wrongly keeps a round on the target-only output y is never decoded again,
so its record *is* y, scored as the reference was: a loss it hides shows as a tie. That eases certification, never
the reverse, so a certificate never stands on an unaudited or contradicted replay, and the audit of a certificate
has a stated power (:func:`audit_plan`):

- **risk-chosen**: every replayed record, among the items the certificate's look used, whose replay shows a
  divergence (``Record.replay`` other than ``exact`` in some turn: diverged, near-tie, past the pass, look-ahead, or
  an output that differs from the reference's). A record keeps no per-round margin of the rule's statistic (nor
  the pass's near-tie count, ``workers.replay.Forced.near_ties``), so "nearest the rule's boundary" cannot be read
  from it; divergence (with the pass's own near-ties, which replay already sends to live decoding) is the risk.
  These records' errors can go either way (the live part starts where replay said), so all of them are decoded.
- **drawn at random**: of the N other replayed records that could hide a loss (replayed ``exact``: the reference's
  output, both scored right), a uniform sample without replacement of the smallest size s whose chance of
  catching at least one of m errors is at least :data:`POWER`, where m is the fewest hidden losses that would
  overturn the certificate at the look and level it certified at (:func:`overturn_count`). Wherever m errors sit
  among the N, a uniform sample of s misses them all with probability C(N - m, s) / C(N, s) (hypergeometric,
  :func:`catch_probability`). The draw is made after the records are fixed: the order is sha256(seed + "/" + item
  id), the seed a sha256 of the evidence rows the certificate is decided on (:func:`records_hash`), so anyone can
  recompute it from the evidence CSV (:func:`audit_matches`) and nobody chooses it.

Only the random part carries the guarantee: a set of errors placed adversarially (a fault confined to a path the
risk rule does not see) can avoid every risk-chosen record, but not a uniform draw it cannot predict.

A budget that is not certified needs no audit for its guarantee (replay's errors only move the candidate toward the
reference, i.e. toward certifying: a refusal made on replayed records stands a fortiori), and keeps the cheap audit:
the first ``max(AUDIT_MIN, AUDIT_SHARE x used)`` replayed records in confirmation order, a check of replay, not a
bound."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from sweep.progress import log
from sweep.search import spec_of

if TYPE_CHECKING:
    from sweep.state import SweepState
    from workers.benchmarks.base import Item
    from workers.certify.decide import DropBound
    from workers.certify.sequential import LookPlan
    from workers.evaluation import Record


AUDIT_MIN = 30  # uncertified budgets: replayed confirmation records of a candidate decoded in full, at least
AUDIT_SHARE = 0.1  # ... or this share of the items its decision used, whichever is more
POWER = 0.95  # a certificate's audit catches at least one of the hidden losses that would overturn it this often
HASH_VERSION = "spectune replay audit 1"  # what the seed hashes (bump with records_hash's canonical form)
DRAW = "the N records by sha256(seed + '/' + item id), ascending; the first s"


# --- what the evidence rows say (in memory: workers.results.evidence.confirmation_rows; or read back from its CSV)


def _score(value: Any) -> float:
    return float(value) if value not in (None, "") else math.nan


def _divergence(value: Any) -> str:
    return "" if value in (None, "") else str(int(float(value)))


def replayed(row: Mapping[str, Any]) -> bool:
    """An ok candidate record made by replay (``workers.results.evidence.made_by``: ``replayed: <how>``)."""
    return row.get("candidate") == "ok" and str(row.get("candidate_made") or "").startswith("replayed")


def at_risk(row: Mapping[str, Any]) -> bool:
    """A replayed record whose replay shows a divergence: some turn not ``exact`` (decoded live from where replay
    said: diverged, near-tie, past the pass, look-ahead), or an output that differs from the reference's."""
    if not replayed(row):
        return False
    how = str(row["candidate_made"]).split(":", 1)[1].strip()
    return any(part.strip() != "exact" for part in how.split(";")) or _divergence(row.get("divergence")) not in ("", "-1")


def could_hide_loss(row: Mapping[str, Any]) -> bool:
    """A replayed record, not at risk, that ties a reference that scored (right): the reference's own output, which a
    one-sided replay error could have made of a loss. The others cannot hide one (a tie on a wrong reference could
    only hide a win)."""
    ref, cand = _score(row.get("reference_score")), _score(row.get("candidate_score"))
    return replayed(row) and not at_risk(row) and ref > 0 and cand == ref


def records_hash(rows: Sequence[Mapping[str, Any]]) -> str:
    """sha256 of the evidence rows a certificate is decided on, in their order: item, both scores, both statuses, the
    first diverging token, how the candidate record was made and both extracted answers (what the evidence CSV
    holds, read back the same). The audit's seed: fixed by the records, chosen by nobody."""
    h = hashlib.sha256(HASH_VERSION.encode())
    for r in rows:
        fields = (str(r.get("item_id", "")), repr(_score(r.get("reference_score"))), repr(_score(r.get("candidate_score"))),
                  str(r.get("reference") or ""), str(r.get("candidate") or ""), _divergence(r.get("divergence")),
                  str(r.get("candidate_made") or ""), str(r.get("reference_answer") or ""),
                  str(r.get("candidate_answer") or ""))
        h.update(("\n" + "\t".join(f.replace("\t", " ").replace("\n", " ") for f in fields)).encode())
    return h.hexdigest()


def draw(ids: Sequence[str], seed: str, size: int) -> list[str]:
    """A uniform sample of ``size`` of ``ids`` without replacement: the first ``size`` by sha256(seed/id)
    (:data:`DRAW`), the same on every machine and in every language."""
    def key(i: str) -> str:
        return hashlib.sha256(f"{seed}/{i}".encode()).hexdigest()

    return sorted(ids, key=key)[:max(0, size)]


# --- the power of a uniform sample


def catch_probability(n: int, m: int | None, s: int) -> float:
    """The chance that a uniform sample of ``s`` of ``n`` records without replacement holds at least one of ``m``
    given records (wherever they are): 1 - C(n - m, s) / C(n, s), exact. ``m`` None (no number of errors among the
    n overturns the decision): 1."""
    if m is None:
        return 1.0
    if not 0 <= s <= n or not 0 <= m <= n:
        raise ValueError(f"need 0 <= s, m <= n, got n={n}, m={m}, s={s}")
    if m == 0:
        return 0.0
    return 1.0 - math.comb(n - m, s) / math.comb(n, s)  # exact integers; comb is 0 where s > n - m


def sample_size(n: int, m: int | None, power: float = POWER) -> int:
    """The smallest s with :func:`catch_probability` (n, m, s) >= ``power`` (n itself when none is: m = 0)."""
    if m is None:
        return 0
    return next((s for s in range(n + 1) if catch_probability(n, m, s) >= power), n)


def overturn_count(reference: Sequence[float], candidate: Sequence[float], plan: LookPlan, budget: float,
                   pool: Sequence[int]) -> int | None:
    """The fewest records of ``pool`` (indices of ties a replay error could have made of a loss) whose flip to a loss
    (the candidate's score to 0) makes ``workers.certify.decide.sequential_bound`` on these items, with the
    certificate's ``plan``, certify nothing; None where flipping all of them still certifies (no set of errors among
    them overturns it). Searched upward (1, 2, 4, ... then halving the last step): a loss more never helps the test
    (Tango's Z_b grows with the losses at every look), so the first count that fails is where the search lands; the
    counts are what the test reads, so which records are flipped does not matter at the deciding look (the earlier
    looks, which did not certify, only see more losses)."""
    from workers.certify.decide import certifies, sequential_bound

    seen: dict[int, bool] = {}

    def overturned(j: int) -> bool:
        if j not in seen:
            flipped = list(candidate)
            for i in pool[len(pool) - j:] if j else ():
                flipped[i] = 0.0
            seen[j] = not certifies(sequential_bound(reference, flipped, plan, budget))
        return seen[j]

    if overturned(0):
        return 0
    lo, hi = 0, 1
    while True:
        hi = min(hi, len(pool))
        if overturned(hi):
            break
        if hi == len(pool):
            return None
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if overturned(mid) else (mid, hi)
    return hi


def audit_plan(rows: Sequence[Mapping[str, Any]], plan: LookPlan, budget: float, power: float = POWER) -> dict[str, Any]:
    """What a certificate's replay audit owes, from its evidence rows alone (the candidate's, in the confirmation
    order: ``confirmation_rows`` in memory, or its evidence CSV read back), its ``plan`` and ``budget``: the decision
    again (``sequential_bound``; a ValueError where it does not certify), the items its deciding look used, and on
    those: the risk-chosen records (:func:`at_risk`), the N that could hide a loss (:func:`could_hide_loss`), m
    (:func:`overturn_count`; None: no set of errors among the N overturns it), s (:func:`sample_size`), the seed
    (:func:`records_hash` of those rows) and the drawn ids (:func:`draw`). JSON-safe."""
    from workers.certify.decide import certifies, sequential_bound

    ref = [_score(r["reference_score"]) for r in rows]
    cand = [_score(r["candidate_score"]) for r in rows]
    bound = sequential_bound(ref, cand, plan, budget)
    if not certifies(bound):
        raise ValueError(f"these evidence rows do not certify budget {budget:g}: a refusal needs no powered audit")
    used = list(rows[: bound.n])
    risk = [str(r["item_id"]) for r in used if at_risk(r)]
    pool = [i for i, r in enumerate(used) if could_hide_loss(r)]
    m = overturn_count(ref[: bound.n], cand[: bound.n], plan, budget, pool)
    n, s = len(pool), sample_size(len(pool), m, power)
    seed = records_hash(used)
    sample = draw([str(used[i]["item_id"]) for i in pool], seed, s)
    return {"budget": float(budget), "look": bound.look, "looks": bound.looks, "n": bound.n, "lost": bound.losses,
            "won": bound.wins, "overturn": m, "eligible": n, "risk": len(risk), "risk_ids": risk, "sample": s,
            "sample_ids": sample, "power": catch_probability(n, m, s), "target": power, "seed": seed, "draw": DRAW}


PLANNED = ("budget", "look", "n", "overturn", "eligible", "risk", "risk_ids", "sample", "sample_ids", "seed")


def audit_matches(stated: Mapping[str, Any], rows: Sequence[Mapping[str, Any]], plan: LookPlan, budget: float) -> bool:
    """Whether a certificate's stated audit (its ``replay_check["audit"]``) is the one its evidence gives
    (:func:`audit_plan` again: the same look, m, N, risk-chosen and drawn ids and seed), and was carried out (every
    one of those ids decoded, at the power it states). For ``python -m jobs.results check``."""
    again = audit_plan(rows, plan, budget, float(stated.get("target", POWER)))
    return (all(stated.get(k) == again[k] for k in PLANNED) and stated.get("audited") == again["risk"] + again["sample"]
            and float(stated.get("achieved", 0.0)) >= again["target"])


# --- running it


def _decode(state: SweepState, row: dict[str, Any], todo: list[Item], reference: dict[str, Record]) -> list[Record] | None:
    """The candidate of trial ``row`` decoded in full on ``todo`` (None: the audit was lost: no actor left)."""
    from cluster.pair_actor import run_trial

    s = state.settings
    spec = spec_of(s, row)
    try:
        run = run_trial(state.workers, f"audit-{spec.key()}", s.bench.ref, spec, todo,
                        {k: r.outputs for k, r in reference.items()}, shard_size=state.refs.shard_size(todo))
    except Exception as err:  # noqa: BLE001 - a lost audit is reported; audit_withholds counts what it owed
        first = (str(err).splitlines() or [""])[0][:160]
        log(f"replay audit: lost ({type(err).__name__}: {first})")
        return None
    return [run.records[it.id] for it in todo if it.id in run.records]


def audit_replayed(state: SweepState, items: list[Item], row: dict[str, Any], records: dict[str, Record],
                   reference: dict[str, Record], used: int, check: dict[str, Any], *, bound: DropBound | None = None,
                   plan: LookPlan | None = None, rows: Sequence[Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """The replay audit beyond the timed items (``check``, :func:`workers.metrics.speed.replay_check`): the candidate
    of trial ``row`` decoded in full on some of its replayed confirmation records, each compared token for token and
    count for count with the record the certificate reads. Returns a new check (``check`` is left as it was).

    A certified budget (``bound``: the chosen candidate's certifying bound, ``plan`` its looks, ``rows`` its evidence
    rows): the audit of :func:`audit_plan`, stated under ``"audit"`` (m, N, s, the risk-chosen count, the power, the
    seed, the ids it owes, how many of them were decoded and the power achieved). Without ``bound`` (a budget not
    certified: its refusal needs no audit, since replay's errors only ease certifying): the cheap audit, the first
    ``max(AUDIT_MIN, AUDIT_SHARE x used)`` replayed records in the confirmation order (``items``, fixed before any
    outcome). Records decoded in full need none; records the timed run (or an earlier audit) decoded are not decoded
    again. An audit that cannot run (no actor left) adds nothing: :func:`audit_withholds` then decides on what was
    audited."""
    from workers.metrics.speed import audit_against, settle

    check = {"items": 0, "replayed": 0, "replayed_differ": [], "full_differ": [], "candidate_items": [], **check}
    check["candidate_items"] = list(check["candidate_items"])
    check.pop("audit", None)  # another budget's statement: this one makes its own, or none
    done = {k for k in check["candidate_items"] if k in records and not records[k].timed}  # replayed ones only
    if bound is None:
        replayed_ = [it for it in items[:used] if it.id in records and not records[it.id].timed]
        want = max(AUDIT_MIN, math.ceil(AUDIT_SHARE * used))
        todo = [it for it in replayed_ if it.id not in done][:max(0, want - len(done))]
        # what the audit owes: this many of the candidate's replayed records decoded in full (all, where fewer)
        check["audit_wanted"], check["audit_done"], check["extra_items"] = min(want, len(replayed_)), len(done), 0
        if not todo:
            return check
        log(f"replay audit: decoding {len(todo)} more of {spec_of(state.settings, row).label()}'s replayed "
            f"confirmation records in full ({len(done)} audited by the timed run; {check['audit_wanted']} in all)")
        decoded = _decode(state, row, todo, reference)
        if decoded is None:
            return check
        audit_against(check, decoded, records, "candidate")
        check["extra_items"] = len(decoded)
        check["audit_done"] = len(done) + len(decoded)
        return settle(check)
    if plan is None or rows is None:
        raise ValueError("a certified budget's audit needs its look plan and its evidence rows")
    owed_plan = audit_plan(rows, plan, bound.budget)
    owed = owed_plan["risk_ids"] + owed_plan["sample_ids"]
    by_id = {it.id: it for it in items}
    todo = [by_id[k] for k in owed if k not in done and k in by_id and k in records]
    m = owed_plan["overturn"]
    log(f"replay audit of the {bound.budget * 100:g}% certificate ({owed_plan['lost']} lost / {owed_plan['won']} won "
        f"of {owed_plan['n']} at look {owed_plan['look']} of {owed_plan['looks']}): "
        + (f"{m} hidden losses would overturn it; " if m is not None else
           "no set of hidden losses among its replayed ties overturns it; ")
        + f"{owed_plan['risk']} risk-chosen (diverged) and {owed_plan['sample']} of {owed_plan['eligible']} ties "
        f"drawn at random (power {owed_plan['power']:.3f}); {len(todo)} to decode in full")
    check["extra_items"] = 0
    if todo:
        decoded = _decode(state, row, todo, reference)
        if decoded is not None:
            audit_against(check, decoded, records, "candidate")
            check["extra_items"] = len(decoded)
    audited = set(check["candidate_items"])
    risk_done = all(k in audited for k in owed_plan["risk_ids"])
    drawn_done = sum(k in audited for k in owed_plan["sample_ids"])
    achieved = catch_probability(owed_plan["eligible"], m, drawn_done) if risk_done else 0.0
    check["audit"] = {**owed_plan, "audited": sum(k in audited for k in owed), "achieved": achieved}
    check["audit_wanted"], check["audit_done"] = len(owed), check["audit"]["audited"]
    return settle(check)


def audit_withholds(check: dict[str, Any], records: dict[str, Any]) -> str | None:
    """Why a certificate must not stand on its replay audit (``workers.metrics.speed.replay_check`` of the timed
    items, and :func:`audit_replayed`'s), or None: a replayed confirmation record that differs from its full decode
    (replay was not exact on this machine); replayed records made by the eager kernels in this run; a certificate's
    audit (``check["audit"]``) not carried out in full, or short of :data:`POWER`; or, without one, replayed records
    that no full decode audited (nothing timed: ``--speed-items 0``, or the timing was lost). Replay's errors are
    one-sided (a pass that wrongly keeps a round on the target-only output is never decoded again, and moves the
    candidate toward the reference), so an unaudited replay is no evidence."""
    if check.get("replayed_differ"):
        return (f"not certified: a replayed confirmation record differs from its full decode "
                f"({', '.join(check['replayed_differ'][:4])}): replay was not exact on this machine, so the evidence "
                "is not full decoding's; rerun with --replay off")
    replayed_ = sum(not getattr(r, "timed", True) for r in records.values())
    eager = sorted(k for k, r in records.items() if not getattr(r, "timed", True) and getattr(r, "fused_off", ""))
    if eager:  # made in this run (a resume would have made them again: sweep.references.held)
        return (f"not certified: {len(eager)} of its replayed confirmation records (e.g. {eager[0]}) were decided by "
                "the eager kernels after the fused ones failed in their process, not in full decoding's arithmetic; "
                "rerun to make them again, or use --replay off")
    owed, done = check.get("audit_wanted"), check.get("audit_done", 0)
    audit = check.get("audit")
    if audit is not None:
        if done < owed:
            return (f"not certified: the replay audit decoded {done} of the {owed} replayed confirmation records it "
                    f"owes in full ({audit['risk']} risk-chosen, {audit['sample']} drawn at random; the audit was lost "
                    "part-way); rerun to finish it, or use --replay off")
        if audit["achieved"] < audit["target"]:
            return (f"not certified: the replay audit's chance of catching the {audit['overturn']} hidden losses that "
                    f"would overturn it is {audit['achieved']:.3f}, under {audit['target']:g}; rerun to finish it, "
                    "or use --replay off")
        return None
    if replayed_ and owed is not None and done < owed:
        return (f"not certified: the replay audit decoded {done} of the {owed} replayed confirmation records it owes "
                "in full (the audit was lost part-way); rerun to finish it, or use --replay off")
    if replayed_ and not check.get("items"):
        return (f"not certified: {replayed_} of its confirmation records were replayed and no full decode audited "
                "them (nothing timed: --speed-items 0, or the timing was lost); rerun with --speed-items N > 0, or "
                "--replay off")
    return None


def audit_pending(check: dict[str, Any], records: dict[str, Any]) -> bool:
    """Whether :func:`audit_withholds` withholds only for want of audit (lost part-way, short of its power, or nothing
    audited), with no full decode contradicting a replayed record: then the budget's decision waits for the audit
    (the ledger is not told, so a rerun of the same attempt, on the same records, finishes it) instead of being fixed
    as refused."""
    if check.get("replayed_differ") or audit_withholds(check, records) is None:
        return False
    return True
