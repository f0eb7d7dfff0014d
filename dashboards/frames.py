"""The trials frame: its columns, normalisation, and the filters every view shares.

One row per Optuna trial, as ``jobs/sweep.py`` builds it. Pruned and failed trials keep their row
with null/NaN metrics, so every consumer must filter before ranking; ``completed`` is that filter.
"""

from __future__ import annotations

import json

import polars as pl

COMPLETE, PRUNED, FAIL = "COMPLETE", "PRUNED", "FAIL"

# Every column a view may read. Missing ones are added as nulls so that an empty sweep (even a
# frame with no columns at all) or an older frame still renders instead of raising.
TRIAL_SCHEMA: dict[str, pl.DataType] = {
    "trial": pl.Int64(),
    "family": pl.String(),
    "params": pl.String(),
    "draft_len": pl.Int64(),
    "state": pl.String(),
    "items": pl.Int64(),
    "accuracy": pl.Float64(),
    "accuracy_drop": pl.Float64(),
    "accuracy_drop_ci_lo": pl.Float64(),
    "accuracy_drop_ci_hi": pl.Float64(),
    "speedup_vs_ar_modelled": pl.Float64(),
    "speedup_vs_ar_measured": pl.Float64(),
    "speedup_vs_lossless_modelled": pl.Float64(),
    "speedup_vs_lossless_measured": pl.Float64(),
    "mean_acceptance_length": pl.Float64(),
    "draft_acceptance_rate": pl.Float64(),
}


def normalise_trials(trials: pl.DataFrame) -> pl.DataFrame:
    """Return ``trials`` with every ``TRIAL_SCHEMA`` column present and of its dtype (extra
    columns kept, known ones first). Raises ValueError naming a column that cannot be cast."""
    if not trials.columns:
        # A frame with no columns at all (an empty sweep): selecting literals would make one row.
        return pl.DataFrame(schema=TRIAL_SCHEMA)
    exprs = []
    for name, dtype in TRIAL_SCHEMA.items():
        if name not in trials.columns:
            exprs.append(pl.lit(None, dtype=dtype).alias(name))
            continue
        try:
            trials.select(pl.col(name).cast(dtype, strict=True))
        except Exception as err:  # polars raises several error types for a bad cast
            raise ValueError(f"trials column {name!r} cannot be read as {dtype}: {err}") from err
        exprs.append(pl.col(name).cast(dtype))
    extra = [c for c in trials.columns if c not in TRIAL_SCHEMA]
    return trials.select(*exprs, *extra)


def finite(*columns: str) -> pl.Expr:
    """True where every column is neither null nor NaN (polars treats those two differently)."""
    expr = pl.lit(True)
    for c in columns:
        expr = expr & pl.col(c).is_not_null() & pl.col(c).cast(pl.Float64).is_finite()
    return expr


def completed(trials: pl.DataFrame, *columns: str) -> pl.DataFrame:
    """COMPLETE trials whose ``columns`` are all finite (a completed trial can still carry a NaN
    speedup, e.g. when no item paired with the reference)."""
    trials = normalise_trials(trials)
    return trials.filter((pl.col("state") == COMPLETE) & finite(*columns))


def for_csv(df: pl.DataFrame) -> pl.DataFrame:
    """CSV holds no nested values: list/struct columns become JSON strings."""
    nested = [c for c, t in df.schema.items() if t.is_nested()]
    return df.with_columns(
        pl.col(c).map_elements(lambda v: json.dumps(v.to_list() if isinstance(v, pl.Series) else v),
                               return_dtype=pl.String)
        for c in nested)
