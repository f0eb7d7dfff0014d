"""The GPU check's parts; ``python -m jobs.gpu_check`` is the command (its docstring says what it checks)."""
