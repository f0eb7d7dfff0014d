"""Pair actors on a real local Ray (2 CPUs): items stream through Ray Data, an actor that dies
mid-trial loses nothing, early stop works."""

from __future__ import annotations

import threading

import pytest
import ray

from cluster.pair_actor import item_from_json, item_to_json, make_workers, run_trial
from cluster.runtime import init_ray
from workers.benchmarks import get_benchmark
from workers.evaluation import DecodeSpec

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def workers():
    init_ray(num_cpus=2)
    # half a CPU each: the kill test below starts two more actors on this 2-CPU cluster
    return make_workers(2, "tiny-random", "fp32", cpus_per_actor=0.5)


@pytest.fixture(scope="module")
def items():
    return get_benchmark("gsm8k").items(limit=8)


def spec(**kw):
    return DecodeSpec.make("kl_judge", {"threshold": 1.0}, 3, max_new_tokens=kw.get("max_new_tokens", 6))


def test_items_round_trip_through_json(items):
    assert all(item_from_json(item_to_json(it)) == it for it in items)


def test_every_item_is_evaluated_exactly_once_by_the_actors(workers, items):
    run = run_trial(workers, "once", "gsm8k", spec(), items, {})
    assert sorted(run.records) == sorted(it.id for it in items)
    assert not run.actor_failures and run.retried_items == 0
    done = [info["items_done"] for info in ray.get([w.info.remote() for w in workers])]
    assert all(n > 0 for n in done), f"both actors took shards: {done}"
    loads = {info["pid"]: info["load_s"] for info in ray.get([w.info.remote() for w in workers])}
    run_trial(workers, "again", "gsm8k", spec(), items, {})
    after = {info["pid"]: info["load_s"] for info in ray.get([w.info.remote() for w in workers])}
    assert after == loads, "actors keep their pair across trials (same processes, loaded once)"


def test_early_stop_ends_the_trial(workers, items):
    seen = []
    run = run_trial(workers, "stop", "gsm8k", spec(max_new_tokens=12), items, {},
                    on_record=lambda r: seen.append(r) or len(seen) >= 2)
    assert run.stopped_early
    assert len(run.records) < len(items)


def kill_mid_trial(workers, victim, items, *, restart: bool, **kw):
    """Run a trial in a thread, kill ``victim`` once the first record is in, return the trial's outcome."""
    first = threading.Event()

    def on_record(_):
        first.set()
        return False

    result = {}
    th = threading.Thread(target=lambda: result.setdefault("run", run_trial(
        workers, "kill", "gsm8k", spec(max_new_tokens=48), items, {}, on_record=on_record, **kw)))
    th.start()
    assert first.wait(120), "no record arrived"
    ray.kill(victim, no_restart=not restart)
    th.join(300)
    return result["run"]


def test_killed_actor_loses_neither_the_items_nor_the_trial(items):
    init_ray(num_cpus=2)
    victims = make_workers(2, "tiny-random", "fp32", cpus_per_actor=0.5)
    run = kill_mid_trial(victims, victims[1], items, restart=False)
    assert sorted(run.records) == sorted(it.id for it in items), "every item still has a record"
    assert run.actor_failures, "the dead actor is recorded as a failure"
    assert all(not r.failed for r in run.records.values())


def test_an_actor_ray_restarts_keeps_the_trial_going(items):
    """Killed with a restart allowed (what Ray's memory monitor does): the only actor comes back and the
    trial finishes on it instead of failing with "every pair actor failed"."""
    init_ray(num_cpus=2)
    (victim,) = make_workers(1, "tiny-random", "fp32", cpus_per_actor=0.5)
    run = kill_mid_trial([victim], victim, items, restart=True, shard_size=2)
    assert sorted(run.records) == sorted(it.id for it in items), "every item still has a record"
    assert run.actor_failures and all(not r.failed for r in run.records.values())


def test_batched_actors_make_batch_1_records_for_shards_bundles_and_timing(items):
    """An actor with ``batch_size`` 3 (the batched CPU engine): a trial's shards, the lossless bundles and a timed run
    at concurrency 3 make the records batch 1 makes, token for token; each says its batch."""
    from cluster.pair_actor import release
    from cluster.pool import run_bundles
    from workers.evaluation import TARGET_ONLY

    init_ray(num_cpus=2)
    (batched,) = make_workers(1, "tiny-random", "int8", cpus_per_actor=0.5, batch_size=3)
    (alone,) = make_workers(1, "tiny-random", "int8", cpus_per_actor=0.5)
    try:
        assert ray.get(batched.batch.remote("gsm8k", items, spec()))["batch_size"] == 3
        assert ray.get(alone.batch.remote("gsm8k", items, spec()))["batch_size"] == 1  # the default: batch 1
        runs = [run_trial([w], f"batch-{i}", "gsm8k", spec(max_new_tokens=12), items, {}, shard_size=3)
                for i, w in enumerate((batched, alone))]
        for r in runs[0].records.values():
            twin = runs[1].records[r.item_id]
            assert r.output_token_ids == twin.output_token_ids and (r.batch, twin.batch) == (3, 1)
        specs = [DecodeSpec.make("lossless", {}, n, max_new_tokens=12) for n in (1, 3)]
        got: list[list] = [[], []]
        for i, w in enumerate((batched, alone)):
            run_bundles([w], "gsm8k", specs, items[:5], {}, got[i].append, chunk=3)
        outputs = [{per[0].item_id: [r.output_token_ids for r in per] for per in side} for side in got]
        assert outputs[0] == outputs[1] and len(outputs[0]) == 5, "each item's records, one per L, as at batch 1"
        assert {r.batch for per in got[0] for r in per} == {3}
        timing = [DecodeSpec.make(TARGET_ONLY, max_new_tokens=12), spec(max_new_tokens=12)]
        arms, walls = ray.get(alone.time_concurrent.remote("gsm8k", timing, items[:6], 3))
        assert [len(a) for a in arms] == [6, 6] and all(w > 0 for w in walls)
        assert all(r.batch == 3 for arm in arms for r in arm), "concurrency 3: the chunk's items as 3 rows"
        assert [r.output_token_ids for r in arms[1]] == [runs[1].records[it.id].output_token_ids for it in items[:6]]
    finally:
        release([batched, alone])
