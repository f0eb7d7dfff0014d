"""The commands: what users run (``sweep``, ``evaluate``, ``plan``, ``serve``, ``tracking``) and what a sweep
is made of (``sweep_args``, ``search_space``, ``confirm``, ``records``, ``progress``). Measurement scripts
live in ``jobs.bench``. The only floor that imports Optuna (``sweep``, ``search_space``, ``sweep_args``)
and MLflow (``tracking``)."""
