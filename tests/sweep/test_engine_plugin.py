"""An engine joins by registration alone (issue 52): this file is a plugin, as an engine outside the project would be.
It registers ``fake-cpu`` (the CPU engine under another name, with its own traits: not the reference engine, so its
studies and references are its own) and runs a tiny sweep on it end to end, no project file changed. The pair
actors run in other processes: they import this module through ``$SPECTUNE_ENGINE_PLUGINS`` (forwarded by
``cluster.runtime.init_ray``), so the registration below runs there too."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from workers.engine_registry import PLUGINS_ENV, EngineTraits, engine_names, engine_traits, register_engine

NAME = "fake-cpu"
SMALLER = ["--items", "4", "--max-new-tokens", "4", "--trials", "1", "--budgets", "0.2", "--policies", "kl_judge",
           "--draft-len", "2"]
LOG_ENV = "SPECTUNE_TEST_FAKE_ENGINE_LOG"  # where each start of the fake engine writes a line (any process)


def fake_engine(pair: str, dtype: str, **options: Any) -> Any:
    """The CPU engine's factory under a new name; each start is written down, so the test sees the actors used it."""
    from workers.engines import cpu_engine

    engine = cpu_engine(pair, dtype, **options)
    if os.environ.get(LOG_ENV):
        with open(os.environ[LOG_ENV], "a") as f:
            f.write(f"{os.getpid()} {pair} {dtype}\n")
    return engine


register_engine(NAME, EngineTraits(measures_cost=True, exact_replay=True, batched_rows=True, fast_path=True),
                fake_engine)


def test_a_registered_engine_is_known_everywhere_a_name_is_read():
    from jobs.sweep_args import parse_args

    assert NAME in engine_names() and not engine_traits(NAME).reference
    assert parse_args(["--benchmark", "gsm8k", "--pair", "tiny-random", "--engine", NAME]).engine == NAME
    with pytest.raises(ValueError, match=f"unknown engine 'nope'; valid: cpu, vllm, openai, .*{NAME}"):
        engine_traits("nope")


@pytest.mark.slow
def test_a_tiny_sweep_runs_on_an_engine_registered_here(tmp_path, monkeypatch):
    import ray

    from jobs import sweep as sweep_job
    from tests.sweep.outputs import ARGS

    starts = tmp_path / "starts.log"
    monkeypatch.setenv(PLUGINS_ENV, __name__)  # the actors import this module: the registration above
    monkeypatch.setenv(LOG_ENV, str(starts))
    monkeypatch.setenv("SPECTUNE_LEDGER", str(tmp_path / "ledger"))
    if ray.is_initialized():  # a Ray started by an earlier test holds no plugin: this one starts with it
        ray.shutdown()
    try:
        run_dir = tmp_path / "sweep"
        # the golden sweep's flags, one trial of one rule at one L for one budget on 4 items: every phase (references,
        # search, confirmation, noise floor, timed speed) still runs on the registered engine
        rc = sweep_job.main([*ARGS, *SMALLER, "--engine", NAME, "--runs-root", str(tmp_path), "--run-dir", str(run_dir)])
    finally:
        ray.shutdown()
    assert rc == 0
    assert starts.read_text().splitlines(), "no actor started the fake engine"
    report = run_dir / "report"
    assert json.loads((report / "certification.json").read_text())["budgets"]
    chosen = sorted(report.glob("chosen-budget-*.json"))
    assert chosen and all(json.loads(p.read_text())["engine"] == NAME for p in chosen)
    # not the reference engine: its references are its own, never the CPU engine's
    stores = [p.name for p in Path(tmp_path, "references").iterdir()]
    assert len(stores) == 1 and NAME in stores[0], stores
