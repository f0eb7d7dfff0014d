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
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sweep.attempt import Attempt, family_fields, open_attempt, prior_refusal, statement
from sweep.audit import audit_pending, audit_replayed, audit_withholds
from sweep.certificates import (
    candidates_from,
    certificate_fields,
    confirm_metrics,
    noise_floor_row,
    pool_outlook,
    refutation_note,
    verdict_word,
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
from workers.certify.verdict import futility_level
from workers.engine_registry import engine_traits
from workers.evaluation import Record
from workers.metrics.lossless import baseline_name
from workers.metrics.speed import comparable, measured_text, over_lossless, ratio_text, speed_figures
from workers.results.evidence import confirmation_rows, ordered_prefix, write_evidence
from workers.results.flips import flip_rows, write_flips
from workers.results.ledger import AttemptLedger
from workers.results.store import write_json

if TYPE_CHECKING:
    from sweep.state import SweepState


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
        # the futility stop's level: the refutation's betting half at the level budgets are certified at
        # (plan_futility's alpha), so a futility stop is that budget's refutation (workers.certify.verdict)
        self.futility_alpha = futility_level(alpha)
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
        *smallest*, at ``alpha`` (default: the confirmation's): passing there passes every larger one. The futility
        test runs at the refutation's betting half of ``alpha`` (``verdict.futility_level``)."""
        if alpha is not None:
            self.futility_alpha = futility_level(alpha)
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
                return bool(a) and prune_test(a, b, against, self.futility_alpha)

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
                                                             (self.futility[c.key], self.futility_alpha))
                self.evidence[c.key] = rows
            if (c.key, alpha, budget) not in self._bounds:
                rows = self.evidence[c.key]
                self._bounds[c.key, alpha, budget] = sequential_bound(
                    [r["reference_score"] for r in rows], [r["candidate_score"] for r in rows], self.plan(alpha, budget),
                    budget)
            self.bounds[c.key] = self._bounds[c.key, alpha, budget]
            return self.bounds[c.key]

        cert = fixed_sequence(ordered, bound_of, budget, alpha)
        if not cert.certified and cert.steps:  # the candidate that decided the budget: is its drop shown above it?
            from workers.certify.verdict import refutation
            from workers.results.evidence import refutation_pairs

            key = cert.steps[0][0]
            order = self.order[: self.stopped.get(key, len(self.order))]
            ref, got, failed = refutation_pairs(order, self.reference, self.records.get(key, {}))
            cert.refutation = refutation(ref, got, self.plan(alpha, budget), budget, alpha, imputed=failed)
        return cert


@dataclass(frozen=True)
class Certification:
    """What confirmation decided and left: the chosen rule per budget (as ``chosen/budget-<b>.json`` says), the
    certification table, each confirmed candidate's records (the frontier's lost items) and the flips files
    (the flips page's confirmation sections)."""

    chosen: dict[str, Any]
    table: str
    confirmed: dict[str, dict[str, Record]]
    flips: list[tuple[str, Path]]


def base_choice(state: SweepState, budget: float, attempt: Attempt) -> dict[str, Any]:
    """What every chosen file of the sweep says of where its certificate came from."""
    args = state.settings.args
    return {"budget": budget, "pair": args.pair, "benchmark": state.bench.name, "dtype": args.dtype,
            "sweep": state.name, "parent_run_id": state.tracker.parent_id, "decode": state.settings.decode,
            "engine": args.engine, "split": state.split,
            "search_items": len(state.items), "pair_fingerprint": attempt.ledger.pair_id,
            # what the certificate covers on a server: this endpoint, as /v1/models described it
            **({"endpoint": {"base_url": args.base_url, "model": args.model, "pair_id": args.pair_id,
                             "model_card": state.profile.get("model_card")}}
               if engine_traits(args.engine).needs_server else {})}


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
    timed = audit = None
    if n > 0:
        shared = set(keys)
        order = [it for it in attempt.items if it.id in shared][:n]
        # The fastest lossless may be target-only (L 0): then its arm is a second target-only run, timed in its
        # place like any arm (the two target-only runs also show the timing's own spread).
        fastest = state.refs.lossless_spec(draft_len) if draft_len else state.refs.target_only_spec()
        specs = [state.refs.target_only_spec(), fastest, spec]
        # speed as a deployment samples: the standard sampler; under the coupled one, the same arms decoded with
        # it as well, for the replay check of the records the certificate rests on
        timed = time_items(state.workers[0], s.bench.ref, [x.standard() for x in specs], order,
                           int(str(s.args.concurrency)))
        if spec.sampler == "coupled":
            audit = time_items(state.workers[0], s.bench.ref, specs, order, 1)
    return over_lossless(records, lossless, reference, draft_len, state.cost, timed, audit,
                         coupled=spec.sampler == "coupled")


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
            if ceiling is not None and "; refuted:" not in ceiling:  # the first decision stands, refuting too
                cert.refutation = None
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
            elif withheld and cert.verdict == "refuted":  # the audit doubts the records: they refute nothing either
                cert.refutation = None
            if attempt.id is not None and pending:
                log(f"budget {budget * 100:g}%: left undecided in the ledger until its replay audit is finished")
            elif attempt.id is not None:  # the items this budget's candidates (and its noise floor) used
                used = max((confirmation.stopped.get(k, len(items)) for k, _, _ in cert.steps), default=0)
                attempt.ledger.decide(attempt.id, budget, cert.certified, cert.reason + refutation_note(cert), used)
        pick = cert.chosen or next((c for c in candidates if cert.steps and c.key == cert.steps[0][0]), None)
        choice = {**base_choice(state, budget, attempt), "certified": bool(cert.certified), "verdict": cert.verdict,
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
        verdict = verdict_word(cert)
        what = f"{choice['policy']} (trial {choice.get('trial')})" if choice.get("policy") else "no candidate"
        bound = cert.bound
        log(f"budget {budget * 100:g}%: {verdict}: {what}; "
              + ((f"p = {bound.p_value:.3g}, " if not math.isnan(bound.p_value) else "")
                 + bound_text(bound, f"{bound.upper * 100:.2f}%", single="upper bound")
                 + f" (drop {bound.drop * 100:+.2f}%, n={bound.n}, "
                 f"discordance {bound.discordance:.3f}, alpha {cert.alpha}, per budget"
                 + (f"; look {bound.look} of {bound.looks} at level {bound.alpha:.4g}" if bound.looks > 1 else "") + ")"
                 if bound is not None else cert.reason)
            + ("" if cert.certified or cert.items_needed is None else f"; a certificate needs ~{cert.items_needed} items")
            + refutation_note(cert))
        if choice.get("vs_lossless"):
            vl, va = choice["vs_lossless"], choice["vs_target_only"]
            timed = vl.get("timed") or {}
            coupled = vl.get("modelled_sampler") == "coupled"
            log(f"budget {budget * 100:g}%: speed over the best lossless ({baseline_name(vl['draft_len'])}): modelled "
                  f"{ratio_text(vl['modelled'], 3, 'n/a')} on {vl['items']} items"
                  + (" (the coupled sampler's acceptance, not a deployment's)" if coupled else "") + ", "
                  + (f"measured {ratio_text(vl['measured'], 3, 'n/a')} on {timed['items']} items at concurrency "
                     f"{timed['concurrency']}, interleaved" + (", every arm sampling as a deployment does (the "
                     "standard sampler)" if coupled else "") if "items" in timed else
                     f"not timed ({timed['error']})" if timed.get("error") else "not timed (--speed-items 0)")
                  + f"; over target-only: modelled {ratio_text(va['modelled'], 3, 'n/a')}, "
                  f"{measured_text(va['measured'], 3)}"
                + f"; stated: {ratio_text(vl.get('stated'), 3, 'n/a')}, {vl.get('stated_from', 'modelled')}")
            lat = (timed.get("latency") or {}).get("candidate")
            if lat and lat.get("items"):
                log(f"budget {budget * 100:g}%: latency at concurrency {timed['concurrency']} (candidate, "
                    f"{lat['items']} items): time to first token p50 {lat['ttft_p50_s']:.2f} s, p90 "
                    f"{lat['ttft_p90_s']:.2f} s; time per output token p50 {lat['tpot_p50_s'] * 1e3:.0f} ms, p90 "
                    f"{lat['tpot_p90_s'] * 1e3:.0f} ms")
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
