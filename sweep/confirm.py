"""The sweep's confirmation phase: certify each budget on items the search never saw.

The search (Optuna, pruning, the Pareto front) runs on the benchmark's search split. Here, per
budget, the search's feasible Pareto candidates are ordered safest first and confirmed on the
confirmation split with the fixed-sequence procedure of ``workers.certify.decide`` (each at the full
alpha, stop at the first failure: family-wise error <= alpha). This module only runs the
evaluations and assembles what the report, MLflow and Serve read; every decision about what
counts as certified is ``workers.certify.decide``'s.

A candidate is judged on the whole fixed confirmation item set (``confirmation_pairs``): a candidate
item that failed or never came back counts as wrong, a reference item that failed counts as right
(nothing flips to the candidate's side), and the failures are reported by arm. A candidate confirmed
for one budget is not evaluated again for another (records are cached per decoding spec under
``<run dir>/confirm/``); its futility stop tests the largest budget whose list holds it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sweep.audit import audit_pending, audit_replayed, audit_withholds
from sweep.certificates import (
    candidates_from,
    certificate_fields,
    confirm_metrics,
    noise_floor_row,
    pool_outlook,
)
from sweep.progress import log
from sweep.search import spec_of
from workers.certify.decide import (
    Candidate,
    Certificate,
    DropBound,
    bound_text,
    certifies,
    fixed_sequence,
    order_candidates,
    prune_test,
    sequential_bound,
)
from workers.certify.sequential import RHO, LookPlan, look_plan
from workers.evaluation import Record
from workers.metrics.lossless import baseline_name
from workers.metrics.speed import comparable, measured_text, over_lossless, ratio_text, speed_figures
from workers.results.evidence import confirmation_rows, ordered_prefix, write_evidence
from workers.results.flips import flip_rows, write_flips
from workers.results.ledger import AttemptLedger, LedgerRefusal, Plan
from workers.results.store import write_json

if TYPE_CHECKING:
    from sweep.state import SweepState
    from workers.benchmarks.base import Item


class Confirmation:
    """Runs the confirmation evaluations for a sweep and keeps their records.

    ``evaluate(spec, label, items, stop)`` is the sweep's resumable record runner (a RecordStore per
    spec); ``stop(records)`` lets it end a hopeless candidate early (anytime-valid futility, so
    declaring failure early only makes the procedure more conservative).
    """

    def __init__(self, evaluate: Callable[..., dict[str, Record]],
                 reference: dict[str, Record] | Callable[[int], dict[str, Record]],
                 alpha: float, limit: int | None, order: Sequence[str] | None = None, looks: int = 1,
                 rho: float = RHO) -> None:
        # reference: the target-only records, or a callable giving those of the first n items of ``order``
        # (run look by look: a candidate that certifies early never waits for the rest)
        self._reference_upto = reference if callable(reference) else None
        self.reference: dict[str, Record] = {} if callable(reference) else reference
        self.evaluate, self.alpha, self.limit, self.looks, self.rho = evaluate, alpha, limit, looks, rho
        self.order = list(order) if order is not None else list(self.reference)  # the items' fixed order
        self.records: dict[str, dict[str, Record]] = {}  # candidate key -> confirmation records
        self.bounds: dict[str, DropBound] = {}  # candidate key -> its latest bound (figures, reports)
        self._bounds: dict[tuple[str, float, float], DropBound] = {}  # (key, alpha, budget) -> bound
        self.counts: dict[str, dict[str, int]] = {}  # candidate key -> failures and missing items, by arm
        self.evidence: dict[str, list[dict[str, Any]]] = {}  # candidate key -> its per-item paired outcomes
        self.futility: dict[str, float] = {}  # candidate key -> the budget its futility stop tests against
        self.success: dict[str, tuple[float, float]] = {}  # candidate key -> (budget, alpha) of its success stop
        self.stopped: dict[str, int] = {}  # candidate key -> the look size it stopped at on success

    def plan(self, alpha: float, budget: float | None = None) -> LookPlan:
        """The looks over the confirmation items at ``alpha``, their levels calibrated for ``budget``
        (one look: the fixed-n test)."""
        return look_plan(max(1, len(self.order)), self.looks, alpha, self.rho, budget)

    def reference_upto(self, n: int) -> dict[str, Record]:
        if self._reference_upto is not None:
            self.reference = self._reference_upto(n)
        return self.reference

    def plan_futility(self, candidates: list[Candidate], budgets: Sequence[float],
                      alpha: float | None = None) -> dict[str, float]:
        """Before any confirmation: each candidate's futility stop tests the *largest* budget whose
        candidate list holds it (known from the search alone), so records cut short for one budget are
        never what a larger budget is judged on; its success stop (group-sequential looks) tests the
        *smallest*, at ``alpha`` (default: the confirmation's): passing there passes every larger one."""
        for budget in sorted(budgets):
            for c in order_candidates(candidates, budget, limit=self.limit):
                self.futility[c.key] = budget
                self.success.setdefault(c.key, (budget, self.alpha if alpha is None else alpha))
        return dict(self.futility)

    def records_of(self, candidate: Candidate, budget: float) -> dict[str, Record]:
        """The candidate's confirmation records, look by look: after each look's items it stops if the
        futility test fired or if it certifies its success budget at that look's level."""
        if candidate.key in self.records:
            return self.records[candidate.key]
        against = self.futility.setdefault(candidate.key, budget)
        success_budget, success_alpha = self.success.setdefault(candidate.key, (budget, self.alpha))
        plan = self.plan(success_alpha, success_budget)
        records: dict[str, Record] = {}
        for n in plan.sizes:
            ref, order = self.reference_upto(n), self.order[:n]

            def hopeless(recs: dict[str, Record], ref=ref, order=order) -> bool:
                a, b = ordered_prefix(order, ref, recs)
                return bool(a) and prune_test(a, b, against, self.alpha)

            records = self.evaluate(candidate, hopeless, n)
            if hopeless(records):
                break
            if n < plan.n:
                rows, _ = confirmation_rows(order, ref, records)
                look = sequential_bound([r["reference_score"] for r in rows], [r["candidate_score"] for r in rows],
                                        plan, success_budget)
                if certifies(look):
                    self.stopped[candidate.key] = n
                    break
        self.records[candidate.key] = records
        return records

    def certify(self, candidates: list[Candidate], budget: float, alpha: float | None = None) -> Certificate:
        """Confirm ``budget`` at ``alpha`` (default: the confirmation's; ``--joint`` passes its share)."""
        alpha = self.alpha if alpha is None else alpha
        ordered = order_candidates(candidates, budget, limit=self.limit)

        def bound_of(c: Candidate) -> DropBound:
            if c.key not in self.evidence:
                records = self.records_of(c, budget)
                order = self.order[: self.stopped.get(c.key, len(self.order))]  # a success stop: its looks' items
                rows, self.counts[c.key] = confirmation_rows(order, self.reference, records,
                                                             (self.futility[c.key], self.alpha))
                self.evidence[c.key] = rows
            if (c.key, alpha, budget) not in self._bounds:
                rows = self.evidence[c.key]
                self._bounds[c.key, alpha, budget] = sequential_bound(
                    [r["reference_score"] for r in rows], [r["candidate_score"] for r in rows], self.plan(alpha, budget),
                    budget)
            self.bounds[c.key] = self._bounds[c.key, alpha, budget]
            return self.bounds[c.key]

        return fixed_sequence(ordered, bound_of, budget, alpha)


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


@dataclass(frozen=True)
class Certification:
    """What confirmation decided and left: the chosen rule per budget (as ``chosen/budget-<b>.json`` says), the
    certification table, each confirmed candidate's records (the frontier's lost items) and the flips files
    (the flips page's confirmation sections)."""

    chosen: dict[str, Any]
    table: str
    confirmed: dict[str, dict[str, Record]]
    flips: list[tuple[str, Path]]


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
                                            if args.engine == "openai" else None)
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


