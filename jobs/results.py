"""A sweep's certificates as a small, self-contained evidence folder, and their recomputation from it.

    python -m jobs.results export --run-dir runs/sweeps/<study> --out docs/results/<name>
    python -m jobs.results check docs/results/<name>

``export`` copies what a reader needs to recompute every certificate and nothing heavy:
``certification.json``, ``chosen-budget-<b>.json``, ``evidence/<candidate>.csv`` (the paired per-item
outcomes the decision was made on), ``search_items.txt`` (the ids the search used, so anyone can see the
confirmation items were never among them), ``sweep.json`` (the command's settings) and ``table.md`` (per
budget: certified, rule, p-value, bound, n, lost/won, discordance, modelled and measured speed). ``check``
recomputes each budget's decision from the evidence CSV alone (the exact test, through the recorded
group-sequential design) and fails, naming the budget, where it does not match the certificate.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import shutil
from pathlib import Path
from typing import Any

from workers.cli import one_line_errors


def evidence_scores(path: Path) -> tuple[list[float], list[float]]:
    with path.open() as f:
        rows = list(csv.DictReader(f))
    return [float(r["reference_score"]) for r in rows], [float(r["candidate_score"]) for r in rows]


def recompute(folder: Path) -> list[dict[str, Any]]:
    """Each budget's decision recomputed from its evidence CSV: budget, certified, p-value, n, lost, won, and
    whether they match the certificate (``matches``)."""
    from workers.certify.decide import certifies, sequential_bound
    from workers.certify.sequential import LookPlan, look_plan

    cert = json.loads((folder / "certification.json").read_text())
    out = []
    for key, choice in cert["budgets"].items():
        c = choice["certification"]
        if not c.get("evidence"):
            continue
        budget = float(choice["budget"])
        ref, cand = evidence_scores(folder / c["evidence"])
        design = c.get("sequential")
        if design:
            plan = LookPlan(tuple(design["sizes"]), tuple(design["alphas"]), design["alpha"], design["rho"],
                            tuple(design["spent"]), design["budget"],
                            None if design.get("thresholds") is None else
                            tuple(-math.inf if z is None else z for z in design["thresholds"]))
        else:
            plan = look_plan(len(ref), 1, c["alpha"])
        got = sequential_bound(ref, cand, plan, budget)
        shown = c["steps"][0] if c["steps"] else {}
        row = {"budget": budget, "certified": certifies(got), "p_value": got.p_value, "n": got.n,
               "lost": got.losses, "won": got.wins}
        row["matches"] = (row["certified"] == c["certified"] and got.n == c["n"] and got.losses == shown.get("losses")
                          and got.wins == shown.get("wins")
                          and (c["p_value"] is None or math.isclose(got.p_value, c["p_value"], rel_tol=1e-9, abs_tol=1e-12)))
        row["key"] = key
        out.append(row)
    return out


def _x(value: float | None) -> str:
    return "—" if value is None or not math.isfinite(value) else f"{value:.2f}x"


def table(folder: Path) -> str:
    """The README's table of a results folder."""
    cert = json.loads((folder / "certification.json").read_text())
    lines = ["| budget | certified | rule | p-value | bound (1-α) | n | lost / won | discordance | look | "
             "modelled speedup / token | measured speedup / token |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for choice in cert["budgets"].values():
        c, conf = choice["certification"], choice.get("confirm") or {}
        step = c["steps"][0] if c["steps"] else {}
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
                     f"{look} | {_x(conf.get('speed.modelled_per_token'))} | {_x(conf.get('speed.measured_per_token'))} |")
    return "\n".join(lines) + "\n"


def export(run_dir: Path, out: Path) -> Path:
    from workers.benchmarks import get_benchmark

    report = run_dir / "report"
    if not (report / "certification.json").is_file():
        raise ValueError(f"{run_dir} has no report/certification.json: the sweep has not confirmed yet")
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy2(report / "certification.json", out / "certification.json")
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
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description="Export a sweep's certificates as an evidence folder, or recompute one.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("export", help="copy the certificates, evidence and search item ids into a folder")
    ex.add_argument("--run-dir", required=True, help="the sweep's run directory")
    ex.add_argument("--out", required=True, help="the folder to write (e.g. docs/results/<name>)")
    ck = sub.add_parser("check", help="recompute every certificate of a folder from its evidence")
    ck.add_argument("folder")
    return ap


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cmd == "export":
        out = export(Path(args.run_dir), Path(args.out))
        print((out / "table.md").read_text(), end="")
        rows = recompute(out)
    else:
        rows = recompute(Path(args.folder))
    for r in rows:
        print(f"budget {r['budget'] * 100:g}%: recomputed from the evidence: certified {r['certified']}, "
              f"p = {r['p_value']:.4g}, n = {r['n']}, lost {r['lost']} / won {r['won']}: "
              f"{'matches' if r['matches'] else 'DOES NOT MATCH'} the certificate")
    return 0 if all(r["matches"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
