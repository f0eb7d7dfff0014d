"""A sweep's certificates as a small, self-contained evidence folder, and their re-decision from it.

    python -m jobs.results export --run-dir runs/sweeps/<study> --out docs/results/<name>
    python -m jobs.results check docs/results/<name> [--history workers/results/known_attempts.jsonl]
    python -m jobs.results check docs/results        # every folder the results page lists

``export`` copies what a reader needs to recompute every certificate and nothing heavy:
``certification.json``, ``chosen-budget-<b>.json``, ``evidence/<candidate>.csv`` (the paired per-item
outcomes each tested candidate was decided on), ``frontier.json``/``frontier.md``, ``search_items.txt`` (the
ids the search used, so anyone can see the confirmation items were never among them), ``sweep.json`` (the
command's settings) and ``table.md`` (per budget: certified, rule, p-value, bound, n, lost/won, discordance,
modelled and measured speed). It refuses (ValueError) a run whose frontier has an empty lossless table: every
speed in it would be over a baseline that was never measured.

``check`` re-decides everything from the folder and the shipped ledger history (``--history``, default
``workers/results/known_attempts.jsonl``), trusting no recorded decision, threshold or skip, and prints one line
per check per budget, each ``ok``, ``FAILED: <why>`` or ``not checked: <why>``; the exit code is 0 only when no
check failed, 3 for a folder holding ``SUPERSEDED.md``. Given ``docs/results`` itself (a folder whose ``README.md``
lists results folders), it rechecks every folder the page lists and fails on one it does not
(:mod:`sweep.recheck.index`). The checks themselves (steps, order, design, pool,
disjoint, audit, ledger, family, chosen, and the folder's frontier) are the library's: :mod:`sweep.recheck`.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sweep.recheck.check import CHECKS, recompute, verify
from sweep.recheck.folder import (
    FAILED,
    NOT_CHECKED,
    OK,
    SUPERSEDED_EXIT,
    Finding,
    Verification,
    evidence_rows,
)
from sweep.recheck.index import PAGE, check_index
from sweep.recheck.items import frontier_problem
from workers.cli import one_line_errors

__all__ = ["CHECKS", "FAILED", "NOT_CHECKED", "OK", "SUPERSEDED_EXIT", "Finding", "Verification", "build_parser",
           "evidence_rows", "export", "frontier_problem", "main", "recompute", "report", "ship_attempts", "table",
           "verify"]


def _x(value: float | None) -> str:
    return "—" if value is None or not math.isfinite(value) else f"{value:.2f}x"


def _speed(choice: dict[str, Any], conf: dict[str, Any]) -> str:
    """The two speed cells: over the best lossless first (its L, modelled / measured like for like, with the
    timed n), then over target-only; a certificate made before those fields has target-only figures only."""
    vl, va = choice.get("vs_lossless"), choice.get("vs_target_only")
    if not vl:
        return f"— | {_x(conf.get('speed.modelled_per_token'))} / {_x(conf.get('speed.measured_per_token'))}"
    timed = (vl.get("timed") or {}).get("items")
    n = f" (timed n = {timed})" if timed else ""
    return (f"L {vl['draft_len']}: {_x(vl.get('modelled'))} / {_x(vl.get('measured'))}{n} | "
            f"{_x(va.get('modelled'))} / {_x(va.get('measured'))}")


def table(folder: Path) -> str:
    """The README's table of a results folder."""
    from workers.certify.decide import shown_step

    cert = json.loads((folder / "certification.json").read_text())
    lines = ["| budget | certified | rule | p-value | bound (1-α) | n | lost / won | discordance | look | "
             "over the best lossless (L): modelled / measured | over target-only: modelled / measured |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for choice in cert["budgets"].values():
        c, conf = choice["certification"], choice.get("confirm") or {}
        step = shown_step(c)
        if choice.get("policy"):
            knobs = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in choice["params"].items())
            rule = f"{choice['policy']} ({knobs}, L={choice['draft_len']})"
        else:
            rule = "—"
        p = "—" if c.get("p_value") is None else f"{c['p_value']:.3g}"
        bound = "—" if c.get("bound") is None else f"{c['bound'] * 100:.2f}%"
        disc = "—" if c.get("discordance") is None else f"{c['discordance']:.3f}"
        seq = c.get("sequential") or {}
        look = f"{step.get('look', 1)} of {len(seq.get('sizes', [1]))}" if step else "—"
        lines.append(f"| {choice['budget'] * 100:g}% | {'**yes**' if choice['certified'] else 'no'} | {rule} | {p} | "
                     f"{bound} | {c.get('n', '—')} | {step.get('losses', '—')} / {step.get('wins', '—')} | {disc} | "
                     f"{look} | {_speed(choice, conf)} |")
    return "\n".join(lines) + "\n"


