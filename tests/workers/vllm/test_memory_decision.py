"""The engines' memory decision on a GPU (workers.vllm.common.memory_decision) from the pair's configs and the
device's total: synthetic totals, Qwen2.5-shaped config.json files written here (main environment)."""

from __future__ import annotations

import json

import pytest

from workers.vllm.common import engine_kwargs, memory_decision, memory_shares, plan_memory_on_gpu
from workers.vllm.memory import GIB, QWEN25
from workers.vllm.settings import DEFAULT_GPU_MEMORY_UTILIZATION, VLLMSettings


def qwen_dir(tmp_path, name):
    c = QWEN25[name]
    config = {"num_hidden_layers": c["layers"], "hidden_size": c["hidden"], "num_attention_heads": c["heads"],
              "num_key_value_heads": c["kv_heads"], "intermediate_size": c["intermediate"],
              "vocab_size": c["vocab"], "tie_word_embeddings": c["tied"]}
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture
def pair_7b(tmp_path):
    return qwen_dir(tmp_path, "0.5B"), qwen_dir(tmp_path, "7B")


def test_80_gb_keeps_both_engines_resident_with_the_plans_fractions(pair_7b):
    s, plan = memory_decision(VLLMSettings(), *pair_7b, 80 * GIB)
    assert plan.mode == "both" and s.one_engine_at_a_time is False
    spec, ref = memory_shares(s, shared=True)
    assert spec == pytest.approx(plan.speculative_utilization, abs=2e-3) and ref == plan.reference_utilization
    assert spec * 80 >= plan.speculative_gib and ref * 80 >= plan.reference_gib
    assert engine_kwargs(s, pair_7b[1], pair_7b[0], shared=True)["gpu_memory_utilization"] == spec


def test_40_gb_runs_the_engines_one_at_a_time(pair_7b):
    s, plan = memory_decision(VLLMSettings(), *pair_7b, 40 * GIB)
    assert plan.mode == "one at a time" and s.one_engine_at_a_time is True
    assert memory_shares(s, shared=False) == (plan.speculative_utilization, plan.reference_utilization)


def test_24_gb_does_not_fit_a_7b_pair_and_names_the_tp(pair_7b):
    with pytest.raises(ValueError, match="does not fit a 24.0 GiB device.*use TP 2"):
        memory_decision(VLLMSettings(), *pair_7b, 24 * GIB)
    s, plan = memory_decision(VLLMSettings(tensor_parallel_size=2), *pair_7b, 24 * GIB)
    assert plan.tp == 2 and plan.mode != "does not fit"


@pytest.mark.parametrize("given", [dict(gpu_memory_utilization=0.5), dict(target_only_memory_utilization=0.3),
                                   dict(one_engine_at_a_time=True)])
def test_what_the_user_chose_wins(pair_7b, given):
    s = VLLMSettings(**given)
    assert memory_decision(s, *pair_7b, 24 * GIB) == (s, None)


def test_no_gpu_leaves_the_settings_and_the_cpu_default(pair_7b, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    s = VLLMSettings()
    assert plan_memory_on_gpu(s, *pair_7b) is s
    assert memory_shares(s, shared=False) == (DEFAULT_GPU_MEMORY_UTILIZATION, DEFAULT_GPU_MEMORY_UTILIZATION)


def test_on_a_gpu_the_plan_uses_the_devices_total_without_creating_a_context(pair_7b, monkeypatch):
    from types import SimpleNamespace

    import torch

    def no_context():
        raise AssertionError("mem_get_info creates a CUDA context this process would hold beside the engines")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", no_context)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=80 * GIB))
    assert plan_memory_on_gpu(VLLMSettings(), *pair_7b).one_engine_at_a_time is False


def test_the_plan_keeps_spectunes_extras_and_the_contexts_outside_both_shares_and_passes_max_num_seqs(pair_7b):
    """vLLM gives each engine's whole share, less its profiled peak, to the KV cache: the rules' extras (allocated
    after profiling) and three CUDA contexts must fit in what the two shares leave; the batch the plan assumed
    is the one vLLM runs (its own default on a large card is 1024, not 256)."""
    s, plan = memory_decision(VLLMSettings(), *pair_7b, 141 * GIB)
    assert plan.mode == "both" and plan.extras_gib > 0.5
    outside = 141 * (1 - plan.speculative_utilization - plan.reference_utilization)
    assert outside >= plan.headroom_gib + 3 * 0.5 + plan.extras_gib - 0.01
    assert plan.reserved_gib == pytest.approx(plan.headroom_gib + 1.5 + plan.extras_gib, abs=0.01)
    assert s.max_num_seqs == 256
    assert engine_kwargs(s, pair_7b[1], pair_7b[0], shared=True)["max_num_seqs"] == 256
    s8, _ = memory_decision(VLLMSettings(max_num_seqs=8), *pair_7b, 141 * GIB)
    assert s8.max_num_seqs == 8, "the user's batch is kept and planned for"