def base_choice(state: SweepState, budget: float, attempt: Attempt) -> dict[str, Any]:
    """What every chosen file of the sweep says of where its certificate came from."""
    args = state.settings.args
    return {"budget": budget, "pair": args.pair, "benchmark": state.bench.name, "dtype": args.dtype,
            "sweep": state.name, "parent_run_id": state.tracker.parent_id, "decode": state.settings.decode,
            "engine": args.engine, "split": state.split,
            "search_items": len(state.items), "pair_fingerprint": attempt.ledger.pair_id,
            # what the certificate covers on a server: this endpoint, as /v1/models described it
            **({"endpoint": {"base_url": args.base_url, "model": args.model, "pair_id": args.pair_id,
                             "model_card": state.profile.get("model_card")}} if args.engine == "openai" else {})}


def speed_over_lossless(state: SweepState, attempt: Attempt, row: dict[str, Any], records: dict[str, Record],
                        reference: dict[str, Record], used: int) -> dict[str, Any]:
    """The candidate of trial ``row`` (its confirmation ``records``, on the first ``used`` confirmation items)
    against lossless at the search's best L and against target-only: modelled on those items, measured in a
    like-for-like timed run of the first ``--speed-items`` of them (``workers.metrics.speed``)."""
    from cluster.pool import time_items

    s = state.settings
    spec = spec_of(s, row)
    best = row.get("best_lossless_draft_len")
    draft_len = int(best) if best is not None and math.isfinite(float(best)) else spec.draft_len
    lossless = state.refs.confirm_lossless(draft_len, attempt.items[:used])
    keys = comparable(records, lossless, reference)
    n = min(int(getattr(s.args, "speed_items", 0) or 0), len(keys))
    timed = None
    if n > 0:
        shared = set(keys)
        order = [it for it in attempt.items if it.id in shared][:n]
        # The fastest lossless may be target-only (L 0): then its arm is a second target-only run, timed in its
        # place like any arm (the two target-only runs also show the timing's own spread).
        fastest = state.refs.lossless_spec(draft_len) if draft_len else state.refs.target_only_spec()
        specs = [state.refs.target_only_spec(), fastest, spec]
        timed = time_items(state.workers[0], s.bench.ref, specs, order, int(str(s.args.concurrency)))
    return over_lossless(records, lossless, reference, draft_len, state.cost, timed)


