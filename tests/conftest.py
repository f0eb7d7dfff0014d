"""Test-suite switches.

Real-model tests (``@pytest.mark.real``) need the fetched Qwen pair and take minutes on this CPU,
so a bare ``pytest`` deselects them (and pytest reports how many); ``make test`` — the README's
and CI's command — sets ``SPECTUNE_REAL=1`` and runs them. Any explicit ``-m`` expression also
decides for itself. They are never skipped for missing assets: they fail with the AssetError that
names the fetch command.
"""

from __future__ import annotations

import os


def pytest_collection_modifyitems(config, items):
    if config.getoption("markexpr") or os.environ.get("SPECTUNE_REAL") == "1":
        return
    drop = [item for item in items if item.get_closest_marker("real")]
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = [item for item in items if item.get_closest_marker("real") is None]
