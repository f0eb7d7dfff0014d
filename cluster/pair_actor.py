"""Long-lived pair actors and the streaming of benchmark shards through them.

A ``PairWorker`` loads its draft/target pair ONCE (in ``__init__``) and keeps it across trials.
Per trial, the items become a ``ray.data`` Dataset split into small shards that idle actors take
one at a time, so the driver sees records shard by shard and can stop a trial early. A dead or
failing actor does not stall the trial: its shard is re-queued for a live actor and the failure
is recorded. (``streaming_split`` was the first design: its consumers are coordinated, so one
dead consumer can block the others — a failure mode a sweep cannot afford.)

Knows workers/ (engine, evaluation) and Ray; knows nothing about Optuna or MLflow.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray

from workers.benchmarks import Item, get_benchmark
from workers.engine_registry import engine_traits
from workers.evaluation import DecodeSpec, Record, evaluate_bundle, evaluate_item

# max_concurrency=2: a trial's stop() must run while consume() is busy in the other thread.
RESTART_WAIT_S = 900.0  # how long an actor Ray is restarting may take to come back (a vLLM engine start is minutes)


@ray.remote(max_restarts=2, max_task_retries=0, max_concurrency=2)
class PairWorker:
    """Hosts one pair (loaded once) and evaluates items with any DecodeSpec."""

    def __init__(self, pair: str, dtype: str = "bf16", cache_dir: str | None = None, num_threads: int | None = None,
                 tensor_parallel_size: int = 1, engine: str = "cpu", draft_len: int = 5,
                 vllm: dict[str, Any] | None = None, batch_size: int | str = 1) -> None:
        from cluster.startup import attach

        attach()  # the start's progress lines go to the driver (cluster.startup)
        import torch

        from workers.engines import make_engine

        self.traits = engine_traits(engine)  # what the engine can do, never its name (workers.engine_registry)
        if num_threads and not self.traits.needs_server:
            torch.set_num_threads(num_threads)
        t0 = time.perf_counter()
        self.pair_name = pair
        self.engine_kind = engine
        self.engine = make_engine(engine, pair, dtype, cache_dir=cache_dir, draft_len=draft_len,
                                  tensor_parallel_size=tensor_parallel_size, vllm=vllm)
        if self.traits.batched_rows:  # the batched engine's rows per call (workers.cpu_batch); "auto": measured later
            self.engine.batch_size = batch_size
        self.load_s = time.perf_counter() - t0
        self.items_done = 0
        self._stop: set[str] = set()

    def info(self) -> dict[str, Any]:
        engine_pids = [w["pid"] for w in self.engine.worker_env()] if hasattr(self.engine, "worker_env") else []
        return {"pair": self.pair_name, "engine": self.engine_kind, "pid": os.getpid(), "load_s": self.load_s,
                "items_done": self.items_done, "engine_pids": engine_pids,
                "node": ray.get_runtime_context().get_node_id()}

    def close(self) -> None:
        """Stop the engine's own processes (vLLM's engine core and workers) before the actor goes: a
        killed actor leaves them running, holding the pair's memory."""
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()

    def stop(self, tag: str) -> None:
        """Ask a running ``consume`` for trial ``tag`` to stop after its current item."""
        self._stop.add(tag)

    def profile(self, benchmark: str | None = None, items: list[Item] | None = None,
                spec: DecodeSpec | None = None) -> dict[str, Any]:
        """This pair's cost profile on this node (measured once, then read from the pair cache), timed at the
        context ``items`` decode at under ``spec`` (their median prompt plus half the new tokens,
        ``workers.models.calibrate.workload_context``), or at the default one without them."""
        if not self.traits.measures_cost:
            return self.engine.profile()  # c is not measurable here: the sweep asks for --cost-ratio
        from workers.evaluation import workload_profile
        from workers.models.calibrate import get_profile

        if benchmark is not None and items and spec is not None:
            return workload_profile(self.engine.pair, get_benchmark(benchmark), list(items), spec).to_json()
        return get_profile(self.engine.pair).to_json()

    def batch(self, benchmark: str, items: list[Item], spec: DecodeSpec) -> dict[str, Any]:
        """The rows this actor's CPU engine decodes at once (``auto`` measured now, at the context ``items`` decode
        at under ``spec``) and how it chose; 1 on other engines."""
        if not self.traits.batched_rows:
            return {"batch_size": 1}
        from workers.evaluation import items_context

        context = items_context(self.engine.pair, get_benchmark(benchmark), list(items), spec)
        size = self.engine.batcher(context=context).size
        return {"batch_size": size, "choice": getattr(self.engine, "batch_choice", None)}

    def evaluate(self, benchmark: str, spec: DecodeSpec, item: Item, references: dict[str, Any]) -> Record:
        """One item; ``references[item.id]``: the target-only outputs, or their record's replay payload
        (``workers.evaluation.reference_payload``: the rule is then replayed at T = 0)."""
        record = evaluate_item(self.engine, get_benchmark(benchmark), item, spec, references.get(item.id))
        self.items_done += 1
        return record

    def evaluate_bundle(self, benchmark: str, specs: list[DecodeSpec], items: list[Item], references: dict[str, Any]
                        ) -> list[list[Record]]:
        """Each item under every spec, one teacher-forced pass per item where they replay (CPU engine;
        ``workers.evaluation.evaluate_bundle``): per item, the records in ``specs``' order."""
        bench = get_benchmark(benchmark)
        if self.traits.batched_rows:  # batched where the engine's batch size says so, row for row exact
            out = self.engine.evaluate_bundles(bench, list(items), specs, references)
        else:
            out = [evaluate_bundle(self.engine, bench, item, specs, references.get(item.id)) for item in items]
        self.items_done += len(items) * len(specs)
        return out

    def time_items(self, benchmark: str, specs: list[DecodeSpec], items: list[Item]) -> list[list[Record]]:
        """Like-for-like timing: each item under every spec in turn, decoded in full (no replay), one request at a
        time (batch 1 on either engine), before the next item; the records per spec, in item order."""
        bench = get_benchmark(benchmark)
        out: list[list[Record]] = [[] for _ in specs]
        for item in items:
            for arm, spec in zip(out, specs, strict=True):
                if self.traits.batches_shards:
                    arm.append(self.engine.evaluate_items(bench, [item], spec, {})[0])
                else:
                    arm.append(evaluate_item(self.engine, bench, item, spec))
        return out

    def time_concurrent(self, benchmark: str, specs: list[DecodeSpec], items: list[Item], concurrency: int
                        ) -> tuple[list[list[Record]], list[float]]:
        """Like-for-like timing at a concurrency: the items in chunks; in each chunk every spec in turn (the one
        that goes first rotating), its requests ``concurrency`` at a time: a server's clients keep that many in
        flight (``EndpointEngine.time_concurrent``), the vLLM engine decodes each group of ``concurrency`` items as
        one batch, the CPU engine as that many rows of its batched engine (``workers.cpu_batch``; rows in turn off
        the fast path). The records per spec in item order, and each spec's wall seconds over its own chunks."""
        bench = get_benchmark(benchmark)
        timer = getattr(self.engine, "time_concurrent", None)
        if timer is not None and not self.traits.batched_rows:
            return timer(bench, specs, items, concurrency)
        if not (self.traits.batched_rows or self.traits.batches_shards):
            raise ValueError(f"the {self.engine_kind} engine decodes one request at a time: no concurrency to time")
        import time

        from workers.metrics.speed import rotation

        out: list[list[Record]] = [[] for _ in specs]
        walls = [0.0] * len(specs)
        for k, start in enumerate(range(0, len(items), concurrency)):
            group = items[start: start + concurrency]
            for j in rotation(k, len(specs)):
                t0 = time.perf_counter()
                if self.traits.batched_rows:  # the group as the batched engine's rows, decoded in full
                    out[j].extend(self.engine.evaluate_items(bench, group, specs[j], {}, batch_size=concurrency))
                else:
                    out[j].extend(self.engine.evaluate_items(bench, group, specs[j], {}))
                walls[j] += time.perf_counter() - t0
        return out, walls

    def consume(self, tag: str, benchmark: str, spec: DecodeSpec, shard: Any, references: dict[str, list[str]]
                ) -> list[Record]:
        """Evaluate one shard (a small Ray Data dataset of items); stop early if asked. On the vLLM
        engine the whole shard is one batched ``generate`` (continuous batching), per-item records."""
        if self.traits.batches_shards:
            if tag in self._stop:
                return []
            return self.evaluate_list(benchmark, spec, [item_from_json(row["item"]) for row in shard.iter_rows()],
                                      references)
        items = [item_from_json(row["item"]) for row in shard.iter_rows()]
        if self.traits.batched_rows and self.engine.batch_size != 1:  # the shard's items as batched rows
            records = self.engine.evaluate_items(get_benchmark(benchmark), items, spec, references,
                                                 stop=lambda: tag in self._stop)
            self.items_done += len(records)
            return records
        records = []
        for item in items:
            if tag in self._stop:
                break
            records.append(self.evaluate(benchmark, spec, item, references))
        return records

    def evaluate_list(self, benchmark: str, spec: DecodeSpec, items: list[Item], references: dict[str, list[str]]
                      ) -> list[Record]:
        if self.traits.batches_shards:  # replay is the CPU engine's: vLLM takes the outputs alone
            references = {k: v["outputs"] if isinstance(v, dict) else v for k, v in references.items()}
            records = self.engine.evaluate_items(get_benchmark(benchmark), items, spec, references)
            self.items_done += len(records)
            return records
        if self.traits.batched_rows and self.engine.batch_size != 1:
            records = self.engine.evaluate_items(get_benchmark(benchmark), list(items), spec, references)
            self.items_done += len(records)
            return records
        return [self.evaluate(benchmark, spec, item, references) for item in items]


