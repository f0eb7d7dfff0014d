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
from pathlib import Path
from typing import Any

from jobs.speed import over_lossless, speed_figures
from workers.certify.decide import (
    Candidate,
    Certificate,
    DropBound,
    certifies,
    fixed_sequence,
    items_needed,
    order_candidates,
    prune_test,
    sequential_bound,
)
from workers.certify.exact import METHOD as EXACT
from workers.certify.exact import exact_bound
from workers.certify.sequential import RHO, LookPlan, look_plan
from workers.evaluation import Record
from workers.metrics import score_of
from workers.results.evidence import (
    bound_between,
    confirmation_rows,
    ordered_prefix,
    write_evidence,
)
from workers.results.flips import flip_rows, write_flips
from workers.results.ledger import AttemptLedger, LedgerRefusal, Plan
from workers.results.store import write_json


def candidates_from(frame: Any) -> list[Candidate]:
    """The search's COMPLETE trials as candidates (speed: the sweep's objective speedup)."""
    if frame is None or not len(frame):
        return []
    out = []
    for row in frame.iter_rows(named=True):
        if row.get("state") != "COMPLETE" or not math.isfinite(row.get("speedup") or math.nan):
            continue
        out.append(Candidate(key=f"trial-{row['trial']}", speed=float(row["speedup"]),
                             search_drop=float(row["accuracy_drop"]),
                             search_upper=float(row.get("accuracy_drop_upper", row["accuracy_drop"])),
                             payload=dict(row), search_discordance=float(row.get("discordance", math.nan))))
    return out


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


def certificate_fields(cert: Certificate, split: dict[str, Any], n_items: int,
                       counts: dict[str, dict[str, int]] | None = None, plan: LookPlan | None = None,
                       stopped: dict[str, int] | None = None, sources: dict[str, int] | None = None
                       ) -> dict[str, Any]:
    """What ``chosen/budget-<b>.json`` and the MLflow tags say about a budget's certificate; ``counts``
    (``Confirmation.counts``): each tested candidate's failed and missing items, by arm; ``plan`` and
    ``stopped``: the group-sequential design and where each candidate stopped on success; ``sources``: the
    confirmation items by source (the pool's composition as used, never a split's name alone)."""
    bound, counts = cert.bound, counts or {}
    shown = cert.chosen.key if cert.chosen else (cert.steps[0][0] if cert.steps else None)
    design = None if plan is None else {**plan.to_dict(), "look": None if bound is None else bound.look,
                                        "stopped_at": (stopped or {}).get(shown)}
    return {**counts.get(shown, {}), "sequential": design,
        "certified": bool(cert.certified), "alpha": cert.alpha, "reason": cert.reason,
        "bound": None if bound is None else bound.upper, "drop": None if bound is None else bound.drop,
        "n": None if bound is None else bound.n, "discordance": None if bound is None else bound.discordance,
        "method": None if bound is None else bound.method, "items_needed": cert.items_needed,
        "p_value": None if bound is None or math.isnan(bound.p_value) else bound.p_value,
        "evidence": None if shown is None else f"evidence/{shown}.csv",
        "confirm_split": composition(sources or {}, n_items), "confirm_sources": sources,
        "confirm_items": n_items, "pool": split.get("pool"),
        "pool_sources": split.get("pool_sources"),
        "steps": [{"candidate": key, "passed": passed, **b.to_dict(), **counts.get(key, {})}
                  for key, b, passed in cert.steps],
    }


def composition(sources: dict[str, int], n_items: int) -> str:
    """How a certificate names its items: '120 held-apart items: gsm8k/test 18 + gsm8k/train 102'."""
    parts = " + ".join(f"{k} {v:,}" for k, v in sources.items())
    return f"{n_items:,} held-apart items" + (f": {parts}" if parts else "")


def _confirm_metrics(bound: DropBound, speed: dict[str, float], records: dict[str, Record]) -> dict[str, float]:
    """One candidate's confirmation figures, under the same names as the search's (``confirm.<name>``
    next to ``search.<name>`` in MLflow, so the compare view lines them up)."""
    scores = [score_of(r) for r in records.values()]
    out = {"accuracy": sum(scores) / len(scores) if scores else math.nan, "accuracy_drop": bound.drop,
           "accuracy_drop_upper": bound.upper, "discordance": bound.discordance, "items": float(bound.n),
           "failures": float(sum(r.failed for r in records.values()))}
    # speed only as speed.<kind>_<per_token|per_answer> (ratios of sums): the search's speedup_vs_ar_* are
    # other definitions (a mean of per-item ratios, measured), so they never share a name
    out.update({f"speed.{k}": v for k, v in speed.items()})
    return out


