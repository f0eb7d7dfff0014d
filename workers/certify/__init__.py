"""Where a certificate is decided: "the rule's accuracy drop is <= b with probability >= 1 - alpha".

- ``decide``: the claim itself: search/confirmation splits, early stopping, the fixed-sequence
  confirmation of several candidates per budget, the sample-size planner.
- ``exact``: the decision for right/wrong scores: ``certify_paired``, an exact unconditional test of
  "the drop is at least b" (type-I error <= alpha at every n, checked by enumeration), its p-value and
  the bound it implies; ``refute.refute_paired``, its mirror: "the drop is at most b" rejected (a budget refuted).
- ``bounds``: betting bounds for scores in [0, 1] and the planner's arithmetic.

Pure Python, torch, numpy and scipy over per-item scores in [0, 1]: nothing here knows models, engines, Ray,
Optuna, MLflow or where records are stored. ``sweep.confirm`` runs the confirmation with it; the
report, the planner and Serve read its decisions.
"""