def certify(state: SweepState, frame: Any, out: Path) -> Certification:
    """Confirm every budget of the sweep on items the search never saw and write what was decided:
    ``<out>/chosen-budget-<b>.json``, ``certification.json`` and the per-item evidence. Returns the chosen
    policies by budget (as text), each carrying ``certified`` and its evidence, the markdown table, the
    confirmed candidates' records and their flips files."""
    from dashboards.tables import certification_table
    from workers.evaluation import DecodeSpec
    from workers.results.store import RecordStore, slug

    s, args, refs = state.settings, state.settings.args, state.refs
    candidates = candidates_from(frame)
    # --joint: one statement across budgets (Bonferroni): P(any certified budget is wrong) <= alpha
    alpha_stated = args.alpha / len(s.budgets) if args.joint else args.alpha
    attempt = open_attempt(state, candidates, alpha_stated)
    alpha_each = attempt.level(alpha_stated)  # the family's share for this attempt (workers.certify.family)
    items, refusal = attempt.items, attempt.refusal
    ref_spec = refs.target_only_spec()

    def reference_upto(n: int) -> dict[str, Record]:  # look by look: the first n confirmation items
        return refs.confirm_target_only(items[:n], items)

    specs: dict[str, DecodeSpec] = {}

    def evaluate(c: Candidate, stop: Callable[[dict[str, Record]], bool], n: int) -> dict[str, Record]:
        spec = specs[c.key] = spec_of(s, c.payload)
        store = RecordStore(state.dir / "confirm" / f"{slug(spec.label())}-{spec.key()}")
        return refs.run(spec, f"confirm {c.key} {spec.label()} (items {n:,})", store, items[:n], stop, timeout=False,
                        confirm=True)

    confirmation = Confirmation(evaluate, reference_upto, attempt.level(args.alpha), args.confirm_candidates,
                                [it.id for it in items], looks=args.looks)
    confirmation.plan_futility(candidates, s.budgets, alpha_each)
    if args.looks > 1:
        for budget in s.budgets:
            plan = confirmation.plan(alpha_each, budget)
            log(f"budget {budget * 100:g}%: group-sequential looks at {', '.join(f'{n:,}' for n in plan.sizes)} "
                  f"items, levels {', '.join(f'{a:.4g}' for a in plan.alphas)} (alpha {alpha_each:g} spent as "
                  f"alpha * t^{plan.rho:g}, {'calibrated exactly' if plan.budget is not None else 'union bound'}); "
                "a candidate that certifies at a look stops there")
    outlook = pool_outlook(candidates, s.budgets, args.confirm_candidates, state.split.get("pool", 0), len(items),
                           alpha_each)  # at the level this attempt is tested at, not the stated alpha
    for row in outlook:
        if row.get("items_needed", -1) != -1:
            need = "never (its search drop is at or above the budget)" if row["items_needed"] is None \
                else f"~{row['items_needed']:,} items"
            log(f"budget {row['budget'] * 100:g}%: {row['candidate']} first (search discordance "
                  f"{row['search_discordance']:.3f}, drop {row['search_drop'] * 100:+.2f}%): a certificate needs {need} "
                  f"(80% power, normal approximation); the pool of {row['pool']:,} ({row['used']:,} used) can certify "
                  f"down to ~{row['smallest_budget_for_pool'] * 100:.2f}%")
    chosen: dict[str, Any] = {}
    figures: dict[str, dict[str, float]] = {}  # candidate key -> its confirmation figures (bootstrap once)
    floors: dict[int, dict[str, Any]] = {}
    speeds: dict[str, dict[str, Any]] = {}  # candidate key -> its vs_lossless / vs_target_only figures

    def figures_of(key: str) -> dict[str, float]:
        bound = confirmation.bounds.get(key)
        if key not in figures and bound is not None:
            recs = confirmation.records.get(key, {})
            figures[key] = confirm_metrics(bound, speed_figures(recs, confirmation.reference, state.cost.cost_ratio,
                                                                state.cost.verify), recs)
            run_id = next(c for c in candidates if c.key == key).payload.get("mlflow_run_id")
            if run_id:  # the figures on the candidate's own trial run, next to its search.<m>
                state.tracker.log_to_run(run_id, {f"confirm.{k}": v for k, v in figures[key].items()},
                                         {"confirmed": "true"})
        return figures.get(key, {})

    ledger_fields = {"attempt": attempt.id, "new_items": bool(args.new_items),
                     "family": family_fields(attempt, alpha_stated),
                     "earlier_attempts": [AttemptLedger.describe(a) for a in attempt.earlier],
                     "pool_order": "sha256('confirm/' + item id), then the first items no earlier attempt used"
                     if args.new_items else "sha256('confirm/' + item id)"}
    from workers.benchmarks.base import pool_sources

    sources = pool_sources(it.id for it in items)
    for budget in s.budgets:
        if refusal is not None:
            cert = Certificate(budget, alpha_each, False, None, None, [], None, f"refused: {refusal}")
        else:
            cert = confirmation.certify(candidates, budget, alpha_each)
            ceiling = prior_refusal(attempt.ledger, attempt.id, budget) if attempt.id is not None else None
            if cert.certified and ceiling is not None:
                cert.certified, cert.reason = False, ceiling
            # the replay audit, before the ledger hears the decision, whatever the decision is: the timed full
            # decodes against the confirmation records they time (workers.metrics.speed.replay_check)
            audited = cert.chosen or next((c for c in candidates if cert.steps and c.key == cert.steps[0][0]), None)
            if audited is not None and audited.key not in speeds:
                used_ = confirmation.stopped.get(audited.key, len(items))
                speeds[audited.key] = speed_over_lossless(state, attempt, audited.payload,
                                                          confirmation.records.get(audited.key, {}),
                                                          confirmation.reference_upto(used_), used_)
                if not cert.certified:  # a refusal needs no audit for its guarantee: the cheap one (sweep.audit)
                    speeds[audited.key]["replay_check"] = audit_replayed(
                        state, attempt.items, audited.payload, confirmation.records.get(audited.key, {}),
                        confirmation.reference_upto(used_), used_, speeds[audited.key].get("replay_check") or {})
            if audited is not None and cert.certified:  # a certificate's audit, with its power, budget by budget
                used_ = confirmation.stopped.get(audited.key, len(items))
                speeds[audited.key]["replay_check"] = audit_replayed(
                    state, attempt.items, audited.payload, confirmation.records.get(audited.key, {}),
                    confirmation.reference_upto(used_), used_, speeds[audited.key].get("replay_check") or {},
                    bound=cert.bound, plan=confirmation.plan(cert.alpha, budget),
                    rows=confirmation.evidence.get(audited.key, []))
            check = speeds[audited.key].get("replay_check", {}) if audited is not None else {}
            audited_records = confirmation.records.get(audited.key, {}) if audited is not None else {}
            withheld = audit_withholds(check, audited_records)
            # a certificate withheld only for want of audit (lost part-way) is not a decision: the ledger is not
            # told, so rerunning the attempt finishes the audit on the same records instead of meeting a refusal
            pending = bool(cert.certified and withheld and audit_pending(check, audited_records))
            if cert.certified and withheld:
                cert.certified, cert.reason = False, withheld
            if attempt.id is not None and pending:
                log(f"budget {budget * 100:g}%: left undecided in the ledger until its replay audit is finished")
            elif attempt.id is not None:  # the items this budget's candidates (and its noise floor) used
                used = max((confirmation.stopped.get(k, len(items)) for k, _, _ in cert.steps), default=0)
                attempt.ledger.decide(attempt.id, budget, cert.certified, cert.reason, used)
        pick = cert.chosen or next((c for c in candidates if cert.steps and c.key == cert.steps[0][0]), None)
        choice = {**base_choice(state, budget, attempt), "certified": bool(cert.certified),
                  "certification": {**certificate_fields(cert, state.split, len(items),
                                                         confirmation.counts, confirmation.plan(alpha_each, budget),
                                                         confirmation.stopped, sources), **ledger_fields,
                                    "statement": statement(args.alpha, alpha_stated, attempt)}}
        if pick is None:
            choice.update(policy=None)
        else:
            row = pick.payload
            spec = spec_of(s, row)
            confirm = figures_of(pick.key)
            if args.skip_noise_floor:
                floors.setdefault(spec.draft_len, {"draft_len": spec.draft_len, "skipped": True})
            elif spec.draft_len not in floors:  # on the items the candidate's certificate used
                used = confirmation.stopped.get(pick.key, len(items))
                reference = confirmation.reference_upto(used)
                floors[spec.draft_len] = noise_floor_row(reference, refs.confirm_lossless(spec.draft_len, items[:used]),
                                                         args.alpha, spec.draft_len, s.budgets)
            used = confirmation.stopped.get(pick.key, len(items))
            if pick.key not in speeds:  # over the best lossless and over target-only, modelled and measured
                speeds[pick.key] = speed_over_lossless(state, attempt, row, confirmation.records.get(pick.key, {}),
                                                       confirmation.reference_upto(used), used)
            choice.update(policy=row["family"], params=json.loads(row["params"]), draft_len=row["draft_len"],
                          trial=row["trial"], search={k: v for k, v in row.items() if isinstance(v, float)},
                          confirm=confirm, noise_floor=floors[spec.draft_len], **speeds[pick.key])
            if not cert.certified:
                choice["note"] = ("NOT certified: this is the safest search candidate, served only with "
                                  "--allow-uncertified")
        for key_, _, _ in cert.steps:  # every confirmed candidate, chosen or not
            figures_of(key_)
        chosen[str(budget)] = choice
        write_json(out / f"chosen-budget-{budget}.json", choice)
        verdict = "CERTIFIED" if cert.certified else "REFUSED" if cert.reason.startswith("refused") else "not certified"
        what = f"{choice['policy']} (trial {choice.get('trial')})" if choice.get("policy") else "no candidate"
        bound = cert.bound
        log(f"budget {budget * 100:g}%: {verdict}: {what}; "
              + ((f"p = {bound.p_value:.3g}, " if not math.isnan(bound.p_value) else "")
                 + bound_text(bound, f"{bound.upper * 100:.2f}%", single="upper bound")
                 + f" (drop {bound.drop * 100:+.2f}%, n={bound.n}, "
                 f"discordance {bound.discordance:.3f}, alpha {cert.alpha}, per budget"
                 + (f"; look {bound.look} of {bound.looks} at level {bound.alpha:.4g}" if bound.looks > 1 else "") + ")"
                 if bound is not None else cert.reason)
            + ("" if cert.certified or cert.items_needed is None else f"; a certificate needs ~{cert.items_needed} items"))
        if choice.get("vs_lossless"):
            vl, va = choice["vs_lossless"], choice["vs_target_only"]
            timed = vl.get("timed") or {}
            log(f"budget {budget * 100:g}%: speed over the best lossless ({baseline_name(vl['draft_len'])}): modelled "
                  f"{ratio_text(vl['modelled'], 3, 'n/a')} on {vl['items']} items, "
                  + (f"measured {ratio_text(vl['measured'], 3, 'n/a')} on {timed['items']} items at concurrency "
                     f"{timed['concurrency']}, interleaved" if "items" in timed else
                     f"not timed ({timed['error']})" if timed.get("error") else "not timed (--speed-items 0)")
                  + f"; over target-only: modelled {ratio_text(va['modelled'], 3, 'n/a')}, "
                  f"{measured_text(va['measured'], 3)}"
                + f"; stated: {ratio_text(vl.get('stated'), 3, 'n/a')}, {vl.get('stated_from', 'modelled')}")
            check = choice.get("replay_check") or {}
            if check.get("items"):
                differ = check["replayed_differ"] + check["full_differ"]
                log(f"budget {budget * 100:g}%: replay audit: full decodes against the records they decode again "
                    f"(the timed items' arms, where timed, and {check.get('extra_items', 0)} more of the candidate's "
                    f"replayed records): {check['items'] - len(differ)}/{check['items']} identical "
                    f"({check['replayed']} of those records replayed)"
                    + (f"; REPLAYED RECORDS DIFFER: {', '.join(check['replayed_differ'][:6])}: not certified"
                       if check["replayed_differ"] else "")
                    + (f"; full decodes differ between runs: {', '.join(check['full_differ'][:6])} (noted)"
                       if check["full_differ"] else ""))
            elif check.get("status") == "unchecked":
                log(f"budget {budget * 100:g}%: replay audit: unchecked (nothing timed and nothing replayed to audit, "
                    "or the audit was lost)")
    confirmed = {f"{k} {specs[k].label()}": recs for k, recs in confirmation.records.items()}  # the frontier
    flips: list[tuple[str, Path]] = []
    for key_, rows in confirmation.evidence.items():  # beside the certificates; logged to MLflow with report/
        write_evidence(out / "evidence" / f"{key_}.csv", rows)
    for key_, recs in confirmation.records.items():  # what each confirmed candidate flipped, and why
        spec = specs[key_]
        order = [it.id for it in items[: confirmation.stopped.get(key_, len(items))]]
        path = write_flips(state.dir / "confirm" / f"{slug(spec.label())}-{spec.key()}" / "flips.parquet",
                           flip_rows(order, confirmation.reference, recs))
        flips.append((f"confirmation: {key_} {spec.label()}", path))
        run_id = next((c.payload.get("mlflow_run_id") for c in candidates if c.key == key_), None)
        if run_id:  # on the candidate's trial run, with the target-only records it was paired with
            state.tracker.log_files(run_id, {path: "confirm", refs.path(ref_spec): "confirm/reference"})
    pool = {**{k: state.split.get(k) for k in ("pool", "pool_sources", "search_sample")},
            "confirm_used": len(items), "confirm_sources": sources,
            "order": "sha256('confirm/' + item id), fixed; no seed", "skipped": attempt.skipped}
    write_json(out / "certification.json", {"budgets": chosen, "noise_floor": list(floors.values()), "pool": pool,
                                            "outlook": outlook})
    table = certification_table(list(chosen.values()), [f for f in floors.values() if not f.get("skipped")])
    return Certification(chosen, table, confirmed, flips)
