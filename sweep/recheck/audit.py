"""The ``audit`` check of ``python -m jobs.results check``: the shown candidate's replay audit against the evidence
and ``sweep.audit``'s rules."""

from __future__ import annotations

import math
from typing import Any

from sweep.recheck.folder import FAILED, NOT_CHECKED, OK, Finding, Folder

_AUDIT_FIELDS = {"items", "replayed", "replayed_differ", "full_differ", "candidate_items", "status", "identical",
                 "audit_wanted", "audit_done", "extra_items", "audit"}


class _Made:
    """A stand-in for a candidate record as the replay audit reads it: replayed or decoded in full."""

    def __init__(self, replayed: bool) -> None:
        self.timed, self.fused_off = not replayed, ""


def check_audit(f: Folder, budget: float, choice: dict[str, Any], replay_check: dict[str, Any] | None,
           plan: Any) -> Finding:
    """The replay audit of the candidate the certificate shows, against the evidence and ``sweep.audit``'s rules: a
    certificate's powered audit (``replay_check["audit"]``: ``audit_plan`` / ``audit_matches`` again from the
    evidence at the budget's ``plan``), else the cheap audit (``AUDIT_MIN``, ``AUDIT_SHARE``: a refusal's, and a
    certificate's made before the powered one); a certified budget must be one ``audit_withholds`` lets stand."""
    from sweep import audit as rules
    from workers.metrics.speed import settle

    c = choice["certification"]
    certified = bool(choice.get("certified"))
    shown = c.get("candidate") or (c.get("evidence") or "").rsplit("/", 1)[-1].removesuffix(".csv") or None
    ev = f.evidence(shown) if shown else None
    if shown is None or ev is None:
        return Finding("audit", NOT_CHECKED, "no candidate, or no evidence for it", budget)
    used = len(ev.ids)
    if ev.made is not None:  # which of its records were replayed, from the evidence itself
        made = [m.startswith("replayed") for m in ev.made]
        replayed_n, source = sum(made), "the evidence's candidate_made"
        records = {i: _Made(r) for i, r, m in zip(ev.ids, made, ev.made, strict=True) if m}  # rows it kept
        if c.get("candidate_replayed") is not None and int(c["candidate_replayed"]) > replayed_n:
            return Finding("audit", FAILED, f"the certificate counts {c['candidate_replayed']} replayed records, the "
                           f"evidence says {replayed_n} were", budget)
    elif c.get("candidate_replayed") is not None:
        replayed_n, source = int(c["candidate_replayed"]), "the certificate's candidate_replayed"
        records = {f"#{k}": _Made(k < replayed_n) for k in range(used)}
    else:
        replayed_n, source, records = None, "", {}
    check = replay_check
    if not check:
        if replayed_n is None:
            why = ("made before replay" if f.args is not None and "replay" not in f.args else
                   "the folder does not say which records were replayed")
            return Finding("audit", NOT_CHECKED, f"no replay audit recorded and {why}"
                           + ("" if certified else "; not certified, so nothing rests on it"), budget)
        if replayed_n == 0:
            return Finding("audit", OK, f"no record of {shown} was replayed ({source}): nothing to audit", budget)
        withheld = rules.audit_withholds({}, records)
        if certified and withheld:
            return Finding("audit", FAILED, f"certified, but {withheld}", budget)
        return Finding("audit", OK, f"{replayed_n} of {shown}'s records replayed ({source}) and no replay audit "
                       "recorded; " + ("not certified, so nothing rests on it" if not certified else
                                       "the audit rule withholds nothing"), budget)
    problems = []
    items, replayed = int(check.get("items", 0)), int(check.get("replayed", 0))
    rdiff, fdiff = list(check.get("replayed_differ", ())), list(check.get("full_differ", ()))
    cand_items = list(check.get("candidate_items", ()))
    if not (0 <= replayed <= items and len(rdiff) <= replayed and len(fdiff) <= items - replayed):
        problems.append(f"its counts do not add up (items {items}, replayed {replayed}, replayed_differ {len(rdiff)}, "
                        f"full_differ {len(fdiff)})")
    if len(cand_items) > items or len(set(cand_items)) != len(cand_items):
        problems.append(f"candidate_items ({len(cand_items)}) are more than its items ({items}) or repeat")
    outside = [i for i in cand_items if i not in set(ev.ids)]
    if outside:
        problems.append(f"{len(outside)} audited item(s) are not among {shown}'s confirmation items (e.g. {outside[0]})")
    if "status" in check:
        again = settle({"items": items, "replayed_differ": rdiff, "full_differ": fdiff})
        if check["status"] != again["status"] or ("identical" in check and check["identical"] != again["identical"]):
            problems.append(f"its status {check['status']!r} is not what its counts give ({again['status']!r})")
    wanted, done = check.get("audit_wanted"), int(check.get("audit_done", 0))
    if int(check.get("extra_items", 0)) > max(done, len(cand_items)):
        problems.append(f"extra_items {check.get('extra_items')} is more than it audited")
    stated = check.get("audit")
    owed_text = ""
    if stated is not None:  # a certificate's audit, with its power (sweep.audit.audit_plan)
        owed = list(stated.get("risk_ids", ())) + list(stated.get("sample_ids", ()))
        try:
            again = rules.audit_plan(ev.rows, plan, budget, float(stated.get("target", rules.POWER)))
        except ValueError as err:
            again = None
            problems.append(f"its powered audit cannot be made again from the evidence: {err}")
        if again is not None:
            differ = [k for k in rules.PLANNED if stated.get(k) != again[k]]
            if differ:
                problems.append(f"its powered audit is not the one the evidence gives (differs in {', '.join(differ)}: "
                                + ", ".join(f"{k} {stated.get(k)!r} vs {again[k]!r}" for k in differ
                                            if k not in ("risk_ids", "sample_ids")) + ")")
            elif not rules.audit_matches(stated, ev.rows, plan, budget):
                problems.append(f"its powered audit was not carried out in full (audited {stated.get('audited')} of "
                                f"{again['risk'] + again['sample']}, power achieved {stated.get('achieved')} against "
                                f"{again['target']:g})")
        audited = sum(k in set(cand_items) for k in owed)
        if stated.get("audited") != audited or done != audited or wanted != len(owed):
            problems.append(f"it says {stated.get('audited')} audited (audit_done {done}) of {wanted} owed; its "
                            f"candidate_items hold {audited} of the {len(owed)} ids it owes")
        owed_text = (f"powered audit: {stated.get('risk')} risk-chosen and {stated.get('sample')} of "
                     f"{stated.get('eligible')} ties drawn (m {stated.get('overturn')}, seed from the evidence), power "
                     f"{float(stated.get('achieved', 0.0)):.3f} of a {float(stated.get('target', rules.POWER)):g} target, "
                     f"{audited} of {len(owed)} owed decoded")
    elif "audit_wanted" in check or "audit_done" in check:  # the cheap audit: a refusal's (and older certificates')
        if ev.made is not None:
            done_again = sum(1 for i in cand_items if i in records and not records[i].timed)
            if done != done_again:
                problems.append(f"audit_done {done}, but {done_again} of its audited items are replayed records")
        lo, share = getattr(rules, "AUDIT_MIN", None), getattr(rules, "AUDIT_SHARE", None)
        if lo is not None and share is not None:
            want = max(lo, math.ceil(share * used))
            owed_n = min(want, replayed_n) if replayed_n is not None else None
            if owed_n is not None and wanted != owed_n:
                problems.append(f"audit_wanted {wanted}, but sweep.audit owes min(max({lo}, ceil({share:g} x {used})), "
                                f"{replayed_n} replayed) = {owed_n}")
            elif owed_n is None and wanted is not None and wanted > want:
                problems.append(f"audit_wanted {wanted} is more than sweep.audit's max({lo}, ceil({share:g} x {used}))")
            if owed_n is not None and done < owed_n:
                problems.append(f"audited {done} of the {owed_n} replayed records owed")
            owed_text = (f"audited {done} of the {owed_n if owed_n is not None else wanted} owed"
                         + (" (the cheap audit's rule: no powered audit stated, made before it)" if certified else ""))
            if certified and (choice.get("certification") or {}).get("family"):
                problems.append("certified under the family (made after the powered audit existed) without a powered "
                                "audit (replay_check.audit): the cheap audit's rule does not apply to it")
    elif replayed_n:
        owed_text = "no audit_wanted / audit_done recorded (made before the audit was owed)"
    extra = sorted(set(check) - _AUDIT_FIELDS)
    new = f"; not recomputed here: {', '.join(f'{k}={check[k]}' for k in extra)}" if extra else ""
    if certified:
        withheld = rules.audit_withholds(check, records)
        if withheld:
            problems.append(f"certified, but {withheld}")
    if problems:
        return Finding("audit", FAILED, f"{shown}'s replay audit: {'; '.join(problems)}", budget)
    if rdiff and not certified:
        return Finding("audit", OK, f"{shown}'s replay audit found replayed records differing ({', '.join(rdiff[:3])}); "
                       "not certified", budget)
    return Finding("audit", OK, f"{shown}'s replay audit: {items} full decodes ({replayed} against replayed records), "
                   f"no replayed record differing{'; ' + owed_text if owed_text else ''}"
                   f"{f' ({replayed_n} of its {used} records replayed, by {source})' if replayed_n is not None else ''}"
                   + ("" if (f.args or {}).get("replay") != "off" else "; --replay off") + new, budget)