def noise_floor_row(reference: dict[str, Record], lossless: dict[str, Record], alpha: float, draft_len: int,
                    budgets: Sequence[float] = ()) -> dict[str, Any]:
    """Lossless vs target-only on the confirmation items at ``draft_len``: its own row, never folded into
    another number. What it measures is the *discordance* (the share of items whose correctness differs,
    from numerics alone: the same rule, other kernels) and the *output divergence* (items whose tokens
    differ). Its one-sided bound mostly reflects n (zero discordance still bounds 53% at n = 4, 6% at
    n = 40), so it is not "the smallest budget that can be told from noise"; what the discordance does
    tell is how many items a certificate at each budget needs even for a lossless-like rule
    (``items_needed.<b>``, 80% power, normal approximation). ``drop_lo``/``drop_hi``: a two-sided
    (1 - alpha) exact interval for the lossless drop (each side the exact bound at alpha / 2)."""
    bound = bound_between(reference, lossless, alpha)
    keys = [k for k in reference if k in lossless]
    differ = sum(reference[k].output_token_ids != lossless[k].output_token_ids for k in keys)
    row: dict[str, Any] = {"draft_len": draft_len, "items": len(keys),
                           "output_divergence": differ / len(keys) if keys else math.nan,
                           "discordance": bound.discordance, **{f"bound.{k}": v for k, v in bound.to_dict().items()}}
    if keys and bound.method == EXACT:
        row["drop_hi"] = exact_bound(bound.losses, bound.wins, bound.n, alpha / 2)
        row["drop_lo"] = -exact_bound(bound.wins, bound.losses, bound.n, alpha / 2)
    if keys and math.isfinite(bound.discordance):
        d = max(bound.mean_sq, 1.0 / len(keys))  # zero seen is not zero: at least one item in n
        row.update({f"items_needed.{b:g}": items_needed(min(d, 1.0), b, 0.0, alpha) for b in budgets})
    return row


def pool_outlook(candidates: list[Candidate], budgets: Sequence[float], limit: int | None, pool: int,
                 used: int, alpha: float) -> list[dict[str, Any]]:
    """Before confirmation, per budget: the first candidate of its sequence, the items a certificate of it
    would need at its *search* discordance and drop (80% power, normal approximation: ``jobs.plan``
    gives the exact figure), and the smallest budget the whole pool could certify for it."""
    rows = []
    for budget in budgets:
        first = order_candidates(candidates, budget, limit=limit)[:1]
        if not first:
            rows.append({"budget": budget, "candidate": None})
            continue
        c = first[0]
        d = c.search_discordance
        if not math.isfinite(d):
            rows.append({"budget": budget, "candidate": c.key})
            continue
        drop = min(max(c.search_drop, 0.0), d)  # never plan on the candidate beating the reference
        d = min(max(d, abs(drop), 1e-6), 1.0)
        need = items_needed(d, budget, drop, alpha)
        lo, hi = max(drop, 0.0), 1.0  # the smallest budget whose plan fits in the pool
        while hi - lo > 1e-4:
            mid = (lo + hi) / 2
            plan = items_needed(d, mid, drop, alpha) if mid > drop else None
            lo, hi = (lo, mid) if plan is not None and plan <= pool else (mid, hi)
        rows.append({"budget": budget, "candidate": c.key, "search_discordance": d, "search_drop": drop,
                     "items_needed": need, "pool": pool, "used": used, "smallest_budget_for_pool": hi})
    return rows


