"""How many draft tokens a verify round accepts: histograms and per-position acceptance.

Input is what a ``Record`` (or a sum of Records) carries: ``num_drafts`` verify rounds and
``accepted_per_position`` counts (round count accepting draft position i). Accepted positions
always form a prefix (emission keeps the leading run), so the per-round accepted-length
distribution follows exactly from those totals; no per-round log is needed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from dashboards.plotting import colour_map, plt, save


def accepted_length_histogram(num_drafts: int, accepted_per_position: Sequence[int]) -> list[int]:
    """Rounds that accepted exactly k draft tokens, k = 0..L (length L+1, sums to ``num_drafts``).

    With a = accepted_per_position, a[-1] := num_drafts and a[L] := 0, rounds with exactly k
    accepted = a[k-1] - a[k]: a round accepting k tokens counts at positions 0..k-1 and no further.
    Raises ValueError when the counts cannot come from prefix acceptance (negative, increasing
    along positions, or more than ``num_drafts``), since the derivation would then be wrong.
    """
    counts = [int(c) for c in accepted_per_position]
    if num_drafts < 0 or any(c < 0 for c in counts):
        raise ValueError(f"counts must be non-negative: num_drafts={num_drafts}, accepted_per_position={counts}")
    padded = [int(num_drafts), *counts, 0]
    if any(later > earlier for earlier, later in zip(padded, padded[1:], strict=False)):
        raise ValueError("accepted_per_position must be non-increasing and at most num_drafts "
                         f"(accepted tokens form a prefix): num_drafts={num_drafts}, accepted_per_position={counts}")
    return [padded[k] - padded[k + 1] for k in range(len(counts) + 1)]


def _no_data(ax: plt.Axes) -> None:
    ax.text(0.5, 0.5, "no acceptance data", transform=ax.transAxes, ha="center", va="center",
            fontsize=12, color="grey")


def plot_acceptance_histograms(series: Mapping[str, tuple[int, Sequence[int]]], path: str | Path,
                               *, title: str = "Accepted draft tokens per verify round") -> Path:
    """Grouped bars: for each label, the fraction of verify rounds that accepted exactly k draft
    tokens (k = 0..L). ``series``: label -> (num_drafts, accepted_per_position counts). The legend
    gives each label's mean accepted tokens per round (add 1 for tokens emitted per round)."""
    hists = {label: accepted_length_histogram(n, a) for label, (n, a) in series.items()}
    colours = colour_map(hists)
    width_k = max((len(h) for h in hists.values()), default=0)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * width_k + 3), 4.5))
    bar = 0.8 / max(1, len(hists))
    for j, (label, hist) in enumerate(sorted(hists.items())):
        total = sum(hist)
        # A label with zero rounds (e.g. every item failed) draws as empty bars, not a 0/0 error.
        frac = np.array(hist, dtype=float) / total if total else np.zeros(len(hist))
        mean = sum(k * c for k, c in enumerate(hist)) / total if total else float("nan")
        ks = np.arange(len(hist)) + (j - (len(hists) - 1) / 2) * bar
        ax.bar(ks, frac, width=bar, color=colours[label], label=f"{label} (mean {mean:.2f}, {total} rounds)")
    if hists:
        ax.set_xticks(range(width_k))
        ax.legend(fontsize=8)
    else:
        _no_data(ax)
    ax.set_xlabel("draft tokens accepted in the round (k)")
    ax.set_ylabel("fraction of verify rounds")
    ax.set_title(title)
    ax.grid(True, axis="y", alpha=0.3)
    return save(fig, path)


def per_position_rates(num_drafts: int, accepted_per_position: Sequence[int]) -> list[float]:
    """Fraction of verify rounds accepting draft position i (TrialMetrics.acceptance_per_position)."""
    return [c / num_drafts if num_drafts else float("nan") for c in accepted_per_position]


def plot_per_position(series: Mapping[str, Sequence[float]], path: str | Path,
                      *, title: str = "Acceptance rate per draft position") -> Path:
    """One line per label: the fraction of verify rounds that accepted draft position i (1-based
    on the axis, as papers number draft tokens)."""
    colours = colour_map(series)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    width = 0
    for label, rates in sorted(series.items()):
        rates = list(rates)
        width = max(width, len(rates))
        ax.plot(range(1, len(rates) + 1), rates, marker="o", color=colours[label], label=label)
    if width:
        ax.set_xticks(range(1, width + 1))
        ax.legend(fontsize=8)
    else:
        _no_data(ax)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("draft position")
    ax.set_ylabel("fraction of rounds accepting it")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    return save(fig, path)
