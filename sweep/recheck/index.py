"""``python -m jobs.results check docs/results``: every folder the results page (``README.md``) lists, rechecked.

The page's tables name each folder as a link ``[name](name/)``. Each listed folder is rechecked by what it holds:

- a certificate folder (``certification.json``): :func:`sweep.recheck.check.verify`, every check of every budget; a
  folder holding ``SUPERSEDED.md`` passes only where its row on the page says "superseded";
- a quality comparison (``quality.json`` with ``evidence.csv``, :mod:`jobs.bench.fast_quality`): n, lost, won,
  the drop and its exact upper bound recomputed from the per-item scores, and ``quality.md`` rendered again from
  the figures;
- measurements (benchmark tables): each ``.md`` table has its raw ``.json`` rows beside it and they parse. Nothing
  in them decides anything, so there is nothing to re-decide.

A folder under ``docs/results/`` that the page does not list, or a listed one that is missing, fails the check:
the page is the list of what was tried.
"""

from __future__ import annotations

import csv
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sweep.recheck.folder import FAILED, OK, SUPERSEDED_EXIT, close

PAGE = "README.md"
_LINK = re.compile(r"\[[^\]]+\]\(([A-Za-z0-9._-]+)/\)")


def listed(root: Path) -> dict[str, str]:
    """The folders the page's table rows link to, each with its row's text (the first row naming it)."""
    rows: dict[str, str] = {}
    for line in (root / PAGE).read_text().splitlines():
        if line.lstrip().startswith("|"):
            for name in _LINK.findall(line):
                rows.setdefault(name, line)
    return rows


def _quality(folder: Path) -> tuple[str, str]:
    from workers.certify.decide import drop_bound
    from workers.results.quality import render

    summary = json.loads((folder / "quality.json").read_text())
    with (folder / "evidence.csv").open() as f:
        rows = list(csv.DictReader(f))
    ref_col = f"score_{summary['reference']}"
    fast_col = f"score_{summary['fast']}"
    if not rows or ref_col not in rows[0] or fast_col not in rows[0]:
        return FAILED, f"evidence.csv has no {ref_col}/{fast_col} columns"
    bound = drop_bound([float(r[ref_col]) for r in rows], [float(r[fast_col]) for r in rows], summary["alpha"])
    got = {"n": len(rows), "lost": bound.losses, "won": bound.wins, "drop": bound.drop,
           "drop_upper_bound": bound.upper, "identical_outputs": sum(int(r["identical"]) for r in rows)}
    wrong = [f"{k} {summary.get(k)} (recomputed {v})" for k, v in got.items() if not close(summary.get(k), v)]
    if wrong:
        return FAILED, "quality.json differs from its evidence: " + ", ".join(wrong)
    if render(summary) != (folder / "quality.md").read_text():
        return FAILED, "quality.md is not what quality.json renders to"
    return OK, (f"quality recomputed from {len(rows)} items' evidence: drop {bound.drop:+.2%} (lost {bound.losses}, "
                f"won {bound.wins}), upper bound {bound.upper:.2%}; the table renders again as committed")


def _measurements(folder: Path) -> tuple[str, str]:
    tables = sorted(folder.glob("*.md"))
    if not tables:
        return FAILED, "neither a certificate, a quality comparison nor a measurement table"
    for md in tables:
        raw = md.with_suffix(".json")
        if not raw.is_file():
            return FAILED, f"{md.name} has no raw rows ({raw.name})"
        try:
            json.loads(raw.read_text())
        except ValueError as err:
            return FAILED, f"{raw.name} does not parse: {err}"
    return OK, (f"measurements: {len(tables)} table(s), each beside its raw rows; figures as measured, no decision "
                "to recompute")


def check_index(root: Path, history: Path | None = None,
                out: Callable[[str], Any] = print) -> int:
    """Print one line per folder (``<name>: ok ...`` or ``<name>: FAILED: <why>``) and then each certificate
    folder's own checks; exit code 0 when nothing failed, else 1."""
    from sweep.recheck.check import verify

    rows = listed(root)
    present = {p.name for p in root.iterdir() if p.is_dir()}
    failed = 0

    def say(name: str, status: str, text: str) -> None:
        nonlocal failed
        failed += status == FAILED
        out(f"{name}: {status}: {text}" if status == FAILED else f"{name}: {status} ({text})")

    for name in sorted(present - set(rows)):
        say(name, FAILED, f"a folder under {root} that {PAGE} does not list")
    for name, row in rows.items():
        folder = root / name
        if name not in present:
            say(name, FAILED, f"{PAGE} lists it and there is no such folder")
            continue
        if (folder / "certification.json").is_file():
            found = verify(folder, history)
            code = found.exit_code()
            for line in found.lines():
                out(f"  {name}: {line}")
            marked = "superseded" in row.lower()
            if code == SUPERSEDED_EXIT:
                say(name, OK if marked else FAILED, "superseded, as its row says" if marked else
                    "the folder holds SUPERSEDED.md and its row does not say superseded")
            elif code != 0:
                say(name, FAILED, f"{len(found.failed)} check(s) failed (above)")
            elif marked:
                say(name, FAILED, "its row says superseded and the folder holds no SUPERSEDED.md")
            else:
                say(name, OK, f"certificates re-decided: {len(found.budgets)} budget(s), every check ok")
        elif (folder / "quality.json").is_file() and (folder / "evidence.csv").is_file():
            say(name, *_quality(folder))
        else:
            say(name, *_measurements(folder))
    out(f"{len(rows)} folder(s) listed, {failed} failed")
    return 1 if failed else 0
