"""Every artifact of a sweep in one folder, and a CLI that rebuilds them offline.

``write_report`` takes the trials frame (one row per Optuna trial, see ``dashboards.frames``) and
writes the frame itself, the Pareto plot and front, the quality-constrained speedup table, the
per-budget winners, the acceptance plots of the winners and ``report.md`` linking them. ``jobs/``
logs the folder to MLflow; ``python -m dashboards.report`` rebuilds it from ``trials.parquet``
(plus the ``noise_floor.json``/``acceptance.json`` it wrote), with no Ray, Optuna or MLflow.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shlex
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import polars as pl

from dashboards.acceptance import (
    accepted_length_histogram,
    per_position_rates,
    plot_acceptance_histograms,
    plot_per_position,
)
from dashboards.frames import COMPLETE, FAIL, PRUNED, for_csv, normalise_trials
from dashboards.pareto import pareto_front, plot_pareto
from dashboards.tables import budget_label, budget_table, budget_winners, format_params, to_markdown


def _pct(x: float | None, signed: bool = False) -> str:
    if x is None or not math.isfinite(x):
        return "n/a"
    return f"{100 * x:+.1f}%" if signed else f"{100 * x:.1f}%"


def _as_dict(noise_floor: Any) -> dict[str, Any]:
    # Accept workers.metrics.NoiseFloor too without importing it (that module pulls in torch).
    return dataclasses.asdict(noise_floor) if dataclasses.is_dataclass(noise_floor) else dict(noise_floor)


def noise_floor_note(noise_floor: Mapping[str, Any] | None, budgets: Sequence[float]) -> str:
    """One paragraph on which budgets the lossless-vs-target-only noise floor makes meaningless.

    ``noise_floor``: ``items``, ``divergence_rate``, ``accuracy_diff`` and ``accuracy_diff_ci``
    (or ``accuracy_diff_ci_lo``/``_hi``), as ``workers.metrics.noise_floor`` computes them.
    A budget is inside the floor when it is no larger than the largest of |diff|, |lo|, |hi|.
    """
    if noise_floor is None:
        return ("No noise-floor run was given (lossless vs target-only on the same items), so it is not "
                "known which budgets are tighter than numerical noise; treat the smallest ones with care.")
    nf = _as_dict(noise_floor)
    lo, hi = nf.get("accuracy_diff_ci") or (nf.get("accuracy_diff_ci_lo"), nf.get("accuracy_diff_ci_hi"))
    diff = nf.get("accuracy_diff")
    bounds = [abs(float(v)) for v in (diff, lo, hi) if v is not None and math.isfinite(float(v))]
    what = (f"lossless vs target-only outputs differ on {_pct(nf.get('divergence_rate'))} of "
            f"{nf.get('items', '?')} items, accuracy diff {_pct(diff, True)} "
            f"[{_pct(lo, True)}, {_pct(hi, True)}]")
    if not bounds:
        return f"The noise floor could not be measured ({what})."
    floor = max(bounds)
    inside = [budget_label(b) for b in sorted(budgets) if b <= floor]
    if inside:
        return (f"Budgets tighter than the noise floor ({what}) cannot be told apart from zero: "
                f"{', '.join(inside)}.")
    return f"Every budget is wider than the noise floor ({what})."


def _state_counts(trials: pl.DataFrame) -> pl.DataFrame:
    states = [COMPLETE, PRUNED, FAIL]
    return (trials.group_by("family")
            .agg(*[(pl.col("state") == s).sum().alias(s.lower()) for s in states])
            .sort("family", nulls_last=True))


def _front_table(front: pl.DataFrame, x: str) -> pl.DataFrame:
    return front.select(
        "trial", "family",
        pl.struct("family", "params", "draft_len").map_elements(
            lambda r: format_params(r["family"], r["params"], r["draft_len"]), return_dtype=pl.String
        ).alias("settings"),
        pl.col(x).round(3).alias("speedup"), pl.col("accuracy").round(4),
        pl.col("accuracy_drop").round(4))


def _headline(trials: pl.DataFrame, ref: float | None, front: pl.DataFrame, title: str) -> list[str]:
    counts = {s: trials.filter(pl.col("state") == s).height for s in (COMPLETE, PRUNED, FAIL)}
    plural = "" if trials.height == 1 else "s"
    lines = [f"# {title or 'Sweep report'}", "",
             f"{trials.height} trial{plural}: {counts[COMPLETE]} complete, {counts[PRUNED]} pruned, "
             f"{counts[FAIL]} failed. Target-only accuracy: {_pct(ref)}. Budgets are on the accuracy drop "
             "vs target-only (paired items).", ""]
    if front.height == 0:
        lines += ["**No trial completed with finite metrics**, so there is no Pareto front and no budget "
                  "winner; the tables below are empty.", ""]
    return lines


def _plot_acceptance(winners_acceptance: Mapping[str, tuple[int, Sequence[int]]], out: Path,
                     paths: dict[str, Path]) -> str:
    """Both acceptance plots; returns the report's paragraph. Bad counts skip the plots with a
    warning instead of raising: at the end of a sweep, losing the report would cost far more."""
    try:
        for n, counts in winners_acceptance.values():
            accepted_length_histogram(n, counts)
    except ValueError as err:
        warnings.warn(f"acceptance plots skipped: {err}", stacklevel=3)
        return f"Acceptance plots skipped: {err}"
    paths["acceptance_hist.png"] = plot_acceptance_histograms(winners_acceptance, out / "acceptance_hist.png")
    rates = {label: per_position_rates(n, counts) for label, (n, counts) in winners_acceptance.items()}
    paths["per_position.png"] = plot_per_position(rates, out / "per_position.png")
    return ("![accepted tokens per round](acceptance_hist.png)\n\n"
            "![acceptance per draft position](per_position.png)")


def write_report(trials: pl.DataFrame, out_dir: str | Path, *, reference_accuracy: float, budgets: list[float],
                 winners_acceptance: dict[str, tuple[int, list[int]]] | None = None,
                 noise_floor: dict | None = None, title: str = "",
                 speedup: str = "speedup_vs_ar_modelled", certification: str | None = None) -> dict[str, Path]:
    """Write every artifact into ``out_dir`` and return file name -> path.

    Always: trials.parquet, trials.csv, pareto.png, pareto.csv, budget_table.md, budget_winners.csv,
    report.md. With ``winners_acceptance`` (label -> (num_drafts, accepted_per_position)):
    acceptance_hist.png, per_position.png and acceptance.json; with ``noise_floor``: noise_floor.json
    (both JSON files are what the CLI reads to rebuild the report). ``speedup`` picks the column
    ranked in the tables and plotted on the Pareto x axis. ``certification`` (markdown: the
    certified-budget table of the confirmation split) goes first in report.md; every other table
    describes the search items, where the winner's own drop is biased low (winner's curse).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    trials = normalise_trials(trials)
    budgets = sorted(set(float(b) for b in budgets))
    ref = float(reference_accuracy) if reference_accuracy is not None and math.isfinite(reference_accuracy) else None
    paths: dict[str, Path] = {}

    def put(name: str, text: str) -> None:
        (out / name).write_text(text, encoding="utf-8")
        paths[name] = out / name

    trials.write_parquet(out / "trials.parquet")
    paths["trials.parquet"] = out / "trials.parquet"
    for_csv(trials).write_csv(out / "trials.csv")
    paths["trials.csv"] = out / "trials.csv"

    front = pareto_front(trials, x=speedup, y="accuracy")
    for_csv(front).write_csv(out / "pareto.csv")
    paths["pareto.csv"] = out / "pareto.csv"
    paths["pareto.png"] = plot_pareto(trials, out / "pareto.png", reference_accuracy=ref, budgets=budgets,
                                      x=speedup, y="accuracy", title=title or "")

    winners = budget_winners(trials, budgets, speedup=speedup)
    winners.write_csv(out / "budget_winners.csv")
    paths["budget_winners.csv"] = out / "budget_winners.csv"
    point = to_markdown(budget_table(trials, budgets, speedup=speedup))
    has_ci = trials.filter(pl.col("accuracy_drop_ci_hi").is_not_null()).height > 0
    conservative = to_markdown(budget_table(trials, budgets, speedup=speedup, use_ci=True)) if has_ci else ""
    tables = (f"### {speedup} under an accuracy-drop budget (search split, point estimate: a description)\n\n{point}"
              + (f"\n### Search split, bootstrap 95% upper bound of the drop within the budget (a description)\n\n"
                 f"{conservative}"
                 if conservative else ""))
    put("budget_table.md", tables)

    if noise_floor is not None:
        put("noise_floor.json", json.dumps(_as_dict(noise_floor), indent=2, default=list))
    acceptance_text = ""
    if winners_acceptance:
        put("acceptance.json", json.dumps({k: [int(n), [int(c) for c in a]]
                                           for k, (n, a) in winners_acceptance.items()}, indent=2))
        acceptance_text = _plot_acceptance(winners_acceptance, out, paths)

    rebuild = ["python -m dashboards.report --trials trials.parquet --out .",
               f"--reference-accuracy {reference_accuracy} --budgets {','.join(f'{b:g}' for b in budgets)}",
               f"--speedup {speedup}"]
    rebuild += ["--noise-floor noise_floor.json"] if noise_floor is not None else []
    rebuild += ["--acceptance acceptance.json"] if winners_acceptance else []
    rebuild += [f"--title {shlex.quote(title)}"] if title else []
    lines = _headline(trials, ref, front, title)
    if certification:
        put("certification.md", certification)
        lines += ["## Certified budgets (confirmation split: items the search never saw)", "", certification, ""]
    lines += ["## Best speedup within each budget on the search split (not certificates)", "", tables, "", "## Noise floor", "",
              noise_floor_note(noise_floor, budgets), "", "## Pareto front", "", "![Pareto front](pareto.png)", ""]
    if front.height:
        lines += [to_markdown(_front_table(front, speedup)), ""]
    if trials.height:
        lines += ["## Trials per family", "", to_markdown(_state_counts(trials)), ""]
    if acceptance_text:
        lines += ["## Acceptance of the winners", "", acceptance_text, ""]
    lines += ["## Files", "", ", ".join(f"[{n}]({n})" for n in sorted(paths)), "",
              f"Rebuild offline from this folder: `{' '.join(rebuild)}`", ""]
    put("report.md", "\n".join(lines))
    return paths


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description="Rebuild a sweep's report (plots, tables, report.md) from a saved "
                                             "trials frame, offline.")
    ap.add_argument("--trials", required=True, help="trials frame: .parquet (as write_report saves it) or .csv")
    ap.add_argument("--out", required=True, help="folder to write the report into (created if missing)")
    ap.add_argument("--reference-accuracy", type=float, required=True, help="target-only accuracy, 0..1")
    ap.add_argument("--budgets", default="0.01,0.02,0.05", help="comma-separated accuracy-drop budgets, 0..1")
    ap.add_argument("--noise-floor", default=None, help="noise_floor.json written by a previous report")
    ap.add_argument("--acceptance", default=None, help="acceptance.json: label -> [num_drafts, accepted_per_position]")
    ap.add_argument("--speedup", default="speedup_vs_ar_modelled", help="speedup column to rank and plot")
    ap.add_argument("--title", default="", help="report title")
    return ap


def _read_trials(path: Path) -> pl.DataFrame:
    # No memory map: the rebuild may write trials.parquet over the very file it read (--out .).
    return pl.read_csv(path) if path.suffix == ".csv" else pl.read_parquet(path, memory_map=False)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        budgets = [float(b) for b in args.budgets.split(",") if b.strip()]
    except ValueError as err:
        raise SystemExit(f"--budgets must be comma-separated numbers, got {args.budgets!r}") from err
    noise = json.loads(Path(args.noise_floor).read_text()) if args.noise_floor else None
    acceptance = None
    if args.acceptance:
        saved = json.loads(Path(args.acceptance).read_text())
        acceptance = {label: (int(n), [int(c) for c in counts]) for label, (n, counts) in saved.items()}
    paths = write_report(_read_trials(Path(args.trials)), args.out, reference_accuracy=args.reference_accuracy,
                         budgets=budgets, winners_acceptance=acceptance, noise_floor=noise, title=args.title,
                         speedup=args.speedup)
    for name, path in sorted(paths.items()):
        print(f"{name}\t{path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
