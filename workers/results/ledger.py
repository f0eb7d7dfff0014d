"""The certificate ledger: every confirmation item is used by one attempt, once.

Testing a budget on confirmation items, seeing "not certified", and testing again on the same items
(another budget a hair away, another alpha, dtype, seed, runs root, or the pair spelled otherwise) is a
second look: k looks at a rule sitting at the boundary certify it with probability 1 - (1 - 0.05)^k, not
0.05. So a confirmation is an *attempt*, and the ledger holds every attempt ever made on a (benchmark,
model pair), keyed by what the models are (``workers.models.identity``: weights, config and tokenizer),
never by names, dtype or where runs are written:

- an ``opened`` row is written (and flushed to disk) **before** the first confirmation item is evaluated:
  a run killed mid-confirmation has still used its items;
- a ``decided`` row per budget when its certificate is decided, with the items it actually used (a
  group-sequential confirmation that stopped at its first look used only that look's items);
- an item used by any attempt is never used by another: a new attempt whose items overlap is refused,
  naming the earlier attempt. Resuming the *same* attempt (same study and the same plan: budgets, alphas,
  candidates, looks, items planned) is allowed: it gets the items recorded when it opened.
- ``--new-items`` (``fresh=True``): the attempt takes the first items of the pool's fixed order that no
  attempt has used, and its certificate lists the earlier attempts.
- items an earlier attempt's study *searched* on (its candidates were chosen on their outcomes) are never
  confirmation items: the pool's front skips them (the certificate records what it skipped);
- a resume is the same study, plan *and* run directory (where its records are cached): elsewhere the items
  would be evaluated afresh, a second look; and a budget a resumed attempt had decided keeps that decision
  as its ceiling (``decided``: a recorded "not certified" never turns into "certified").

The rows live in a SQL database (:mod:`workers.results.ledger_store`: sqlite in ``$SPECTUNE_LEDGER``, else
``<asset cache>/ledger``, by default; any SQLAlchemy URL, e.g. Postgres, for a team), where an item is claimed by a
uniqueness constraint, so two attempts racing from two processes or machines cannot both take it. Attempts behind
committed results, and those made before the ledger existed, are shipped with the project
(:mod:`workers.results.history`) and imported into every ledger.

The attempts on one (benchmark, pair) form a **family** that spends alpha across attempts
(:mod:`workers.certify.family`): the k-th attempt's budgets are tested at ``alpha * 2^-k``, and each opened row
records its number and level.

Knows item ids, budgets and candidate keys; nothing about models (it gets their fingerprint), Ray or MLflow.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from workers.certify.family import SPENDING, family_alpha
from workers.results.history import KNOWN, combine
from workers.results.ledger_store import LEDGER_ENV, Store, ledger_root, ledger_url, shown, store

__all__ = ["KNOWN", "LEDGER_ENV", "AttemptLedger", "LedgerRefusal", "Plan", "combine", "ledger_for", "ledger_root",
           "ledger_url"]


@dataclass(frozen=True)
class Plan:
    """What a confirmation attempt will test, fixed before any confirmation item is evaluated."""

    study: str
    budgets: tuple[float, ...]
    alphas: tuple[float, ...]  # per budget (--joint: alpha / number of budgets each)
    candidates: tuple[tuple[str, ...], ...]  # per budget: decoding-spec keys in test order
    looks: int
    n: int  # confirmation items planned
    run_dir: str = ""  # where its records are cached: a resume elsewhere would evaluate the items afresh

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


class LedgerRefusal(ValueError):
    """A new attempt would reuse items an earlier attempt used."""


class AttemptLedger:
    """The attempts on one (benchmark, model pair)."""

    def __init__(self, benchmark: str, pair_id: str, root: str | os.PathLike[str] | None = None) -> None:
        """``root``: the ledger's SQLAlchemy URL, or a folder for a sqlite file in it (default:
        ``$SPECTUNE_LEDGER``, else ``<asset cache>/ledger``)."""
        self.benchmark, self.pair_id = benchmark, pair_id
        self.url = ledger_url(root)
        self.path = shown(self.url)  # where it is, as a log line names it

    @property
    def store(self) -> Store:
        return store(self.url)

    # -- reading ---------------------------------------------------------------------------------

    def rows(self) -> list[dict[str, Any]]:
        """Every row of this (benchmark, pair) in the order written (the shipped history imported first)."""
        return self.store.rows(self.benchmark, self.pair_id)

    def attempts(self) -> dict[str, dict[str, Any]]:
        """attempt id -> its opened row with ``decided`` (budget -> decided row), ``used`` (item ids) and
        ``number`` (its place in the family), in the order the attempts opened."""
        out = combine(self.rows())
        numbers = self.store.numbers(self.benchmark, self.pair_id)
        for aid, a in out.items():
            a["number"] = numbers.get(aid, (a.get("family") or {}).get("number"))
        return out

    def next_number(self) -> int:
        """The number the next attempt of this family gets."""
        return max(self.store.numbers(self.benchmark, self.pair_id).values(), default=0) + 1

    def family_cap(self) -> float | None:
        """The family's alpha, fixed by its first attempt (the alpha it stated per budget; None: no attempt yet).
        A later attempt that states a larger alpha is tested at this one's share: stating alpha 0.05 x 2^k at
        attempt k would otherwise give every attempt 0.05."""
        first = next((a for a in sorted(self.attempts().values(), key=lambda a: a.get("number") or 0)
                      if a.get("alphas")), None)
        return None if first is None else float(first["alphas"][0])

    def family(self, alpha: float, number: int | None = None) -> dict[str, Any]:
        """What the family gives attempt ``number`` (default: the next one) for ``alpha`` stated per budget: its
        level, at the smaller of ``alpha`` and the family's own (:meth:`family_cap`)."""
        k = self.next_number() if number is None else number
        cap = self.family_cap()
        base = alpha if cap is None else min(alpha, cap)
        return {"number": k, "spending": SPENDING, "alpha": base, "level": family_alpha(base, k)}

    def find(self, plan: Plan) -> dict[str, Any] | None:
        """The attempt this plan resumes (same study and plan), or None."""
        return next((a for a in self.attempts().values()
                     if a.get("study") == plan.study and a.get("plan") == plan.digest), None)

    def searched(self) -> set[str]:
        """Every item an attempt's study searched on (its candidates were chosen on them)."""
        return {item for a in self.attempts().values() for item in a.get("search_items", ())}

    def used(self, exclude: str | None = None) -> dict[str, str]:
        """item id -> the attempt that used it (every attempt but ``exclude``)."""
        out: dict[str, str] = {}
        for aid, a in self.attempts().items():
            if aid != exclude:
                for item in a["used"]:
                    out.setdefault(item, aid)
        return out

    @staticmethod
    def describe(a: dict[str, Any]) -> str:
        outcome = ", ".join(f"{float(b) * 100:g}% {'certified' if r.get('certified') else 'not certified'}"
                            for b, r in sorted(a["decided"].items(), key=lambda kv: float(kv[0]))) or "never decided"
        number = f"#{a['number']} of the family, " if a.get("number") else ""
        return (f"attempt {a['attempt']} ({number}study {a.get('study')}, {a.get('when')}, pair spelled {a.get('pair')!r}, "
                f"{a.get('dtype')}, budgets {', '.join(f'{float(b) * 100:g}%' for b in a.get('budgets', []))}, "
                f"{len(a['used'])} items: {outcome})")

    # -- choosing items --------------------------------------------------------------------------

    def choose(self, plan: Plan, pool: Sequence[str], fresh: bool) -> tuple[list[str], dict[str, Any] | None,
                                                                               list[dict[str, Any]]]:
        """(the attempt's items, the attempt it resumes or None, the earlier attempts). ``pool``: the
        confirmation pool in its fixed order. A new attempt takes the pool's first ``plan.n`` items (``fresh``:
        the first ``plan.n`` no attempt has used); LedgerRefusal when those overlap an earlier attempt's."""
        resumed = self.find(plan)
        attempts = self.attempts()
        earlier = [a for aid, a in attempts.items() if resumed is None or aid != resumed["attempt"]]
        if resumed is not None:
            return list(resumed["items"]), resumed, earlier
        used = self.used()
        searched = self.searched()  # never confirm on items an earlier study chose its candidates on
        pool = [i for i in pool if i not in searched]
        if fresh:
            items = [i for i in pool if i not in used][: plan.n]
        else:
            items = list(pool[: plan.n])
            clash: dict[str, int] = {}
            for item in items:
                if item in used:
                    clash[used[item]] = clash.get(used[item], 0) + 1
            if clash:
                named = "; ".join(f"{n} by {self.describe(attempts[aid])}" for aid, n in clash.items())
                raise LedgerRefusal(
                    f"{sum(clash.values())} of these {len(items)} confirmation items were already used: {named}. "
                    "A second test on items whose result was seen inflates the error (two looks at alpha 0.05 err "
                    "~9.7% of the time), whatever the budget, alpha, dtype, seed, runs root or spelling of the pair, "
                    "so this attempt is refused. Rerun with --new-items to confirm on items no attempt has used "
                    "(the certificate will list the earlier attempts)")
        if len(items) < plan.n:
            raise LedgerRefusal(f"the pool has {len(items)} items no attempt has used, fewer than the {plan.n} "
                                "planned: lower --confirm-items")
        return items, None, earlier

    # -- writing ---------------------------------------------------------------------------------

    def open(self, plan: Plan, pool: Sequence[str], fresh: bool, *, pair: str, dtype: str,
             search_items: Sequence[str] = (), endpoint: dict[str, Any] | None = None
             ) -> tuple[str, list[str], list[dict[str, Any]]]:
        """Choose the attempt's items (:meth:`choose`) and, for a new attempt, write its ``opened`` row, its number
        in the family and a claim on each item in one transaction, before anything is evaluated. Returns (attempt
        id, items, earlier attempts). Where another attempt took an item or the number first (a race), the choice
        is made again on what it took; a clash without ``fresh`` is then refused. ``endpoint``: for a server's
        pair (keyed on the id its user states), what the servers said they serve (urls and model cards), kept in
        the row so an audit can tell two ids of one deployment apart from two deployments."""
        from sqlalchemy.exc import IntegrityError

        for _ in range(50):
            items, resumed, earlier = self.choose(plan, pool, fresh)
            if resumed is not None:
                return resumed["attempt"], items, earlier
            number = self.next_number()
            cap = self.family_cap()
            aid = hashlib.sha256(f"{plan.study}/{plan.digest}/{time.time_ns()}".encode()).hexdigest()[:12]
            row = {"event": "opened", "attempt": aid, "benchmark": self.benchmark, "pair_id": self.pair_id,
                   "pair": pair, "dtype": dtype, "study": plan.study, "plan": plan.digest,
                   "budgets": list(plan.budgets), "alphas": list(plan.alphas),
                   "candidates": [list(c) for c in plan.candidates], "looks": plan.looks, "new_items": fresh,
                   "earlier": [a["attempt"] for a in earlier], "when": time.strftime("%Y-%m-%d %H:%M:%S"),
                   "run_dir": plan.run_dir, "items": list(items), "search_items": list(search_items),
                   "family": {"number": number, "spending": SPENDING, "cap": cap,
                              "levels": [family_alpha(x if cap is None else min(x, cap), number)
                                         for x in plan.alphas]},
                   **({"endpoint": endpoint} if endpoint else {})}
            try:
                self.store.open_attempt(row, number, items)
            except IntegrityError:
                continue  # another attempt took an item or the number meanwhile: choose again on what it took
            return aid, items, earlier
        raise LedgerRefusal(f"the ledger at {self.path} stayed contended through 50 tries to open an attempt")

    def decide(self, attempt: str, budget: float, certified: bool, reason: str, items_used: int) -> None:
        """Record a budget's decision (once: a resumed attempt that decides again adds nothing). When the attempt
        is closed (every budget decided) the items it never evaluated are released for later attempts."""
        mine = self.attempts().get(attempt)
        if mine is None:
            raise ValueError(f"attempt {attempt} was never opened in the ledger at {self.path}")
        if str(float(budget)) in mine["decided"]:
            return
        self.store.add_row({"event": "decided", "attempt": attempt, "benchmark": self.benchmark,
                            "pair_id": self.pair_id, "budget": float(budget), "certified": bool(certified),
                            "reason": reason, "items_used": int(items_used),
                            "when": time.strftime("%Y-%m-%d %H:%M:%S")})
        after = self.attempts()[attempt]
        self.store.release(self.benchmark, self.pair_id, attempt, set(after["items"]) - set(after["used"]))

    def ship(self, attempt: str) -> int:
        """Write ``attempt``'s rows into the shipped history (:mod:`workers.results.history`), as exporting a
        result does; returns the rows added."""
        from workers.results.history import append_rows

        rows = [r for r in self.rows() if r.get("attempt") == attempt]
        if not any(r.get("event") == "opened" for r in rows):
            raise ValueError(f"attempt {attempt} is not in the ledger at {self.path} "
                             f"({self.benchmark}, {self.pair_id}): its rows cannot be shipped")
        return append_rows(rows)


def ledger_for(bench: Any, pair: str | None = None, pair_id: str | None = None,
               root: str | os.PathLike[str] | None = None) -> AttemptLedger:
    """The ledger of benchmark ``bench`` (a ``workers.benchmarks`` benchmark) and a pair: ``pair`` (a name or two
    model directories: keyed on what the models are) or an endpoint's ``pair_id`` (keyed on the id its user
    states: a server's weights are not here to fingerprint). ``root``: the ledger's URL or folder."""
    if (pair is None) == (pair_id is None):
        raise ValueError("give a model pair (--pair) or an endpoint's pair id (--pair-id), one of them")
    if pair_id is not None:
        key = f"endpoint:{pair_id}"
    else:
        from workers.models.identity import pair_fingerprint

        key = pair_fingerprint(pair)
    return AttemptLedger(getattr(bench, "ledger_key", bench.key), key, root)
