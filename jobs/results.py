"""A sweep's certificates as a small, self-contained evidence folder, and their recomputation from it.

    python -m jobs.results export --run-dir runs/sweeps/<study> --out docs/results/<name>
    python -m jobs.results check docs/results/<name>

``export`` copies what a reader needs to recompute every certificate and nothing heavy:
``certification.json``, ``chosen-budget-<b>.json``, ``evidence/<candidate>.csv`` (the paired per-item
outcomes the decision was made on), ``search_items.txt`` (the ids the search used, so anyone can see the
confirmation items were never among them), ``sweep.json`` (the command's settings) and ``table.md`` (per
budget: certified, rule, p-value, bound, n, lost/won, discordance, modelled and measured speed). ``check``
recomputes each budget's decision from the evidence CSV alone (the exact test, through the recorded
group-sequential design), recomputes that design from its N, looks, alpha and budget (never trusting the
recorded thresholds), checks that the evidence's items are the confirmation pool's first items in its fixed
order (less the items earlier attempts used, listed in ``certification.json``) and that none was a search item,
and fails, naming the budget and the check, where any does not hold. A folder holding ``SUPERSEDED.md`` is
reported as superseded and fails the check whatever its evidence says.
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


def evidence_rows(path: Path) -> tuple[list[str], list[float], list[float]]:
    """(item ids, reference scores, candidate scores) of an evidence CSV, in its order."""
    with path.open() as f:
        rows = list(csv.DictReader(f))
    return ([r["item_id"] for r in rows], [float(r["reference_score"]) for r in rows],
            [float(r["candidate_score"]) for r in rows])


def recompute(folder: Path) -> list[dict[str, Any]]:
    """Each budget's decision recomputed from its evidence CSV: budget, certified, p-value, n, lost, won, and
    whether they match the certificate (``matches``); whether the group-sequential design recomputes
    (``design_matches``: ``look_plan`` again from N, K, alpha, rho and the budget); whether the evidence's items
    are the confirmation pool's first items in its fixed order (``pool_front``: the benchmark's pool without
    the search items and the items earlier attempts used, ``certification.json``'s ``pool.skipped``) and share
    none with the search (``disjoint``). The last two need ``sweep.json`` and ``search_items.txt`` (None without
    them). ``ok``: every check that ran passed."""
    from workers.certify.decide import certifies, sequential_bound, shown_step
    from workers.certify.sequential import LookPlan, look_plan

    cert = json.loads((folder / "certification.json").read_text())
    front = _pool_front(folder, cert)
    searched = set((folder / "search_items.txt").read_text().split()) if (folder / "search_items.txt").is_file() else None
    out = []
    for key, choice in cert["budgets"].items():
        c = choice["certification"]
        if not c.get("evidence"):
            continue
        budget = float(choice["budget"])
        ids, ref, cand = evidence_rows(folder / c["evidence"])
        design = c.get("sequential")
        if design:
            plan = LookPlan(tuple(design["sizes"]), tuple(design["alphas"]), design["alpha"], design["rho"],
                            tuple(design["spent"]), design["budget"],
                            None if design.get("thresholds") is None else
                            tuple(-math.inf if z is None else z for z in design["thresholds"]))
            again = look_plan(plan.n, len(plan.sizes), plan.alpha, plan.rho, plan.budget)
            design_ok = again.sizes == plan.sizes and _same(again.thresholds, plan.thresholds) and all(
                math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12) for a, b in zip(again.spent, plan.spent, strict=True))
        else:
            plan, design_ok = look_plan(len(ref), 1, c["alpha"]), True
        got = sequential_bound(ref, cand, plan, budget)
        shown = shown_step(c)
        row = {"budget": budget, "certified": certifies(got), "p_value": got.p_value, "n": got.n,
               "lost": got.losses, "won": got.wins, "design_matches": design_ok,
               "pool_front": None if front is None else ids == front[: len(ids)],
               "disjoint": None if searched is None else not set(ids) & searched}
        row["matches"] = (row["certified"] == c["certified"] and got.n == c["n"] and got.losses == shown.get("losses")
                          and got.wins == shown.get("wins")
                          and (c["p_value"] is None or math.isclose(got.p_value, c["p_value"], rel_tol=1e-9, abs_tol=1e-12)))
        row["ok"] = row["matches"] and design_ok and row["pool_front"] is not False and row["disjoint"] is not False
        row["key"] = key
        out.append(row)
    return out


def _same(a: tuple[float, ...] | None, b: tuple[float, ...] | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return len(a) == len(b) and all(x == y or math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-12) for x, y in zip(a, b, strict=True))


def _pool_front(folder: Path, cert: dict[str, Any]) -> list[str] | None:
    """The confirmation pool's item ids in its fixed order, without the search items and the ones earlier attempts
    used (None when the folder lacks sweep.json or search_items.txt)."""
    meta, listed = folder / "sweep.json", folder / "search_items.txt"
    if not meta.is_file() or not listed.is_file():
        return None
    from workers.benchmarks import get_benchmark

    bench = get_benchmark(json.loads(meta.read_text())["args"]["benchmark"])
    searched = set(listed.read_text().split())
    search = [it for it in bench.items(split="search") if it.id in searched]
    skipped = set((cert.get("pool") or {}).get("skipped") or ())
    return [it.id for it in bench.confirmation_pool(search)[0] if it.id not in skipped]


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


def export(run_dir: Path, out: Path) -> Path:
    from workers.benchmarks import get_benchmark

    report = run_dir / "report"
    if not (report / "certification.json").is_file():
        raise ValueError(f"{run_dir} has no report/certification.json: the sweep has not confirmed yet")
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
    folder = out if args.cmd == "export" else Path(args.folder)
    from workers.results.scope import withdrawn

    found = withdrawn(folder)
    if found is not None:
        print(f"SUPERSEDED: {found[0]} (see {found[1]})")

    def said(value: bool | None, yes: str, no: str) -> str:
        return "not checked (no sweep.json / search_items.txt)" if value is None else yes if value else no

    for r in rows:
        print(f"budget {r['budget'] * 100:g}%: recomputed from the evidence: certified {r['certified']}, "
              f"p = {r['p_value']:.4g}, n = {r['n']}, lost {r['lost']} / won {r['won']}: "
              f"{'matches' if r['matches'] else 'DOES NOT MATCH'} the certificate; design "
              f"{'recomputes' if r['design_matches'] else 'DOES NOT RECOMPUTE'}; items "
              f"{said(r['pool_front'], 'are the pool front in its fixed order', 'are NOT the pool front in its fixed order')}, "
              f"{said(r['disjoint'], 'disjoint from the search', 'SHARED WITH THE SEARCH')}")
    return 0 if rows and all(r["ok"] for r in rows) and found is None else 1


if __name__ == "__main__":
    raise SystemExit(main())