def ship_attempts(folder: Path, ledger: str | None = None) -> int:
    """Write the rows of every attempt the folder's certificates name into the shipped history
    (``workers.results.history``), from the ledger that holds them (``ledger``: URL or folder; default as the
    sweep's), so a committed result always has its attempt in the repository. Returns the rows added; a
    ValueError where the ledger does not hold an attempt."""
    from workers.results.ledger import AttemptLedger

    cert = json.loads((folder / "certification.json").read_text())
    added, seen = 0, set()
    for choice in cert["budgets"].values():
        aid = (choice.get("certification") or {}).get("attempt")
        key = (choice.get("benchmark"), choice.get("pair_fingerprint"), aid)
        if not aid or key in seen:
            continue
        seen.add(key)
        if not choice.get("pair_fingerprint"):
            raise ValueError(f"{folder}: its certificates record no pair fingerprint: the attempt's ledger is unknown")
        added += AttemptLedger(choice["benchmark"], choice["pair_fingerprint"], ledger).ship(aid)
    return added


def export(run_dir: Path, out: Path, ledger: str | None = None) -> Path:
    from workers.benchmarks import get_benchmark

    report = run_dir / "report"
    if not (report / "certification.json").is_file():
        raise ValueError(f"{run_dir} has no report/certification.json: the sweep has not confirmed yet")
    if (report / "frontier.json").is_file():  # checked before anything is written
        why = frontier_problem(json.loads((report / "frontier.json").read_text()))
        if why:
            raise ValueError(f"{report / 'frontier.json'}: {why}; refusing to export a frontier whose speeds are over "
                             "no measured lossless (rerun the sweep's report with its lossless records)")
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy2(report / "certification.json", out / "certification.json")
    for name in ("frontier.json", "frontier.md"):  # what limits the speed (workers.metrics.frontier), where the sweep wrote it
        if (report / name).is_file():
            shutil.copy2(report / name, out / name)
    for path in sorted(report.glob("chosen-budget-*.json")):
        shutil.copy2(path, out / path.name)
    (out / "evidence").mkdir(exist_ok=True)
    for path in sorted((report / "evidence").glob("*.csv")):
        shutil.copy2(path, out / "evidence" / path.name)
    meta = json.loads((run_dir / "sweep.json").read_text())
    args = meta["args"]
    (out / "sweep.json").write_text(json.dumps({"study": meta["study"], "args": args}, indent=1) + "\n")
    items = get_benchmark(args["benchmark"]).items(limit=args["items"] or None, seed=args["subset_seed"], split="search")
    (out / "search_items.txt").write_text("".join(f"{it.id}\n" for it in items))
    (out / "table.md").write_text(table(out))
    from workers.results.history import history_path

    shipped = ship_attempts(out, ledger)
    print(f"shipped history: {shipped} row(s) of this result's attempt added to {history_path()} "
          "(commit it with the folder)")
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description="Export a sweep's certificates as an evidence folder, or re-decide one.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("export", help="copy the certificates, evidence and search item ids into a folder")
    ex.add_argument("--run-dir", required=True, help="the sweep's run directory")
    ex.add_argument("--out", required=True, help="the folder to write (e.g. docs/results/<name>)")
    ex.add_argument("--ledger", default=None,
                    help="the ledger holding the sweep's attempt: a SQLAlchemy URL or folder (default: "
                         "$SPECTUNE_LEDGER, else the asset cache's)")
    ck = sub.add_parser("check", help="re-decide every certificate of a folder from its evidence and the ledger history")
    ck.add_argument("folder", help="a results folder, or docs/results (every folder its README.md lists)")
    ck.add_argument("--history", default=None,
                    help="the ledger history (JSON lines) to check the attempt against (default: $SPECTUNE_HISTORY, "
                         "else the shipped workers/results/known_attempts.jsonl)")
    return ap


def report(folder: Path, history: Path | None = None, out: Callable[[str], Any] = print) -> int:
    """Print every check of ``folder``; the exit code (0 all passed, 1 a check failed, 3 superseded)."""
    found = verify(folder, history)
    for line in found.lines():
        out(line)
    return found.exit_code()


@one_line_errors
def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cmd == "export":
        out = export(Path(args.run_dir), Path(args.out), args.ledger)
        print((out / "table.md").read_text(), end="")
        return report(out)
    folder = Path(args.folder)
    if args.history is not None and not Path(args.history).is_file():
        raise ValueError(f"--history {args.history}: no such file")
    history = None if args.history is None else Path(args.history)
    if not (folder / "certification.json").is_file():
        if (folder / PAGE).is_file():
            return check_index(folder, history)
        raise ValueError(f"{folder} is not a results folder: it has no certification.json "
                         f"(made by `python -m jobs.results export`) and no {PAGE} listing results folders")
    return report(folder, history)


if __name__ == "__main__":
    raise SystemExit(main())
