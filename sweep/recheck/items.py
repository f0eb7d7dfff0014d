"""The item and record checks of ``python -m jobs.results check``: ``pool`` (the evidence's items are the pool's
front by the ledger), ``disjoint`` (apart from the search), ``ledger`` (the attempt in the shipped history),
``chosen`` (the chosen files are certification.json's entries) and, once per folder, ``frontier``."""

from __future__ import annotations

import json
import math
import re
from typing import Any

from sweep.recheck.folder import FAILED, NOT_CHECKED, OK, Finding, Folder, close, pct


def _step_ids(f: Folder, c: dict[str, Any]) -> dict[str, list[str]]:
    out = {}
    for s in c.get("steps") or ():
        ev = f.evidence(s["candidate"])
        if ev is not None:
            out[s["candidate"]] = ev.ids
    return out


def check_pool(f: Folder, budget: float, c: dict[str, Any]) -> tuple[Finding, bool | None]:
    """The evidence's items, and the attempt's, are the pool's front in its fixed order less what the ledger says
    earlier attempts used or searched on."""
    if f.args is None or f.search_ids is None:
        return Finding("pool", NOT_CHECKED, "no sweep.json / search_items.txt: the pool is unknown", budget), None
    aid, attempt = f.attempt_of(c)
    if attempt is None:
        return Finding("pool", NOT_CHECKED, f"attempt {aid or '(none named)'} is not in the ledger history "
                       f"{f.history}, so the earlier attempts' items are unknown (see the ledger check)", budget), None
    earlier = f.earlier(aid)
    used = {i for a in earlier for i in a["used"]}
    searched = {i for a in earlier for i in a.get("search_items", ())}
    pool = f.pool()
    front = [i for i in pool if i not in used and i not in searched]
    problems = []
    for key, ids in _step_ids(f, c).items():
        if ids != front[: len(ids)]:
            at = next((k for k, (a, b) in enumerate(zip(ids, front, strict=False)) if a != b), min(len(ids), len(front)))
            problems.append(f"{key}'s items are NOT the pool front in its fixed order (item {at + 1}: "
                            f"{ids[at] if at < len(ids) else '—'}, the front's {front[at] if at < len(front) else '—'})")
    items = list(attempt.get("items", ()))
    if items != front[: len(items)]:
        problems.append(f"attempt {aid}'s {len(items)} items in the ledger are NOT the pool front in its fixed order")
    skipped = []
    if items:
        where = {i: k for k, i in enumerate(pool)}
        last = max((where[i] for i in items if i in where), default=-1)
        mine = set(items)
        skipped = [i for i in pool[: last + 1] if i not in mine]
    stated = (f.cert.get("pool") or {}).get("skipped")
    if stated is not None and list(stated) != skipped:
        problems.append(f"certification.json's pool.skipped ({len(stated)} items) is not what the ledger gives "
                        f"({len(skipped)} items the attempts before {aid} used or searched on)")
    if problems:
        return Finding("pool", FAILED, "items " + "; ".join(problems), budget), False
    names = ", ".join(a["attempt"] for a in earlier) or "none"
    return Finding("pool", OK, f"items are the pool front in its fixed order: the first of the pool without the "
                   f"{len(skipped)} items before them that the {len(earlier)} earlier attempt(s) in the ledger history "
                   f"({names}) used or searched on", budget), True


def check_disjoint(f: Folder, budget: float, c: dict[str, Any]) -> tuple[Finding, bool | None]:
    if f.search_ids is None:
        return Finding("disjoint", NOT_CHECKED, "no search_items.txt", budget), None
    searched = set(f.search_ids)
    problems = []
    for key, ids in _step_ids(f, c).items():
        shared = [i for i in ids if i in searched]
        if shared:
            problems.append(f"{key}: {len(shared)} item(s) SHARED WITH THE SEARCH (e.g. {shared[0]})")
    sample = "search_items.txt not compared with the sweep's search sample (no sweep.json)"
    if f.args is not None and f.args.get("items") is not None:
        again = f.search_sample()
        if again != f.search_ids:
            problems.append(f"search_items.txt ({len(f.search_ids)} ids) is not the sweep's search sample "
                            f"({len(again)} ids from --items {f.args['items']}, --subset-seed {f.args.get('subset_seed')})")
        sample = f"search_items.txt is the sweep's search sample ({len(again)} items)"
    if problems:
        return Finding("disjoint", FAILED, "; ".join(problems), budget), False
    return Finding("disjoint", OK, f"disjoint from the search; {sample}", budget), True