def item_to_json(item: Item) -> str:
    return json.dumps(dataclasses.asdict(item))


def item_from_json(text: str) -> Item:
    data = json.loads(text)
    data["turns"] = tuple(data["turns"])
    return Item(**data)


@dataclass
class TrialRun:
    """What streaming one trial produced."""

    records: dict[str, Record] = field(default_factory=dict)
    stopped_early: bool = False
    actor_failures: list[str] = field(default_factory=list)
    retried_items: int = 0
    wall_s: float = 0.0


def make_workers(n: int, pair: str, dtype: str, *, cpus_per_actor: float = 1, gpus_per_actor: float = 0,
                 cache_dir: str | None = None, tensor_parallel_size: int = 1, engine: str = "cpu",
                 draft_len: int = 5, vllm: dict[str, Any] | None = None, python: str | None = None,
                 batch_size: int | str = 1) -> list[Any]:
    """``n`` loaded pair actors. ``python``: the interpreter they run in (the vLLM engine's own
    environment, see ``workers.engines.vllm_python``); None = the driver's."""
    threads = max(1, int(cpus_per_actor))

    def engine_options(i: int) -> dict[str, Any] | None:
        if not engine_traits(engine).takes_vllm_settings:
            return vllm  # openai: the server's Endpoint fields
        # vLLM-CPU binds its threads to this actor's share of the node's CPUs (ignored on GPU builds)
        return {"num_cpus": threads, "cpu_offset": i * threads, **(vllm or {})}

    runtime_env = {"py_executable": python} if python else None
    workers = [PairWorker.options(num_cpus=cpus_per_actor, num_gpus=gpus_per_actor, runtime_env=runtime_env).remote(
        pair, dtype, cache_dir, threads, tensor_parallel_size, engine, draft_len, engine_options(i), batch_size)
        for i in range(n)]
    ray.get([w.info.remote() for w in workers])  # surface load errors now, not mid-trial
    return workers


