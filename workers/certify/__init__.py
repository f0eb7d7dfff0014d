"""Where a certificate is decided: "the rule's accuracy drop is <= b with probability >= 1 - alpha".

- ``decide``: the claim itself: search/confirmation splits, early stopping, the fixed-sequence
  confirmation of several candidates per budget, the sample-size planner.
- ``bounds``: the numbers under it: one-sided upper bounds on a paired drop (exact Buehler bound,
  Tango's score bound, betting bounds for [0, 1] scores).

Pure Python and torch over per-item scores in [0, 1]: nothing here knows models, engines, Ray,
Optuna, MLflow or where records are stored. ``jobs.confirm`` runs the confirmation with it; the
report, the planner and Serve read its decisions.
"""
