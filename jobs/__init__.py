"""The commands: what users run (``sweep``, ``evaluate``, ``plan``, ``serve``, ``results``, ``export_rule``,
``gpu_check``, ``tracking``), each a parse, one library call and a print; measurement scripts in
``jobs.bench`` and the GPU checks' parts in ``jobs.gpu``. The sweep itself is the ``sweep`` package."""
