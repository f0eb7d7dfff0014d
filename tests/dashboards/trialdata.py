"""Hand-made trials frames for the dashboard tests: every metric is chosen, so fronts and budget
winners are known by construction."""

from __future__ import annotations

import json
import math
from pathlib import Path

import polars as pl

NAN = math.nan
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def trial(n: int, family: str, speedup: float, accuracy: float, *, state: str = "COMPLETE",
          reference: float = 0.62, params: dict | None = None, draft_len: int = 5,
          ci: float = 0.02) -> dict:
    """One trials-frame row; accuracy_drop = reference - accuracy, CI = drop +- ``ci``."""
    drop = reference - accuracy
    return {
        "trial": n, "family": family, "params": json.dumps(params or {}, sort_keys=True), "draft_len": draft_len,
        "state": state, "items": 100, "accuracy": accuracy, "accuracy_drop": drop,
        "accuracy_drop_ci_lo": drop - ci, "accuracy_drop_ci_hi": drop + ci,
        "speedup_vs_ar_modelled": speedup, "speedup_vs_ar_measured": 0.9 * speedup,
        "speedup_vs_lossless_modelled": speedup / 1.5, "speedup_vs_lossless_measured": 0.9 * speedup / 1.5,
        "mean_acceptance_length": 1 + speedup, "draft_acceptance_rate": 0.5,
    }


def frame(*rows: dict) -> pl.DataFrame:
    return pl.DataFrame(list(rows), schema_overrides={"accuracy_drop_ci_lo": pl.Float64,
                                                      "accuracy_drop_ci_hi": pl.Float64})


def sweep() -> pl.DataFrame:
    """A small sweep with a known front and known budget winners (reference accuracy 0.62):

    front, by speedup: 0 lossless (1.5, 0.62), 1 kl_judge (1.9, 0.61), 4 top_k (2.4, 0.57).
    dominated: 2 kl_judge (1.8, 0.60), 3 top_k (1.9, 0.59). pruned-only family: dropmatch (5).
    failed: 6 top_k. completed with a NaN speedup: 7 typical (never ranked, never on the front).
    """
    return frame(
        trial(0, "lossless", 1.5, 0.62),
        trial(1, "kl_judge", 1.9, 0.61, params={"threshold": 0.5, "confidence": 0.9}),
        trial(2, "kl_judge", 1.8, 0.60, params={"threshold": 0.3, "confidence": 0.9}),
        trial(3, "top_k", 1.9, 0.59, params={"k": 4}, draft_len=6),
        trial(4, "top_k", 2.4, 0.57, params={"k": 8}, draft_len=6),
        trial(5, "dropmatch", 3.0, 0.40, state="PRUNED", params={"k": 5, "p_drop": 0.3, "criterion": "js"}),
        trial(6, "top_k", NAN, NAN, state="FAIL", params={"k": 16}),
        trial(7, "typical", NAN, 0.62, params={"epsilon": 0.1, "delta": 0.3}),
    )


def assert_png(path: Path) -> None:
    data = Path(path).read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path} is not a PNG (starts with {data[:8]!r})"
    assert len(data) > 1024, f"{path} is only {len(data)} bytes: an empty canvas, not a plot"
