"""The speed that counts: over lossless speculative decoding at *its* fastest draft length.

Users of vLLM already run lossless speculative decoding, so a lossy rule is worth its speed over lossless at
the L that is fastest for lossless on the same items, not over lossless at the rule's own L (a rule that wins
only by moving L is no win) and not over target-only decoding (reported second). Lossless records at every L
come cheap at T = 0: replay (``workers.replay``) makes them from one teacher-forced pass per item, decoding
nothing. Knows records and the modelled cost; nothing about Optuna, Ray or MLflow.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from workers.evaluation import Record
from workers.metrics import tokens_per_cost


def best_lossless(records: Mapping[str, Record], lossless: Mapping[int, Mapping[str, Record]], cost_ratio: float,
                  verify_factor: Callable[[int], float]) -> dict[str, Any]:
    """On the items ``records`` holds (failed ones left out, as in the trial's modelled speed): lossless's tokens
    per modelled cost at each L of ``lossless`` (L -> its records), the fastest L, and ``records``' modelled
    speedup over lossless there (``speedup``). NaN where no item is shared."""
    ok = {k: r for k, r in records.items() if not r.failed}
    per_l: dict[int, float] = {}
    for draft_len, base in sorted(lossless.items()):
        keys = [k for k in ok if k in base and not base[k].failed]
        if keys and len(keys) == len(ok):
            per_l[draft_len] = tokens_per_cost([base[k] for k in keys], cost_ratio, verify_factor)
    if not per_l:
        return {"draft_len": None, "speedup": math.nan, "per_draft_len": {}}
    best = max(per_l, key=lambda n: (per_l[n], -n))
    mine = tokens_per_cost(list(ok.values()), cost_ratio, verify_factor)
    return {"draft_len": best, "speedup": mine / per_l[best] if per_l[best] > 0 else math.nan,
            "tokens_per_cost": per_l[best], "per_draft_len": per_l}


def replay_counts(records: Mapping[str, Record]) -> dict[str, int]:
    """How a trial's records were made: replayed with nothing decoded, replayed and decoded from a round on,
    decoded in full."""
    out = {"replayed_exact": 0, "replayed_decoded": 0, "decoded_in_full": 0}
    for r in records.values():
        if not r.replay:
            out["decoded_in_full"] += 1
        elif all(part == "exact" for part in r.replay.split(";")):
            out["replayed_exact"] += 1
        else:
            out["replayed_decoded"] += 1
    return out


def lossless_all(sweep: Any, lengths: list[int]) -> None:
    """Lossless references at every L of ``lengths`` on the search items, item by item on the actors, one
    teacher-forced pass per item for all of them (``evaluate_bundle``), into each L's reference store; the CPU
    engine at T = 0 only (elsewhere, and if an actor is lost, each L runs on its own as any reference does)."""
    import ray

    from jobs.progress import Progress
    from jobs.sweep_args import log
    from workers.evaluation import TARGET_ONLY, DecodeSpec

    if sweep.args.engine != "cpu" or sweep.s["decode"]["temperature"] != 0.0 or sweep.args.replay == "off":
        return
    specs = [DecodeSpec.make("lossless", {}, n, **sweep.s["decode"]) for n in lengths]
    stores = [sweep.reference_store(s) for s in specs]
    done = [store.load() for store in stores]
    todo = [it for it in sweep.items if any(it.id not in d or d[it.id].failed for d in done)]
    if not todo:
        return
    refs = sweep.payload(sweep.refs[TARGET_ONLY])
    bar = Progress(f"lossless references at L {lengths[0]}..{lengths[-1]} (one pass per item)", len(todo))
    chunks = [todo[i: i + 2] for i in range(0, len(todo), 2)]
    pending: dict[Any, Any] = {}
    free = list(sweep.workers)
    try:
        while chunks or pending:
            while chunks and free:
                worker, chunk = free.pop(), chunks.pop(0)
                ask = {it.id: refs[it.id] for it in chunk if it.id in refs}
                pending[worker.evaluate_bundle.remote(sweep.bench.ref, specs, chunk, ask)] = worker
            ready, _ = ray.wait(list(pending), num_returns=1)
            free.append(pending.pop(ready[0]))
            for per_spec in ray.get(ready[0]):
                for store, d, record in zip(stores, done, per_spec, strict=True):
                    store.append(record)
                    d[record.item_id] = record
                bar.update(per_spec[0])
    except ray.exceptions.RayError as err:
        log(f"lossless references in one pass per item failed ({type(err).__name__}): each L runs on its own")
    bar.close()
    for store, d in zip(stores, done, strict=True):
        store.write_parquet(d.values())
