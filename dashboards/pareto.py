"""The speedup/quality Pareto front of a sweep and its plot.

Both axes are maximised (speedup up, accuracy up). Only COMPLETE trials with finite values on
both axes can be on the front; pruned trials are drawn for context but never ranked.
"""

from __future__ import annotations

from pathlib import Path

import polars as pl

from dashboards.frames import COMPLETE, PRUNED, finite, normalise_trials
from dashboards.plotting import colour_map, plt, save


def pareto_front(trials: pl.DataFrame, x: str = "speedup_vs_ar_modelled", y: str = "accuracy") -> pl.DataFrame:
    """Non-dominated COMPLETE trials, maximising both ``x`` and ``y``, sorted by ``x`` (then trial).

    A trial is dominated when another is at least as good on both axes and better on one; exact
    ties are kept (neither dominates the other), so duplicates of a front point all appear.
    """
    trials = normalise_trials(trials)
    done = trials.filter((pl.col("state") == COMPLETE) & finite(x, y))
    xs, ys = done[x].cast(pl.Float64).to_list(), done[y].cast(pl.Float64).to_list()
    # Sweep from the largest x down: a point is on the front iff its y beats every y seen at a
    # strictly larger x and it is the top y of its own x group. O(n log n), no n x n matrix.
    order = sorted(range(len(xs)), key=lambda i: (-xs[i], -ys[i]))
    keep: list[int] = []
    best_right = float("-inf")
    start = 0
    while start < len(order):
        end = start
        while end < len(order) and xs[order[end]] == xs[order[start]]:
            end += 1
        top = ys[order[start]]
        if top > best_right:
            keep.extend(i for i in order[start:end] if ys[i] == top)
        best_right = max(best_right, top)
        start = end
    return done.select(pl.all().gather(sorted(keep))).sort([x, "trial"])


def _budget_label(budget: float) -> str:
    return f"\u2212{100 * budget:g}%"


def plot_pareto(trials: pl.DataFrame, path: str | Path, *, reference_accuracy: float | None,
                budgets: list[float] | tuple[float, ...] = (), x: str = "speedup_vs_ar_modelled",
                y: str = "accuracy", title: str = "") -> Path:
    """Scatter of completed trials (one colour per family), pruned ones as faint crosses, the
    front as a step line, budget lines at ``reference_accuracy - b`` and the target-only point.
    Budget lines and the target-only point are drawn only when ``y`` is ``accuracy`` (and the
    target-only point only when ``x`` is a speedup vs target-only, where it sits at 1)."""
    trials = normalise_trials(trials)
    colours = colour_map(trials["family"].drop_nulls().to_list())
    fig, ax = plt.subplots(figsize=(8, 5.5))
    plotted = finite(x, y)
    done = trials.filter((pl.col("state") == COMPLETE) & plotted)
    pruned = trials.filter((pl.col("state") == PRUNED) & plotted)
    for family in sorted(colours):
        rows = done.filter(pl.col("family") == family)
        if rows.height:
            ax.scatter(rows[x], rows[y], s=28, color=colours[family], label=family, zorder=3)
    if pruned.height:
        # Pruned trials stopped early, so their metrics come from a partial item set: context only.
        ax.scatter(pruned[x], pruned[y], marker="x", s=18, alpha=0.3,
                   color=[colours.get(f, "grey") for f in pruned["family"].to_list()],
                   label=f"pruned ({pruned.height})", zorder=2)
    front = pareto_front(trials, x=x, y=y)
    if front.height:
        # where="pre": between two front points the best reachable y is the right-hand one's.
        ax.step(front[x], front[y], where="pre", color="black", linewidth=1.2, alpha=0.7,
                label=f"Pareto front ({front.height})", zorder=4)
    on_accuracy = y == "accuracy" and reference_accuracy is not None
    if on_accuracy:
        for b in sorted(budgets):
            level = reference_accuracy - b
            ax.axhline(level, color="tab:red", linestyle=":", linewidth=0.9, alpha=0.7)
            ax.annotate(_budget_label(b), xy=(1.0, level), xycoords=("axes fraction", "data"),
                        xytext=(3, 0), textcoords="offset points", va="center", fontsize=8, color="tab:red")
        if x.startswith("speedup_vs_ar"):
            ax.axvline(1.0, color="grey", linestyle="--", linewidth=0.8, alpha=0.6)
            ax.scatter([1.0], [reference_accuracy], marker="*", s=160, color="black",
                       label="target-only", zorder=5)
    if not (done.height or pruned.height):
        ax.text(0.5, 0.5, "no completed trials", transform=ax.transAxes, ha="center", va="center",
                fontsize=12, color="grey")
    ax.set_xlabel(x.replace("_", " ") + (" (x)" if x.startswith("speedup") else ""))
    ax.set_ylabel(y.replace("_", " "))
    ax.set_title(title or f"{y} vs {x}")
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="best")
    return save(fig, path)
