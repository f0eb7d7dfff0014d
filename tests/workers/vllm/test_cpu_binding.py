"""vLLM-CPU's thread binding as the vLLM engine sets it (no vLLM needed): from the CPUs this process
may use, a Ray actor's share of them, one list per tensor-parallel rank, and never over a user's value."""

from __future__ import annotations

import os

import pytest

from workers.vllm.settings import CPU_BIND_ENV, VLLMSettings, cpu_thread_binding, set_cpu_thread_binding


def test_binding_follows_the_allowed_cpus():
    assert cpu_thread_binding(allowed=[0, 1]) == "0-1"
    assert cpu_thread_binding(allowed=[0, 1, 2, 3, 6, 7]) == "0-3,6-7"
    assert cpu_thread_binding(allowed=[5]) == "5"
    assert cpu_thread_binding() == cpu_thread_binding(allowed=sorted(os.sched_getaffinity(0)))


def test_an_actor_takes_its_share_and_ranks_split_it():
    cpus = list(range(8))
    assert cpu_thread_binding(2, 0, allowed=cpus) == "0-1"
    assert cpu_thread_binding(2, 2, allowed=cpus) == "2-3", "the second actor of 2 CPUs each"
    assert cpu_thread_binding(2, 7, allowed=cpus) == "0,7", "wraps around"
    assert cpu_thread_binding(16, 0, allowed=[0, 1]) == "0-1", "never more than allowed"
    assert cpu_thread_binding(None, 0, tensor_parallel_size=2, allowed=cpus) == "0-3|4-7"
    assert cpu_thread_binding(None, 0, tensor_parallel_size=2, allowed=[3]) == "3|3", "each rank gets a CPU"


def test_the_engine_sets_it_unless_the_user_did():
    env: dict[str, str] = {}
    got = set_cpu_thread_binding(VLLMSettings(num_cpus=1), env)
    assert env[CPU_BIND_ENV] == got == cpu_thread_binding(1)
    # its own earlier value is not a user's: a second engine with other settings recomputes it
    assert set_cpu_thread_binding(VLLMSettings(), env) == cpu_thread_binding()
    user = {CPU_BIND_ENV: "0"}
    assert set_cpu_thread_binding(VLLMSettings(), user) == "0" and user == {CPU_BIND_ENV: "0"}
    nobind = {CPU_BIND_ENV: "nobind"}
    assert set_cpu_thread_binding(VLLMSettings(num_cpus=1), nobind) == "nobind"


def test_settings_validate_the_new_knobs():
    with pytest.raises(ValueError, match="num_cpus"):
        VLLMSettings(num_cpus=0)
    with pytest.raises(ValueError, match="cpu_offset"):
        VLLMSettings(cpu_offset=-1)
    with pytest.raises(ValueError, match="kv_cache_memory_bytes"):
        VLLMSettings(kv_cache_memory_bytes=0)


def test_step_timeout_raised_on_cpu_unless_the_user_set_it():
    """vLLM kills its engine when one step runs past VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS (300 s); a
    4096-token CPU prefill chunk in emulated bf16 takes longer, so vLLM-CPU engines get an hour."""
    from workers.vllm.settings import CPU_STEP_TIMEOUT_S, STEP_TIMEOUT_ENV, set_step_timeout

    env: dict = {}
    assert set_step_timeout(VLLMSettings(), on_cpu=True, environ=env) == str(CPU_STEP_TIMEOUT_S)
    assert set_step_timeout(VLLMSettings(), on_cpu=False, environ={}) is None  # GPUs: vLLM's default
    user = {STEP_TIMEOUT_ENV: "120"}
    assert set_step_timeout(VLLMSettings(), on_cpu=True, environ=user) == "120"
    assert set_step_timeout(VLLMSettings(step_timeout_s=900), on_cpu=False, environ=user) == "900"
    with pytest.raises(ValueError, match="step_timeout_s"):
        VLLMSettings(step_timeout_s=0)
