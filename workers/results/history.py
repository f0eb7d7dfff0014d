"""The shipped history: every confirmation attempt behind a committed result, kept in the repository.

``known_attempts.jsonl`` (beside this file) holds the ledger rows (``opened``, ``decided``; see
:mod:`workers.results.ledger`) of every attempt a committed result stands on, and of the attempts made before the
ledger existed. Every ledger reads it, so a fresh clone never confirms on items a committed attempt used. Exporting
a result (``python -m jobs.results export``) writes its attempt's rows here (:func:`ship`); an attempt whose rows
were lost can be rebuilt from its exported folder (:func:`reconstruct`: the items and decisions the folder's
certification and evidence record, marked ``reconstructed``).

Knows ledger rows and exported result folders; nothing about models, Ray or MLflow.
"""

from __future__ import annotations

import csv
import json
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

KNOWN = Path(__file__).with_name("known_attempts.jsonl")
HISTORY_ENV = "SPECTUNE_HISTORY"  # another history file to write to (the tests': never the repository's)


def history_path() -> Path:
    """Where exported attempts are written: ``$SPECTUNE_HISTORY``, else the shipped ``known_attempts.jsonl``."""
    given = os.environ.get(HISTORY_ENV)
    return Path(given) if given else KNOWN


def read_rows(path: Path = KNOWN) -> list[dict[str, Any]]:
    """The history's rows in file order (a line that is not a JSON object is skipped)."""
    return parse_lines(path.read_text().splitlines()) if path.is_file() else []


def parse_lines(lines: Iterable[str]) -> list[dict[str, Any]]:
    """The JSON objects among ``lines`` (a line that is not one is skipped: a line torn by a crash)."""
    out = []
    for line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            out.append(row)
    return out


def _key(row: dict[str, Any]) -> str:
    return json.dumps(row, sort_keys=True)


def append_rows(rows: Iterable[dict[str, Any]], path: Path | None = None) -> int:
    """Add to the history the rows it does not hold yet (compared as whole rows); returns how many were added.
    Rows are never rewritten or removed: the history only grows. ``path``: default :func:`history_path`."""
    path = history_path() if path is None else path
    have = {_key(r) for r in read_rows(path)}
    new = []
    for row in rows:
        k = _key(row)
        if k not in have:
            have.add(k)
            new.append(row)
    if new:
        text = path.read_text() if path.is_file() else ""
        if text and not text.endswith("\n"):
            text += "\n"
        path.write_text(text + "".join(json.dumps(r) + "\n" for r in new))
    return len(new)


def attempt_rows(rows: Sequence[dict[str, Any]], attempt: str) -> list[dict[str, Any]]:
    """The rows of one attempt, in order."""
    return [r for r in rows if r.get("attempt") == attempt]


def _evidence_ids(path: Path) -> list[str]:
    with path.open() as f:
        return [r["item_id"] for r in csv.DictReader(f)]


def reconstruct(folder: Path) -> list[dict[str, Any]]:
    """The ledger rows of the attempt behind an exported result folder, rebuilt from what it records: the
    ``opened`` row (its items: the longest evidence file's items in order, every other evidence file being a
    prefix of it; the search items of ``search_items.txt``; the budgets, alphas, candidates in test order and
    looks of ``certification.json``; the earlier attempts it lists) and one ``decided`` row per budget (its
    decision and the items its candidates used). Each row says ``reconstructed``: what was not recorded (the
    plan's digest, the times) is not made up. A ValueError where the folder names no attempt or its evidence
    files disagree."""
    cert = json.loads((folder / "certification.json").read_text())
    budgets = sorted(cert["budgets"].values(), key=lambda c: float(c["budget"]))
    first = budgets[0]
    attempt = first["certification"].get("attempt")
    if not attempt:
        raise ValueError(f"{folder}: its certificates name no ledger attempt (made before the ledger)")
    evidence = sorted({s for c in budgets for s in [c["certification"].get("evidence")] if s}
                      | {f"evidence/{st['candidate']}.csv" for c in budgets for st in c["certification"].get("steps", ())})
    lists = [_evidence_ids(folder / e) for e in evidence if (folder / e).is_file()]
    if not lists:
        raise ValueError(f"{folder}: no evidence file to take the attempt's items from")
    items = max(lists, key=len)
    for ids in lists:
        if ids != items[: len(ids)]:
            raise ValueError(f"{folder}: the evidence files are not prefixes of one item order")
    listed = folder / "search_items.txt"
    search = listed.read_text().split() if listed.is_file() else []
    earlier = []
    for text in first["certification"].get("earlier_attempts", ()):
        m = re.match(r"attempt (\S+) ", text)
        if m:
            earlier.append(m.group(1))
    sweep = json.loads((folder / "sweep.json").read_text()) if (folder / "sweep.json").is_file() else {}
    args = sweep.get("args", {})
    note = (f"reconstructed from {folder.as_posix().split('docs/results/')[-1]} (certification.json, evidence/, "
            "search_items.txt): its rows were lost with the machine it ran on")
    common = {"attempt": attempt, "benchmark": first["benchmark"], "pair_id": first.get("pair_fingerprint"),
              "reconstructed": True}
    opened = {"event": "opened", **common, "pair": first["pair"], "dtype": first["dtype"], "study": first["sweep"],
              "plan": "reconstructed", "budgets": [float(c["budget"]) for c in budgets],
              "alphas": [float(c["certification"]["alpha"]) for c in budgets],
              "candidates": [[st["candidate"] for st in c["certification"].get("steps", ())] for c in budgets],
              "looks": len((first["certification"].get("sequential") or {}).get("sizes", [1])),
              "new_items": bool(first["certification"].get("new_items", args.get("new_items", False))),
              "earlier": earlier, "when": None, "run_dir": args.get("run_dir", ""), "items": items,
              "search_items": search, "note": note}
    decided = []
    for c in budgets:
        cc = c["certification"]
        used = max((int(st.get("n", 0)) for st in cc.get("steps", ())), default=int(cc.get("n") or 0))
        decided.append({"event": "decided", **common, "budget": float(c["budget"]), "certified": bool(c["certified"]),
                        "reason": cc.get("reason", ""), "items_used": used, "when": None, "note": note})
    return [opened, *decided]


