"""The confirmation attempt: what the ledger opens before any confirmation item runs (its items, its place in
the family of attempts on this benchmark and pair, the earlier attempts), the level its budgets are tested at
(``workers.certify.family``: alpha x 2^-k, the family's alpha fixed by its first attempt) and what a certificate
states of it. Used by :mod:`sweep.confirm` and :mod:`sweep.server`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sweep.progress import log
from sweep.search import spec_of
from workers.certify.decide import Candidate, order_candidates
from workers.engine_registry import engine_traits
from workers.results.ledger import AttemptLedger, LedgerRefusal, Plan

if TYPE_CHECKING:
    from sweep.state import SweepState
    from workers.benchmarks.base import Item


@dataclass(frozen=True)
class Attempt:
    """A confirmation attempt as the ledger opened it: its id (None when no budget had a candidate, or when
    the ledger refused), the items it confirms on (the ledger's; the planned ones where none was opened), the
    pool items before its last that earlier attempts had used (``skipped``: what recomputing the pool's front
    needs), the earlier attempts, and the refusal, if any."""

    ledger: AttemptLedger
    id: str | None
    items: list[Item]
    skipped: list[str] = field(default_factory=list)
    earlier: list[dict[str, Any]] = field(default_factory=list)
    refusal: str | None = None
    number: int | None = None  # its place in the family (workers.certify.family): its budgets' level
    cap: float | None = None  # the family's alpha, fixed by its first attempt: a later one states no more

    def level(self, alpha: float) -> float:
        """The level this attempt tests each budget at, for ``alpha`` stated per budget: the family's share of
        the smaller of ``alpha`` and the family's own. An attempt the ledger never opened (refused, or no
        candidate) tests nothing: ``alpha`` as stated."""
        from workers.certify.family import family_alpha

        if self.id is None:
            return alpha
        if self.number is None:
            raise ValueError(f"attempt {self.id} has no number in its family: the ledger lost it")
        return family_alpha(alpha if self.cap is None else min(alpha, self.cap), self.number)



def open_attempt(state: SweepState, candidates: list[Candidate], alpha_each: float) -> Attempt:
    """Before any confirmation item is evaluated: the attempt's plan (every budget's candidates in test order),
    opened in the ledger of this benchmark and model pair, which gives the attempt its items."""
    from sweep.settings import ledger_of

    s, args = state.settings, state.settings.args
    keys = tuple(tuple(spec_of(s, c.payload).key() for c in order_candidates(candidates, b, limit=args.confirm_candidates))
                 for b in s.budgets)
    ledger = ledger_of(s)
    planned = state.confirm_planned
    if not any(keys):
        return Attempt(ledger, None, planned)
    plan = Plan(state.name, tuple(float(b) for b in s.budgets), tuple(alpha_each for _ in s.budgets), keys, args.looks,
                state.n_confirm, str(Path(state.dir).resolve()))
    try:
        attempt, ids, earlier = ledger.open(plan, [it.id for it in state.pool], bool(args.new_items),
                                            pair=args.pair, dtype=args.dtype,
                                            search_items=[it.id for it in state.items],
                                            endpoint={"base_url": args.base_url, "model": args.model,
                                                      "model_card": state.profile.get("model_card")}
                                            if engine_traits(args.engine).needs_server else None)
    except LedgerRefusal as err:
        log(f"confirmation REFUSED by the ledger ({ledger.path}): {err}")
        return Attempt(ledger, None, planned, refusal=str(err))
    items = attempt_items(attempt, ids, state.pool, earlier, bool(args.new_items))
    mine = ledger.attempts()[attempt]
    number, cap = mine.get("number"), (mine.get("family") or {}).get("cap")
    where = {it.id: k for k, it in enumerate(state.pool)}
    chosen, last = set(ids), max(where[i] for i in ids) if ids else -1
    # the pool items before the last chosen one that earlier attempts had used: what recomputing the front needs
    skipped = [it.id for it in state.pool[: last + 1] if it.id not in chosen]
    held = Attempt(ledger, attempt, items, skipped, earlier, number=number, cap=cap)
    base = alpha_each if cap is None else min(alpha_each, cap)
    log(f"confirmation attempt {attempt} is #{number} of its family on this benchmark and pair: each budget is "
        f"tested at {base:g} x 2^-{number} = {held.level(alpha_each):.4g}"
        + (f" (the family's alpha {cap:g}, fixed by its first attempt)" if cap is not None and cap < alpha_each else ""))
    return held


def family_fields(attempt: Attempt, alpha_stated: float) -> dict[str, Any]:
    """What a certificate says of its family: the attempt's number, the spending, the stated alpha and the
    level its budgets were tested at."""
    from workers.certify.family import SPENDING

    return {"number": attempt.number, "spending": SPENDING,
            "alpha": alpha_stated if attempt.cap is None else min(alpha_stated, attempt.cap),
            "level": attempt.level(alpha_stated)}


def statement(alpha: float, alpha_stated: float, attempt: Attempt) -> str:
    """The certificate's statement: what is claimed at which level, within the attempt and across its family.
    Across the family the claim is per budget (for any one budget fixed in advance); a joint claim across the
    family's budgets would need every attempt joint, so the family's joint spend so far is stated instead."""
    across = (f"joint within this attempt: every certified budget at once, alpha {alpha:g} (Bonferroni, "
              f"{alpha_stated:g} each)" if alpha_stated != alpha else f"per budget, alpha {alpha:g} each")
    if attempt.number is None:
        return across
    base = alpha_stated if attempt.cap is None else min(alpha_stated, attempt.cap)
    spent = family_spent(attempt)
    return (f"{across}; across this benchmark and pair's attempts, per budget: attempt #{attempt.number} tested at "
            f"{base:g} x 2^-{attempt.number} = {attempt.level(alpha_stated):.4g}, so for any one budget fixed in "
            f"advance P(any certificate of the family at it is wrong) <= {base:g}"
            + (f"; summed over every budget of every attempt the family has spent {spent:.4g}" if spent else ""))


def family_spent(attempt: Attempt) -> float:
    """The levels of every budget of every attempt of the family so far, summed (what a joint claim across the
    family's budgets would have to stay under)."""
    from workers.certify.family import family_alpha

    total = 0.0
    for a in attempt.ledger.attempts().values():
        levels = (a.get("family") or {}).get("levels")
        if levels is None and a.get("number"):  # made before the family: its stated alphas at its share
            levels = [family_alpha(float(x), int(a["number"])) for x in a.get("alphas", ())]
        total += sum(levels or ())
    return total


def attempt_items(attempt: str, ids: Sequence[str], pool: Sequence[Item], earlier: Sequence[Any],
                  new_items: bool) -> list[Item]:
    """The pool's items the ledger gave attempt ``attempt`` (``ids``), in its order, said in the log; a ValueError
    where one left the pool (the benchmark's data changed since the attempt opened)."""
    by_id = {it.id: it for it in pool}
    missing = [i for i in ids if i not in by_id]
    if missing:
        raise ValueError(f"attempt {attempt} resumes on {len(missing)} item(s) no longer in the pool "
                         f"(e.g. {missing[0]}): the benchmark's data changed since it opened")
    log(f"confirmation attempt {attempt}: {len(ids):,} items from the pool's fixed order"
        + (" (the first no earlier attempt used)" if new_items else "")
        + (f"; {len(earlier)} earlier attempt(s) on this pair and benchmark" if earlier else ""))
    return [by_id[i] for i in ids]


def prior_refusal(ledger: AttemptLedger, attempt: str, budget: float) -> str | None:
    """Where a resumed attempt decided ``budget`` before without certifying it, why it is not certified now (that
    decision is its ceiling: a re-decision cannot turn it into a certificate); else None."""
    before = ledger.attempts().get(attempt, {}).get("decided", {}).get(str(float(budget)))
    if before is None or before.get("certified"):
        return None
    return (f"not certified: attempt {attempt} decided this budget before ({before['when']}: {before['reason']}); "
            "a re-decision cannot overturn it")
