"""A run's figures from its records: trial metrics (``trial``), the one cost model (``cost``: c and v(L) to
a modelled cost and speed), lossless at every L and the fastest lossless baseline (``lossless``), the speed a
certificate states (``speed``) and the frontier's numbers (``frontier``). Pure Python over records: no models,
no storage, no Ray, MLflow or Optuna."""
