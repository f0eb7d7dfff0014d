"""Pictures and reports of a sweep: Pareto fronts, the quality-constrained speedup table,
acceptance-length histograms and per-position acceptance, and the markdown report that ties them
together.

Everything here works from plain polars frames (one row per Optuna trial) and plain lists of
acceptance counts, so the artifacts a sweep logs to MLflow can be rebuilt offline from a saved
``trials.parquet`` (``python -m dashboards.report --help``). This package knows nothing about
Ray, Optuna or MLflow: the sweep (``sweep.report``) calls it and logs what it writes.

- ``frames``: the trials-frame schema, normalisation, the "completed and finite" filter.
- ``pareto``: the non-dominated front and its plot.
- ``tables``: per-budget winners (long and wide), parameter formatting, markdown rendering.
- ``acceptance``: accepted-length histograms derived from per-position counts, and their plots.
- ``report``: ``write_report`` (every artifact into one folder) and its CLI.
- ``frontier``: the frontier page (``frontier.md``, ``frontier.json``) from its computed numbers.
- ``flips``: the flipped items page (``flips.md``), both outputs side by side.
"""