def holds(folder: Path, rows: Sequence[dict[str, Any]]) -> list[str]:
    """What the history ``rows`` lack of the attempt behind result ``folder`` (empty: it holds it whole): an
    ``opened`` row for its attempt, benchmark and pair whose items start with each evidence file's items, and a
    ``decided`` row per budget with the certificate's verdict. A folder made before the ledger (no attempt id) is
    looked up by the study text naming the folder."""
    cert = json.loads((folder / "certification.json").read_text())
    budgets = list(cert["budgets"].values())
    attempt = budgets[0]["certification"].get("attempt")
    if attempt is None:
        opened = [r for r in rows if r.get("event") == "opened" and folder.name in str(r.get("study", ""))]
    else:
        opened = [r for r in rows if r.get("event") == "opened" and r.get("attempt") == attempt]
    if not opened:
        return [f"no opened row for attempt {attempt or folder.name}"]
    row, missing = opened[0], []
    attempt = row["attempt"]
    bench = budgets[0]["benchmark"]
    if row.get("benchmark") != bench:
        missing.append(f"attempt {attempt} is on benchmark {row.get('benchmark')}, the result on {bench}")
    fp = budgets[0].get("pair_fingerprint")
    if fp and row.get("pair_id") != fp:
        missing.append(f"attempt {attempt} is on pair {row.get('pair_id')}, the result on {fp}")
    items = list(row.get("items", ()))
    for c in budgets:
        cc = c["certification"]
        for st in cc.get("steps", ()):
            path = folder / "evidence" / f"{st['candidate']}.csv"
            if path.is_file():
                ids = _evidence_ids(path)
                if ids != items[: len(ids)]:
                    missing.append(f"{path.name}'s items are not the first items of attempt {attempt}")
        got = [r for r in rows if r.get("event") == "decided" and r.get("attempt") == attempt
               and float(r.get("budget", -1)) == float(c["budget"])]
        if not got:
            missing.append(f"no decided row for attempt {attempt} at budget {float(c['budget']) * 100:g}%")
        elif bool(got[0].get("certified")) != bool(c["certified"]):
            missing.append(f"attempt {attempt}'s decided row at {float(c['budget']) * 100:g}% says certified "
                           f"{got[0].get('certified')}, the result {c['certified']}")
    return sorted(set(missing))


def combine(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """attempt id -> its opened row with ``decided`` (budget -> decided row) and ``used`` (item ids), in the order
    the attempts opened."""
    out: dict[str, dict[str, Any]] = {}
    for row in rows:
        if row.get("event") == "opened":
            out.setdefault(row["attempt"], {**row, "decided": {}})
    for row in rows:
        if row.get("event") == "decided" and row.get("attempt") in out:
            out[row["attempt"]]["decided"].setdefault(str(float(row["budget"])), row)
    for a in out.values():
        done = a["decided"]
        closed = len(done) >= len(a.get("budgets", ())) and all(r.get("items_used") is not None
                                                               for r in done.values())
        # an attempt that never closed (killed mid-run) used every item it planned
        a["used"] = a["items"][: max(int(r["items_used"]) for r in done.values())] if closed and done \
            else list(a["items"])
    return out