def profile_of(worker: Any, benchmark: str | None = None, items: list[Item] | None = None,
               spec: DecodeSpec | None = None) -> dict[str, Any]:
    """The pair's calibration as the actor's engine measured it (c, verify pass timings, machine, load, context),
    at the context of ``items`` under ``spec`` where given (:meth:`PairWorker.profile`)."""
    return ray.get(worker.profile.remote(benchmark, items, spec))


def release(workers: list[Any], timeout_s: float = 60) -> None:
    """End the actors now (rather than whenever their handles are collected), each after its engine
    stopped its own processes (a dead or stuck actor is killed all the same)."""
    closing = [w.close.remote() for w in workers]
    try:
        ray.wait(closing, num_returns=len(closing), timeout=timeout_s)
    except Exception:  # noqa: BLE001 - best effort: the kill below is what must happen
        pass
    for w in workers:
        ray.kill(w)


def make_shards(rows: list[dict[str, Any]], size: int) -> list[Any]:
    """``rows`` as Ray Data datasets of ``size`` rows each, already in the object store.

    One ``from_items`` per shard rather than ``from_items(...).split(n)``: ``split`` goes through
    ``Dataset._execute``, which warns "the Dataset job will hang unless more CPUs are freed up"
    whenever no CPU is free, and here none is by design (the pair actors reserve them all). The
    warning is a false alarm for these datasets (their blocks are put by the driver, no Ray Data
    task ever runs) and no DataContext or ExecutionOptions setting reaches that check (Ray 2.60),
    so the shards are built without it. Same blocks, same streaming, no warning."""
    return [ray.data.from_items(rows[i:i + size], override_num_blocks=1) for i in range(0, len(rows), size)]


