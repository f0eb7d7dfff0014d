"""Matplotlib setup shared by the plots: a headless backend and stable colours.

The Agg backend is selected here, before pyplot is imported, because sweeps run on headless
nodes and inside Ray workers where an interactive backend would fail or hang.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (must follow the backend choice)

DPI = 120


def colour_map(names: Iterable[str]) -> dict[str, tuple[float, float, float, float]]:
    """One colour per name, assigned by sorted name so that a family keeps its colour across every
    plot of a sweep and across sweeps with the same families."""
    ordered = sorted({str(n) for n in names})
    cmap = plt.get_cmap("tab10" if len(ordered) <= 10 else "tab20")
    return {name: cmap(i % cmap.N) for i, name in enumerate(ordered)}


def save(fig: plt.Figure, path: str | Path) -> Path:
    """Write ``fig`` as PNG (parents created) and close it, so long sweeps do not leak figures."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fig.savefig(path, dpi=DPI, format="png", bbox_inches="tight")
    finally:
        plt.close(fig)
    return path
