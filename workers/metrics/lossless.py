"""The speed that counts: over the fastest lossless decoding — target-only (L = 0) or lossless speculative
decoding at *its* fastest draft length, whichever is faster on the same items.

Users of vLLM already run lossless speculative decoding, so a lossy rule is worth its speed over lossless at
the L that is fastest for lossless on the same items, not over lossless at the rule's own L (a rule that wins
only by moving L is no win). Where a verify pass or a draft step is dear (fp32 on an AVX2-only CPU), target-only
decoding is the fastest lossless decoding: the mapping of lossless runs carries it as L = 0, so a certificate's
``vs_lossless`` then says ``draft_len: 0``. Lossless records at every L
come cheap at T = 0: replay (``workers.replay``) makes them from one teacher-forced pass per item, decoding
nothing (the sweep's references run them, ``sweep.references``). Knows records and the cost model
(``workers.metrics.cost``); nothing about Optuna, Ray or MLflow.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from workers.evaluation import Record
from workers.metrics.cost import tokens_per_cost


def baseline_name(draft_len: Any) -> str:
    """How a report names the fastest lossless decoding: ``L 3``, or ``L 0, target-only``."""
    return "L 0, target-only" if draft_len == 0 else f"L {draft_len}"


def best_lossless(records: Mapping[str, Record], lossless: Mapping[int, Mapping[str, Record]], cost_ratio: float,
                  verify_factor: Callable[[int], float]) -> dict[str, Any]:
    """On the items ``records`` holds (failed ones left out, as in the trial's modelled speed): lossless's tokens
    per modelled cost at each L of ``lossless`` (L -> its records; L = 0: target-only), the fastest L, and ``records``' modelled
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
    decoded in full (never replayed, or every turn's replay failed and it decoded in full: ``Record.timed``)."""
    out = {"replayed_exact": 0, "replayed_decoded": 0, "decoded_in_full": 0}
    for r in records.values():
        if r.timed:
            out["decoded_in_full"] += 1
        elif all(part == "exact" for part in r.replay.split(";")):
            out["replayed_exact"] += 1
        else:
            out["replayed_decoded"] += 1
    return out