def open_attempt(sweep: Any, candidates: list[Candidate], alpha_each: float
                 ) -> tuple[str | None, str | None, list[dict[str, Any]]]:
    """Before any confirmation item is evaluated: the attempt's plan (every budget's candidates in test order),
    opened in the ledger of this benchmark and model pair, which gives the attempt its items (``sweep.confirm_items``
    is set to them). Returns (attempt id or None when no budget has a candidate, the refusal or None, the earlier
    attempts)."""
    from workers.models.identity import pair_fingerprint

    args, budgets = sweep.args, sweep.s["budgets"]
    keys = tuple(tuple(sweep.spec_of(c.payload).key() for c in order_candidates(candidates, b, limit=args.confirm_candidates))
                 for b in budgets)
    sweep.ledger = AttemptLedger(getattr(sweep.bench, "ledger_key", sweep.bench.key), pair_fingerprint(args.pair))
    if not any(keys):
        return None, None, []
    plan = Plan(sweep.name, tuple(float(b) for b in budgets), tuple(alpha_each for _ in budgets), keys, args.looks,
                sweep.n_confirm, str(Path(sweep.dir).resolve()))
    try:
        attempt, ids, earlier = sweep.ledger.open(plan, [it.id for it in sweep.pool], bool(args.new_items),
                                                  pair=args.pair, dtype=args.dtype,
                                                  search_items=[it.id for it in sweep.items])
    except LedgerRefusal as err:
        print(f"[sweep] confirmation REFUSED by the ledger ({sweep.ledger.path}): {err}", flush=True)
        return None, str(err), []
    by_id = {it.id: it for it in sweep.pool}
    missing = [i for i in ids if i not in by_id]
    if missing:
        raise ValueError(f"attempt {attempt} resumes on {len(missing)} item(s) no longer in the pool "
                         f"(e.g. {missing[0]}): the benchmark's data changed since it opened")
    sweep.confirm_items = [by_id[i] for i in ids]
    where = {it.id: k for k, it in enumerate(sweep.pool)}
    chosen, last = set(ids), max(where[i] for i in ids) if ids else -1
    # the pool items before the last chosen one that earlier attempts had used: what recomputing the front needs
    sweep.skipped = [it.id for it in sweep.pool[: last + 1] if it.id not in chosen]
    print(f"[sweep] confirmation attempt {attempt}: {len(ids):,} items from the pool's fixed order"
          + (" (the first no earlier attempt used)" if args.new_items else "")
          + (f"; {len(earlier)} earlier attempt(s) on this pair and benchmark" if earlier else ""), flush=True)
    return attempt, None, earlier


