"""Confirmation attempts, recorded append-only, so that no budget is tested twice on the same items.

Testing a budget on confirmation items, seeing "not certified", and testing it again on the same items
(more trials, other candidates, a larger pool that contains the first) is a second look: two looks at
alpha = 0.05 certify a drop at the budget about 9% of the time, not 5%. So every confirmation attempt is
recorded in ``<runs root>/attempts/<benchmark>-<pair>-<dtype>.jsonl``, one JSON line per (study, budget):
the alpha, the candidates in test order (their decoding-spec keys), the confirmation item ids, and the
outcome. Before a budget is confirmed:

- the same study, budget, alpha, candidates and items as a recorded attempt: that attempt resumed or
  reported again (its records are cached, so it decides the same): allowed, and not recorded twice;
- any other attempt at the same budget on items that overlap a recorded attempt's: refused, with the
  reason and the earlier attempt named. A fresh certificate needs items no earlier attempt has seen
  (a new ``--subset-seed`` gives the same pool another order, not new items; another pair or benchmark
  is another ledger).

Knows budgets, item ids and candidate keys; nothing about models, Ray or MLflow. Refusing is the whole
policy: no alpha is spent across attempts.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jobs.records import slug


@dataclass(frozen=True)
class Attempt:
    study: str
    budget: float
    alpha: float
    candidates: tuple[str, ...]  # decoding-spec keys, in test order
    items: tuple[str, ...]  # confirmation item ids, in order

    @property
    def items_digest(self) -> str:
        return hashlib.sha256("\n".join(self.items).encode()).hexdigest()[:16]

    def same_as(self, row: dict[str, Any]) -> bool:
        return (row["study"] == self.study and row["budget"] == self.budget and row["alpha"] == self.alpha
                and tuple(row["candidates"]) == self.candidates and row["items_digest"] == self.items_digest)


class AttemptLedger:
    """The attempts of one (benchmark, pair, dtype) under a runs root."""

    def __init__(self, root: str | Path, benchmark: str, pair: str, dtype: str) -> None:
        self.path = Path(root) / "attempts" / f"{slug(f'{benchmark}-{pair}-{dtype}')}.jsonl"

    def rows(self) -> list[dict[str, Any]]:
        if not self.path.is_file():
            return []
        out = []
        for line in self.path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line torn by a crash: that attempt never finished recording
        return out

    def check(self, attempt: Attempt) -> tuple[bool, str | None]:
        """(recorded already, refusal): refusal is None when the attempt may run."""
        mine = set(attempt.items)
        for row in self.rows():
            if row["budget"] != attempt.budget:
                continue
            if attempt.same_as(row):
                return True, None
            shared = len(mine.intersection(row["items"]))
            if shared:
                return False, (f"budget {attempt.budget:g} was already tested on {shared} of these {len(mine)} "
                               f"confirmation items (study {row['study']}, {row['when']}, candidates "
                               f"{', '.join(row['candidates']) or 'none'}: "
                               f"{'certified' if row['certified'] else 'not certified'}); a second test on items "
                               "whose result was seen inflates the error (two looks at alpha 0.05 err ~9% of the "
                               "time), so this attempt is refused. Certify on items no attempt has used")
        return False, None

    def record(self, attempt: Attempt, certified: bool, reason: str) -> None:
        row = {"study": attempt.study, "budget": attempt.budget, "alpha": attempt.alpha,
               "candidates": list(attempt.candidates), "items_digest": attempt.items_digest,
               "n_items": len(attempt.items), "certified": bool(certified), "reason": reason,
               "when": time.strftime("%Y-%m-%d %H:%M:%S"), "items": list(attempt.items)}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as fh:  # one line per attempt: an append is all or (torn, ignored) nothing
            fh.write(json.dumps(row) + "\n")


def attempt_of(study: str, budget: float, alpha: float, candidate_keys: Sequence[str], items: Sequence[str]) -> Attempt:
    return Attempt(study, float(budget), float(alpha), tuple(candidate_keys), tuple(items))
