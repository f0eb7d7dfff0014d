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

The ledger lives with the asset cache (``$SPECTUNE_LEDGER``, else ``<asset cache>/ledger``), shared by every
runs root on the machine (a cluster: point both at the shared volume). Attempts made before it existed are
shipped with the project (``known_attempts.jsonl`` beside this file) and read as part of every ledger.

Knows item ids, budgets and candidate keys; nothing about models (it gets their fingerprint), Ray or MLflow.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from workers.results.store import slug

LEDGER_ENV = "SPECTUNE_LEDGER"
KNOWN = Path(__file__).with_name("known_attempts.jsonl")


def ledger_root() -> Path:
    """``$SPECTUNE_LEDGER``, else ``<asset cache>/ledger`` (``$SPECTUNE_CACHE`` moves the asset cache)."""
    given = os.environ.get(LEDGER_ENV)
    if given:
        return Path(given).expanduser().resolve()
    from workers.models.assets import cache_root

    return cache_root() / "ledger"


@contextlib.contextmanager
def _folder_lock(folder: Path) -> Iterator[None]:
    """The ledger folder's lock: one writer at a time across processes."""
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / ".lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _append_lines(path: Path, lines: Sequence[str]) -> None:
    """Append ``lines`` (one row each) to ``path``, durably; a last line a crash left unfinished is ended first, or
    the first new row would be glued to it and lost (the caller holds the folder's lock)."""
    torn = False
    if path.is_file() and path.stat().st_size:
        with path.open("rb") as fh:
            fh.seek(-1, os.SEEK_END)
            torn = fh.read(1) != b"\n"
    with path.open("a") as fh:  # one line per row: an append is all or (torn, ignored) nothing
        if torn:
            fh.write("\n")
        fh.write("".join(line + "\n" for line in lines))
        fh.flush()
        os.fsync(fh.fileno())


def merge_rows(path: Path, lines: Sequence[str]) -> int:
    """Add to the ledger file ``path`` the rows of ``lines`` it does not hold (another machine's ledger of the same
    file name: the same benchmark and models), under the folder's lock; rows are never removed or rewritten, so
    an item another machine's attempt used stays used here. Lines that are not JSON rows are skipped. Returns the
    rows added."""
    with _folder_lock(path.parent):
        have = set(path.read_text(errors="replace").splitlines()) if path.is_file() else set()
        new: list[str] = []
        for line in lines:
            line = line.strip()
            if not line or line in have or line in new:
                continue
            try:
                if not isinstance(json.loads(line), dict):
                    continue
            except json.JSONDecodeError:
                continue
            new.append(line)
        if new:
            _append_lines(path, new)
        return len(new)


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
        self.benchmark, self.pair_id = benchmark, pair_id
        base = Path(root) if root is not None else ledger_root()
        tag = hashlib.sha256(pair_id.encode()).hexdigest()[:16]
        self.path = base / f"{slug(benchmark, 60)}-{tag}.jsonl"

    # -- reading ---------------------------------------------------------------------------------

    def rows(self) -> list[dict[str, Any]]:
        """Every row of this (benchmark, pair): the shipped ones, then this machine's."""
        out = []
        for path in (KNOWN, self.path):
            if not path.is_file():
                continue
            for line in path.read_text().splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line torn by a crash: its attempt never finished opening
                if row.get("benchmark") == self.benchmark and row.get("pair_id") == self.pair_id:
                    out.append(row)
        return out

    def attempts(self) -> dict[str, dict[str, Any]]:
        """attempt id -> its opened row with ``decided`` (budget -> decided row) and ``used`` (item ids)."""
        out: dict[str, dict[str, Any]] = {}
        rows = self.rows()  # both files read once
        for row in rows:
            if row.get("event") == "opened":
                out.setdefault(row["attempt"], {**row, "decided": {}})
        for row in rows:
            if row.get("event") == "decided" and row.get("attempt") in out:
                out[row["attempt"]]["decided"].setdefault(str(float(row["budget"])), row)
        for a in out.values():
            done = a["decided"]
            closed = len(done) >= len(a.get("budgets", ())) and all(r.get("items_used") is not None
                                                                   for r in done.values())
            # an attempt that never closed (killed mid-run) used every item it planned
            a["used"] = a["items"][: max(int(r["items_used"]) for r in done.values())] if closed and done \
                else list(a["items"])
        return out

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
        return (f"attempt {a['attempt']} (study {a.get('study')}, {a.get('when')}, pair spelled {a.get('pair')!r}, "
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

    def _locked(self) -> contextlib.AbstractContextManager[None]:
        return _folder_lock(self.path.parent)

    def _append(self, row: dict[str, Any]) -> None:
        _append_lines(self.path, [json.dumps(row)])

    def open(self, plan: Plan, pool: Sequence[str], fresh: bool, *, pair: str, dtype: str,
             search_items: Sequence[str] = (), endpoint: dict[str, Any] | None = None
             ) -> tuple[str, list[str], list[dict[str, Any]]]:
        """Choose the attempt's items (:meth:`choose`) and, for a new attempt, write its ``opened`` row
        before anything is evaluated. Returns (attempt id, items, earlier attempts). ``endpoint``: for a server's
        pair (keyed on the id its user states), what the servers said they serve (urls and model cards), kept in the
        row so an audit can tell two ids of one deployment apart from two deployments."""
        with self._locked():
            items, resumed, earlier = self.choose(plan, pool, fresh)
            if resumed is not None:
                return resumed["attempt"], items, earlier
            aid = hashlib.sha256(f"{plan.study}/{plan.digest}/{time.time_ns()}".encode()).hexdigest()[:12]
            self._append({"event": "opened", "attempt": aid, "benchmark": self.benchmark, "pair_id": self.pair_id,
                          "pair": pair, "dtype": dtype, "study": plan.study, "plan": plan.digest,
                          "budgets": list(plan.budgets), "alphas": list(plan.alphas),
                          "candidates": [list(c) for c in plan.candidates], "looks": plan.looks, "new_items": fresh,
                          "earlier": [a["attempt"] for a in earlier], "when": time.strftime("%Y-%m-%d %H:%M:%S"),
                          "run_dir": plan.run_dir, "items": list(items), "search_items": list(search_items),
                          **({"endpoint": endpoint} if endpoint else {})})
            return aid, items, earlier

    def decide(self, attempt: str, budget: float, certified: bool, reason: str, items_used: int) -> None:
        """Record a budget's decision (once: a resumed attempt that decides again adds nothing)."""
        with self._locked():
            mine = self.attempts().get(attempt)
            if mine is None:
                raise ValueError(f"attempt {attempt} was never opened in {self.path}")
            if str(float(budget)) in mine["decided"]:
                return
            self._append({"event": "decided", "attempt": attempt, "benchmark": self.benchmark,
                          "pair_id": self.pair_id, "budget": float(budget), "certified": bool(certified),
                          "reason": reason, "items_used": int(items_used),
                          "when": time.strftime("%Y-%m-%d %H:%M:%S")})