def check_ledger(f: Folder, budget: float, choice: dict[str, Any]) -> Finding:
    """The certificate's attempt in the shipped ledger history: opened for this benchmark and pair on the evidence's
    items, and decided at this budget with the same verdict."""
    c = choice["certification"]
    aid, attempt = f.attempt_of(c)
    if attempt is None:
        named = f"attempt {aid}" if aid else f"no attempt (the certificate names none and no study names {f.folder.name})"
        return Finding("ledger", FAILED, f"{named} is not in the ledger history {f.history}: a committed result must "
                       "stand on an attempt the history holds", budget)
    problems = []
    bench = choice.get("benchmark")
    if bench is not None and attempt.get("benchmark") != bench:
        problems.append(f"attempt {aid} is on benchmark {attempt.get('benchmark')}, the certificate on {bench}")
    fp = choice.get("pair_fingerprint")
    if fp is not None and attempt.get("pair_id") != fp:
        problems.append(f"attempt {aid} is on pair {attempt.get('pair_id')}, the certificate on {fp}")
    for name in ("pair", "dtype"):
        if choice.get(name) is not None and attempt.get(name) is not None and attempt[name] != choice[name]:
            problems.append(f"attempt {aid}'s {name} is {attempt[name]}, the certificate's {choice[name]}")
    study = choice.get("sweep")
    if study and attempt.get("study") and str(attempt["study"]).split(" ")[0] != study:
        problems.append(f"attempt {aid} is study {attempt['study']}, the certificate's {study}")
    items = list(attempt.get("items", ()))
    for key, ids in _step_ids(f, c).items():
        if ids != items[: len(ids)]:
            problems.append(f"{key}'s {len(ids)} items are not the first items of attempt {aid} in order")
    if c.get("confirm_items") is not None and len(items) != int(c["confirm_items"]):
        problems.append(f"attempt {aid} opened on {len(items)} items, the certificate confirms on {c['confirm_items']}")
    if f.search_ids is not None and attempt.get("search_items") is not None and \
            list(attempt["search_items"]) != f.search_ids:
        problems.append(f"attempt {aid}'s search items are not search_items.txt")
    stated = [m.group(1) for t in c.get("earlier_attempts") or () for m in [re.match(r"attempt (\S+) ", t)] if m]
    if c.get("earlier_attempts") is not None and attempt.get("earlier") is not None and stated != attempt["earlier"]:
        problems.append(f"the certificate lists earlier attempts {stated}, the ledger {attempt['earlier']}")
    number, theirs = (c.get("family") or {}).get("number"), (attempt.get("family") or {}).get("number")
    if number is not None and theirs is not None and number != theirs:
        problems.append(f"the certificate is attempt #{number} of its family, the ledger says #{theirs}")
    decided = attempt["decided"].get(str(float(budget)))
    if decided is None:
        problems.append(f"attempt {aid} has no decided row at budget {pct(budget)}")
    elif bool(decided.get("certified")) != bool(choice.get("certified")):
        problems.append(f"attempt {aid}'s decided row at {pct(budget)} says certified {decided.get('certified')}, "
                        f"the certificate {choice.get('certified')}")
    if problems:
        return Finding("ledger", FAILED, "; ".join(problems), budget)
    how = " (reconstructed rows)" if attempt.get("reconstructed") else ""
    return Finding("ledger", OK, f"attempt {aid}{how} is in the ledger history: opened for {attempt.get('benchmark')} "
                   f"and {attempt.get('pair_id')} on {len(items)} items that start with the evidence's, decided "
                   f"certified {bool(decided.get('certified'))} at {pct(budget)}"
                   + ("" if fp is not None else " (the certificate records no pair fingerprint: pair and dtype compared)"),
                   budget)


def check_chosen(f: Folder, key: str, budget: float, choice: dict[str, Any]) -> Finding:
    """``chosen-budget-<b>.json`` (what Serve and the exported rule read) is certification.json's entry for it."""
    mine = f.chosen_file(key)
    if mine is None:
        return Finding("chosen", NOT_CHECKED, f"no chosen-budget-{key}.json", budget)
    if json.dumps(mine, sort_keys=True) == json.dumps(choice, sort_keys=True):
        return Finding("chosen", OK, f"chosen-budget-{key}.json is certification.json's entry for {pct(budget)}", budget)
    differ = sorted(k for k in set(mine) | set(choice)
                    if json.dumps(mine.get(k), sort_keys=True) != json.dumps(choice.get(k), sort_keys=True))
    return Finding("chosen", FAILED, f"chosen-budget-{key}.json differs from certification.json's entry in "
                   f"{', '.join(differ)}", budget)


def frontier_problem(data: dict[str, Any]) -> str | None:
    """Why a frontier (``frontier.json``) cannot stand, or None: an empty lossless table, or no best lossless (every
    speed "over the best lossless" would then be over nothing measured)."""
    if not data.get("lossless"):
        return "its lossless table is empty: no speed over the best lossless was measured"
    best = (data.get("best_lossless") or {}).get("tokens_per_cost")
    if best is None or not math.isfinite(float(best)):
        return "it has no best lossless (tokens per cost NaN)"
    return None


def check_frontier(f: Folder) -> Finding:
    from workers.metrics.frontier import budget_rows

    if f.frontier is None:
        return Finding("frontier", NOT_CHECKED, "no frontier.json")
    why = frontier_problem(f.frontier)
    if why:
        return Finding("frontier", FAILED, f"frontier.json: {why}")
    problems = []
    mine = {round(float(r["budget"]), 9): r for r in budget_rows(f.cert["budgets"])}
    for r in f.frontier.get("budgets") or ():
        m = mine.get(round(float(r["budget"]), 9))
        if m is None:
            problems.append(f"frontier.json has budget {pct(float(r['budget']))}, which certification.json does not")
            continue
        wrong = [k for k in ("certified", "n", "lost", "won", "p_value") if k in r and not close(r[k], m[k])]
        if wrong:
            problems.append(f"frontier.json's {pct(float(r['budget']))} row differs from the certificate in {', '.join(wrong)}")
    if problems:
        return Finding("frontier", FAILED, "; ".join(problems))
    best = f.frontier["best_lossless"]
    return Finding("frontier", OK, f"{len(f.frontier['lossless'])} lossless rows, the best at L {best.get('draft_len')}; "
                   "its budget rows agree with the certificates")
