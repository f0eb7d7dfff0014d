"""The actor pool for the sweep's two other kinds of work, beside ``pair_actor.run_trial``'s shards:

- :func:`run_bundles`: lossless at every L of a range on the search items, one teacher-forced pass per item
  for all of them (``PairWorker.evaluate_bundle``), a few items per call on whichever actor is free; a chunk
  whose actor died goes back on the queue for a live actor, and only when none is left does the call fail;
- :func:`batch_choices`: each actor's batch size for a workload (``PairWorker.batch``), asked once per sweep;
- :func:`time_items`: a candidate's timed items, like for like, on one actor (``PairWorker.time_items``): the
  load before and after, and a lost actor reported as the timing's error, never raised.

Ray calls live here and in ``pair_actor``; the caller keeps the records (its stores, its progress line).
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import ray

from workers.benchmarks.base import Item
from workers.evaluation import DecodeSpec, Record
from workers.metrics.speed import Timed

CHUNK = 2  # items per evaluate_bundle call: small, so a free actor never waits long for the slow one


class PoolError(RuntimeError):
    """The pool could not finish: every actor was lost, or a call failed for another reason (its Ray error
    named). The caller falls back to running each spec on its own (``sweep.references``)."""


def run_bundles(workers: Sequence[Any], benchmark: str, specs: Sequence[DecodeSpec], items: Sequence[Item],
                references: dict[str, Any], on_records: Callable[[list[Record]], None], chunk: int = CHUNK) -> None:
    """Every spec of ``specs`` on every item of ``items``, ``chunk`` items per actor call; ``on_records`` gets
    each item's records, one per spec in ``specs``' order, as they come back. A chunk whose actor died is run
    again on a live actor; :class:`PoolError` when every actor is lost or a call fails otherwise."""
    try:
        _run_bundles(workers, benchmark, specs, items, references, on_records, chunk)
    except ray.exceptions.RayError as err:
        raise PoolError(f"{type(err).__name__}: {str(err).splitlines()[0][:200]}") from err


def _run_bundles(workers: Sequence[Any], benchmark: str, specs: Sequence[DecodeSpec], items: Sequence[Item],
                 references: dict[str, Any], on_records: Callable[[list[Record]], None], chunk: int) -> None:
    queue_: deque[list[Item]] = deque(list(items[i: i + chunk]) for i in range(0, len(items), chunk))
    free = list(workers)
    pending: dict[Any, tuple[Any, list[Item]]] = {}
    while queue_ or pending:
        while queue_ and free:
            worker, part = free.pop(), queue_.popleft()
            ask = {it.id: references[it.id] for it in part if it.id in references}
            pending[worker.evaluate_bundle.remote(benchmark, list(specs), part, ask)] = (worker, part)
        if not pending:  # chunks left and no actor to run them
            raise PoolError(f"every pair actor was lost with {len(queue_)} chunk(s) left")
        ready, _ = ray.wait(list(pending), num_returns=1)
        worker, part = pending.pop(ready[0])
        try:
            done = ray.get(ready[0])
        except ray.exceptions.RayActorError:
            queue_.appendleft(part)  # its items again, on an actor still alive; this one is not used again
            continue
        free.append(worker)
        for per_spec in done:
            on_records(list(per_spec))


def batch_choices(workers: Sequence[Any], benchmark: str, items: Sequence[Item], spec: Any) -> list[dict[str, Any]]:
    """Every actor's ``--batch-size`` choice at the workload's context (``PairWorker.batch``), in actor order."""
    return ray.get([w.batch.remote(benchmark, list(items), spec) for w in workers])


def time_items(worker: Any, benchmark: str, specs: Sequence[DecodeSpec], items: Sequence[Item],
               concurrency: int = 1) -> Timed:
    """``specs`` (target-only, lossless, candidate) decoded in full on ``items`` on ``worker``, with the machine's
    1-minute load before and after: one after another per item (batch 1), or, at a ``concurrency`` above 1, chunk
    by chunk with each arm's requests that many at a time (``PairWorker.time_concurrent``: each arm's walls)."""
    before = os.getloadavg()[0]
    try:
        if concurrency > 1:
            arms, walls = ray.get(worker.time_concurrent.remote(benchmark, list(specs), list(items), concurrency))
        else:
            arms, walls = ray.get(worker.time_items.remote(benchmark, list(specs), list(items))), None
    except ray.exceptions.RayError as err:  # a lost actor loses the timing, never the certificate
        return Timed(None, error=f"{type(err).__name__}: {str(err).splitlines()[0][:200]}")
    return Timed(tuple(list(arm) for arm in arms), (before, os.getloadavg()[0]), concurrency,
                 walls=None if walls is None else tuple(walls))