def certify_sweep(sweep: Any, frame: Any, out: Path) -> tuple[dict[str, Any], str]:
    """Confirm every budget of ``sweep`` (a ``jobs.sweep.Sweep``) and write what was decided:
    ``<out>/chosen-budget-<b>.json`` and ``certification.json``. Returns the chosen policies by
    budget (as text), each carrying ``certified`` and its evidence, and the markdown table."""
    from dashboards.tables import certification_table
    from workers.evaluation import TARGET_ONLY, DecodeSpec
    from workers.results.store import RecordStore, slug

    args, decode = sweep.args, sweep.s["decode"]
    candidates = candidates_from(frame)
    # --joint: one statement across budgets (Bonferroni): P(any certified budget is wrong) <= alpha
    alpha_each = args.alpha / len(sweep.s["budgets"]) if args.joint else args.alpha
    attempt, refusal, earlier = open_attempt(sweep, candidates, alpha_each)
    key = "confirm:" + TARGET_ONLY
    ref_spec = DecodeSpec.make(TARGET_ONLY, **decode)

    def reference_upto(n: int) -> dict[str, Record]:  # look by look: the first n confirmation items
        got = sweep.reference(ref_spec, "target-only reference (confirm)", sweep.confirm_items[:n])
        sweep.refs[key] = {**sweep.refs.get(key, {}), **got}
        return {it.id: sweep.refs[key][it.id] for it in sweep.confirm_items if it.id in sweep.refs[key]}

    specs: dict[str, DecodeSpec] = {}

    def evaluate(c: Candidate, stop: Callable[[dict[str, Record]], bool], n: int) -> dict[str, Record]:
        spec = specs[c.key] = sweep.spec_of(c.payload)
        store = RecordStore(sweep.dir / "confirm" / f"{slug(spec.label())}-{spec.key()}")
        return sweep.run_items(spec, f"confirm {c.key} {spec.label()} (items {n:,})", store,
                               sweep.confirm_items[:n], stop, timeout=False)

    confirmation = Confirmation(evaluate, reference_upto, args.alpha, args.confirm_candidates,
                                [it.id for it in sweep.confirm_items], looks=args.looks)
    confirmation.plan_futility(candidates, sweep.s["budgets"], alpha_each)
    if args.looks > 1:
        for budget in sweep.s["budgets"]:
            plan = confirmation.plan(alpha_each, budget)
            print(f"[sweep] budget {budget * 100:g}%: group-sequential looks at {', '.join(f'{n:,}' for n in plan.sizes)} "
                  f"items, levels {', '.join(f'{a:.4g}' for a in plan.alphas)} (alpha {alpha_each:g} spent as "
                  f"alpha * t^{plan.rho:g}, {'calibrated exactly' if plan.budget is not None else 'union bound'}); "
                  "a candidate that certifies at a look stops there", flush=True)
    outlook = pool_outlook(candidates, sweep.s["budgets"], args.confirm_candidates, sweep.split.get("pool", 0),
                           len(sweep.confirm_items), args.alpha)
    for row in outlook:
        if row.get("items_needed", -1) != -1:
            need = "never (its search drop is at or above the budget)" if row["items_needed"] is None \
                else f"~{row['items_needed']:,} items"
            print(f"[sweep] budget {row['budget'] * 100:g}%: {row['candidate']} first (search discordance "
                  f"{row['search_discordance']:.3f}, drop {row['search_drop'] * 100:+.2f}%): a certificate needs {need} "
                  f"(80% power, normal approximation); the pool of {row['pool']:,} ({row['used']:,} used) can certify "
                  f"down to ~{row['smallest_budget_for_pool'] * 100:.2f}%", flush=True)
    chosen: dict[str, Any] = {}
    figures: dict[str, dict[str, float]] = {}  # candidate key -> its confirmation figures (bootstrap once)
    floors: dict[int, dict[str, Any]] = {}
    speeds: dict[str, dict[str, Any]] = {}  # candidate key -> its vs_lossless / vs_target_only figures

    def figures_of(key: str) -> dict[str, float]:
        bound = confirmation.bounds.get(key)
        if key not in figures and bound is not None:
            recs = confirmation.records.get(key, {})
            figures[key] = _confirm_metrics(bound, speed_figures(recs, confirmation.reference, sweep.cost_ratio,
                                                                 sweep.verify_factor), recs)
            run_id = next(c for c in candidates if c.key == key).payload.get("mlflow_run_id")
            if run_id:  # the figures on the candidate's own trial run, next to its search.<m>
                sweep.tracker.log_to_run(run_id, {f"confirm.{k}": v for k, v in figures[key].items()},
                                         {"confirmed": "true"})
        return figures.get(key, {})

    ledger_fields = {"attempt": attempt, "new_items": bool(args.new_items),
                     "earlier_attempts": [AttemptLedger.describe(a) for a in earlier],
                     "pool_order": "sha256('confirm/' + item id), then the first items no earlier attempt used"
                     if args.new_items else "sha256('confirm/' + item id)"}
    from workers.benchmarks.base import pool_sources

    sources = pool_sources(it.id for it in sweep.confirm_items)
    for budget in sweep.s["budgets"]:
        if refusal is not None:
            cert = Certificate(budget, alpha_each, False, None, None, [], None, f"refused: {refusal}")
        else:
            cert = confirmation.certify(candidates, budget, alpha_each)
            before = sweep.ledger.attempts().get(attempt, {}).get("decided", {}).get(str(float(budget))) \
                if attempt is not None else None
            if before is not None and cert.certified and not before.get("certified"):
                # a resumed attempt decided this budget before: that decision is its ceiling
                cert.certified = False
                cert.reason = (f"not certified: attempt {attempt} decided this budget before ({before['when']}: "
                               f"{before['reason']}); a re-decision cannot overturn it")
            if attempt is not None:  # the items this budget's candidates (and its noise floor) used
                used = max((confirmation.stopped.get(k, len(sweep.confirm_items)) for k, _, _ in cert.steps), default=0)
                sweep.ledger.decide(attempt, budget, cert.certified, cert.reason, used)
        pick = cert.chosen or next((c for c in candidates if cert.steps and c.key == cert.steps[0][0]), None)
        choice = {**sweep.base_choice(budget), "certified": bool(cert.certified),
                  "certification": {**certificate_fields(cert, sweep.split, len(sweep.confirm_items),
                                                         confirmation.counts, confirmation.plan(alpha_each, budget),
                                                         confirmation.stopped, sources), **ledger_fields,
                                    "statement": (f"joint: every certified budget at once, family alpha {args.alpha:g} "
                                                  f"(Bonferroni, {alpha_each:g} each)") if alpha_each != args.alpha
                                    else f"per budget, alpha {args.alpha:g} each"}}
        if pick is None:
            choice.update(policy=None)
        else:
            row = pick.payload
            spec = sweep.spec_of(row)
            confirm = figures_of(pick.key)
            if args.skip_noise_floor:
                floors.setdefault(spec.draft_len, {"draft_len": spec.draft_len, "skipped": True})
            elif spec.draft_len not in floors:  # on the items the candidate's certificate used
                used = confirmation.stopped.get(pick.key, len(sweep.confirm_items))
                reference = confirmation.reference_upto(used)
                floors[spec.draft_len] = noise_floor_row(reference, sweep.lossless(spec.draft_len, "confirm", used),
                                                         args.alpha, spec.draft_len, sweep.s["budgets"])
            used = confirmation.stopped.get(pick.key, len(sweep.confirm_items))
            if pick.key not in speeds:  # over the best lossless and over target-only, modelled and measured
                speeds[pick.key] = over_lossless(sweep, row, confirmation.records.get(pick.key, {}),
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
        state = "CERTIFIED" if cert.certified else "REFUSED" if cert.reason.startswith("refused") else "not certified"
        what = f"{choice['policy']} (trial {choice.get('trial')})" if choice.get("policy") else "no candidate"
        bound = cert.bound
        print(f"[sweep] budget {budget * 100:g}%: {state}: {what}; "
              + ((f"p = {bound.p_value:.3g}, " if not math.isnan(bound.p_value) else "")
                 + f"upper bound {bound.upper * 100:.2f}% (drop {bound.drop * 100:+.2f}%, n={bound.n}, "
                 f"discordance {bound.discordance:.3f}, alpha {cert.alpha}, per budget"
                 + (f"; look {bound.look} of {bound.looks} at level {bound.alpha:.4g}" if bound.looks > 1 else "") + ")"
                 if bound is not None else cert.reason)
              + ("" if cert.certified or cert.items_needed is None else f"; a certificate needs ~{cert.items_needed} items"),
              flush=True)
        if choice.get("vs_lossless"):
            vl, va = choice["vs_lossless"], choice["vs_target_only"]
            timed = vl.get("timed") or {}
            print(f"[sweep] budget {budget * 100:g}%: speed over the best lossless (L {vl['draft_len']}): modelled "
                  f"{vl['modelled']:.3f}x on {vl['items']} items, measured {vl['measured']:.3f}x"
                  + (f" on {timed['items']} items at batch {timed['concurrency']}, interleaved" if timed else
                     " (not timed: --speed-items 0)")
                  + f"; over target-only: modelled {va['modelled']:.3f}x, measured {va['measured']:.3f}x"
                  + f"; stated: {vl.get('stated', math.nan):.3f}x, {vl.get('stated_from', 'modelled')}", flush=True)
    sweep.confirmed = {f"{k} {specs[k].label()}": recs for k, recs in confirmation.records.items()}  # the frontier
    for key_, rows in confirmation.evidence.items():  # beside the certificates; logged to MLflow with report/
        write_evidence(out / "evidence" / f"{key_}.csv", rows)
    for key_, recs in confirmation.records.items():  # what each confirmed candidate flipped, and why
        spec = specs[key_]
        order = [it.id for it in sweep.confirm_items[: confirmation.stopped.get(key_, len(sweep.confirm_items))]]
        path = write_flips(sweep.dir / "confirm" / f"{slug(spec.label())}-{spec.key()}" / "flips.parquet",
                           flip_rows(order, confirmation.reference, recs))
        sweep.flips[f"confirmation: {key_} {spec.label()}"] = path
        run_id = next((c.payload.get("mlflow_run_id") for c in candidates if c.key == key_), None)
        if run_id:  # on the candidate's trial run, with the target-only records it was paired with
            sweep.tracker.log_files(run_id, {path: "confirm", sweep.reference_path(ref_spec): "confirm/reference"})
    pool = {**{k: sweep.split.get(k) for k in ("pool", "pool_sources", "search_sample")},
            "confirm_used": len(sweep.confirm_items), "confirm_sources": sources,
            "order": "sha256('confirm/' + item id), fixed; no seed", "skipped": getattr(sweep, "skipped", [])}
    write_json(out / "certification.json", {"budgets": chosen, "noise_floor": list(floors.values()), "pool": pool,
                                            "outlook": outlook})
    return chosen, certification_table(list(chosen.values()), [f for f in floors.values() if not f.get("skipped")])