def run_trial(workers: list[Any], tag: str, benchmark: str, spec: DecodeSpec, items: list[Item],
              references: dict[str, list[str]], on_record: Callable[[Record], bool] | None = None,
              timeout_s: float | None = None, shard_size: int | None = None) -> TrialRun:
    """Evaluate ``items`` on ``workers``, shard by shard.

    The items become a Ray Data dataset split into small shards; each idle actor takes the next
    shard, so fast actors take more. ``on_record`` runs on the driver for every record and
    returns True to stop the trial early (no new shards go out; running ones stop after their
    current item). A shard whose actor dies is re-queued for a live actor and the failure is
    recorded; an actor Ray restarts (``max_restarts``) stays in use, its shard retried with backoff for
    up to ``RESTART_WAIT_S``; a trial fails only when no actor is left.
    """
    t0 = time.perf_counter()
    out = TrialRun()
    if not items:
        return out
    size = shard_size or max(1, min(8, math.ceil(len(items) / (2 * len(workers)))))
    rows = [{"item_id": item.id, "item": item_to_json(item)} for item in items]  # JSON: an Arrow-native column
    n_shards = math.ceil(len(rows) / size)
    shards = make_shards(rows, size)
    queue_: deque[int] = deque(range(n_shards))
    refs = ray.put(references)
    live = list(workers)
    running: dict[Any, tuple[Any, int]] = {}
    back_at: dict[int, float] = {}  # id(actor) -> when an actor Ray is restarting may be tried again
    gone_since: dict[int, float] = {}  # id(actor) -> when it first became unavailable (cleared once it answers)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while queue_ or running:
        now = time.monotonic()
        while queue_ and not out.stopped_early:
            idle = [w for w in live if all(w is not v[0] for v in running.values()) and back_at.get(id(w), 0.0) <= now]
            if not idle:
                break
            shard_id = queue_.popleft()
            running[idle[0].consume.remote(tag, benchmark, spec, shards[shard_id], refs)] = (idle[0], shard_id)
        if not running:
            if queue_ and not out.stopped_early and back_at:  # only restarting actors left: wait for the first
                time.sleep(max(0.05, min(back_at.values()) - time.monotonic()))
                continue
            break
        wait = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, _ = ray.wait(list(running), num_returns=1, timeout=wait)
        if not ready:
            out.actor_failures.append(f"trial timed out after {timeout_s:.0f}s with {len(running)} shard(s) running")
            break
        worker, shard_id = running.pop(ready[0])
        try:
            records = ray.get(ready[0])
        except ray.exceptions.RayError as err:
            out.actor_failures.append(f"shard {shard_id}: {type(err).__name__}: {str(err).splitlines()[0][:200]}")
            # an actor Ray is restarting (its memory monitor killed it, say) comes back within its max_restarts
            # and a model load: keep it, try again with backoff for up to RESTART_WAIT_S; one that died for
            # good, or does not come back, is dropped
            now = time.monotonic()
            first = gone_since.setdefault(id(worker), now)
            restarting = isinstance(err, ray.exceptions.ActorUnavailableError) and now - first < RESTART_WAIT_S
            if restarting:
                back_at[id(worker)] = now + min(30.0, 1.0 + 0.5 * (now - first))
            elif isinstance(err, ray.exceptions.RayActorError):
                live = [w for w in live if w is not worker]
                back_at.pop(id(worker), None)
            if not live:
                raise RuntimeError(f"trial {tag}: every pair actor failed; last error: {err}") from err
            queue_.appendleft(shard_id)
            out.retried_items += shards[shard_id].count()
            continue
        gone_since.pop(id(worker), None)
        back_at.pop(id(worker), None)
        for record in records:
            if record.item_id in out.records:
                continue
            out.records[record.item_id] = record
            if on_record is not None and not out.stopped_early and on_record(record):
                out.stopped_early = True
                queue_.clear()
                for w in live:
                    w.stop.remote(tag)
    out.wall_s = time.perf_counter() - t0
    return out
