"""Certify a fixed server configuration: a running server's own lossy mode (vLLM's FLy, SGLang's acceptance
thresholds, TensorRT-LLM's relaxed acceptance, or any request fields) as the one candidate, against a lossless
configuration of the same model, at the deployment's concurrency. No search: the server's knobs are set where it
starts, so there is nothing to ask per request; they are recorded as the user states them (``--server-config``).

    python jobs/sweep.py --engine openai --base-url http://fly:8000/v1 --model M --pair-id llama3.1-8b+eagle3 \\
        --server-config '{"rejection_sample_method": "fly", "fly_window_size": 6}' \\
        --reference-url http://lossless:8000/v1 --concurrency 16 --items 32 --confirm-items 400 --looks 3

Phases, each resumable from its records (``workers.endpoint_eval.compare`` stores each chunk with its wall):

1. **Screen** (the search split's first ``--items``, never confirmation items): both sides interleaved at the
   first ``--concurrency``; the knob check (``workers.endpoint_eval.knob_check``: rule reports, else ``/metrics``
   acceptance must move) refuses a server that ignores its settings before any confirmation item is spent; the
   screen's paired drop orders nothing but says which budgets are worth an attempt (a budget below the screen's
   drop gets no candidate, as in a sweep).
2. **Confirmation**: the ledger (keyed on ``endpoint:<pair-id>``) opens the attempt and gives its items; both
   sides run on them look by look at that concurrency, interleaved chunk by chunk; each budget is decided by the
   same exact paired test, group-sequential looks and futility stop as a sweep's (``sweep.confirm.Confirmation``),
   its per-item evidence kept, its decision told to the ledger once.
3. **Speed**: the certificate's speed is the confirmation run's own (output tokens/s of the whole run, TPOT and
   TTFT percentiles, ``/metrics`` acceptance per side) at the concurrency its evidence ran at; each further
   ``--concurrency`` level is timed on the first ``--speed-items`` confirmation items (a description: the evidence
   is the first level's).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sweep import SweepResult
from sweep.progress import log
from workers.certify.decide import shown_step
from workers.results.store import write_json, write_text

if TYPE_CHECKING:
    from sweep.settings import Settings
    from workers.endpoint_eval import Comparison, Side

KEY = "server"  # the candidate's key in the evidence files and the ledger's plan (with the configuration's digest)


def server_sides(args: Any) -> tuple[Side, Side]:
    """The reference (lossless) and the candidate (the configuration certified) the flags describe."""
    from sweep.settings import endpoint_options
    from workers.endpoint import Endpoint
    from workers.endpoint_eval import Side

    common = {k: v for k, v in endpoint_options(args).items() if k not in ("base_url", "model")}
    reference = Side("reference", Endpoint(args.reference_url or args.base_url, args.reference_model or args.model,
                                           extra_body=dict(args.reference_extra_body or {}), **common), "server",
                     dict(args.reference_config or {}))
    candidate = Side("candidate", Endpoint(args.base_url, args.model, extra_body=dict(args.extra_body or {}), **common),
                     "server", dict(args.server_config or {}))
    if reference.endpoint.describe() == candidate.endpoint.describe():
        raise ValueError("--server-config: the reference and the candidate are the same requests to the same server: "
                         "give --reference-url (the lossless server), or --extra-body / --reference-extra-body")
    return reference, candidate


def levels(args: Any) -> list[int]:
    """``--concurrency``: the evidence's level first, then the further ones timed."""
    from workers.endpoint_cli import concurrency_values

    return concurrency_values(args.concurrency)


def identity(settings: Settings, reference: Side, candidate: Side) -> dict[str, Any]:
    """What makes two invocations the same certification (rerunning it resumes): both sides as stated, the data,
    the decoding, the concurrency the evidence runs at and the plan."""
    args = settings.args
    return {"benchmark": settings.bench.key, "pair_id": args.pair_id, "decode": settings.decode,
            "candidate": {**candidate.endpoint.describe(), "config": candidate.params},
            "reference": {**reference.endpoint.describe(), "config": reference.params},
            "concurrency": levels(args)[0], "screen": args.items, "confirm_items": args.confirm_items,
            "budgets": settings.budgets, "alpha": args.alpha, "looks": args.looks, "joint": bool(args.joint),
            "new_items": bool(args.new_items), "subset_seed": args.subset_seed}


def certify_server(settings: Settings, config_yaml: str) -> SweepResult:
    """Screen, confirm and time a fixed server configuration (see the module). Writes ``report/`` (the chosen
    file per budget, ``certification.json`` and ``.md``, the evidence CSV) under the run directory and logs them
    to MLflow. Returns the run directory, the MLflow run and the decision per budget."""
    from sweep.attempt import Attempt, attempt_items, family_fields, prior_refusal, statement
    from sweep.certificates import certificate_fields, pool_outlook, refutation_note, verdict_word
    from sweep.confirm import Confirmation
    from sweep.settings import ledger_of
    from sweep.tracking import SweepTracker
    from workers.benchmarks.base import pool_sources
    from workers.certify.decide import Candidate, Certificate, drop_bound
    from workers.endpoint import check
    from workers.endpoint_eval import compare, knob_check, speed_interval
    from workers.metrics.trial import score_of
    from workers.results.evidence import write_evidence
    from workers.results.ledger import AttemptLedger, LedgerRefusal, Plan
    from workers.results.store import RecordStore, runs_root, slug

    args, bench = settings.args, settings.bench
    reference, candidate = server_sides(args)
    cards = {s.label: check(s.endpoint) for s in (reference, candidate)}  # one line each when a side is not there
    ident = identity(settings, reference, candidate)
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:10]
    name = f"{bench.key}-{slug(args.pair_id)}-server-{digest}"
    run_dir = Path(args.run_dir) if args.run_dir else runs_root(args.runs_root) / "sweeps" / name
    held = run_dir / "server.json"
    if held.is_file() and json.loads(held.read_text()).get("digest") not in (None, digest):
        raise ValueError(f"--run-dir {run_dir} holds another configuration's records (its server.json differs from "
                         "these flags): give another --run-dir, or none (each configuration gets its own)")
    out = run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    write_text(run_dir / "config.yaml", f"# fixed server configuration {name}: rerunning the command resumes it\n"
                                        f"{config_yaml}")
    write_json(held, {**ident, "digest": digest, "models": cards})
    level, decode = levels(args)[0], settings.decode
    cand_key = f"{KEY}-{digest}"

    def run(phase: str, items: list[Any], at: int) -> Comparison:
        def stores(label: str) -> tuple[RecordStore, Path]:
            where = run_dir / phase / f"c{at}" / label
            return RecordStore(where), where / "walls.jsonl"

        return compare(reference, candidate, bench, items, at, stores, log=lambda line: log(f"{phase}: {line}"),
                       spec_key=cand_key, restart="another --run-dir starts over", **decode)

    tracker = SweepTracker(run_dir, getattr(args, "tracking_uri", None))
    meta = run_dir / "sweep.json"
    before = json.loads(meta.read_text()) if meta.is_file() else {}
    parent = tracker.start_parent(name, {"benchmark": args.benchmark, "pair": args.pair_id, "engine": "openai",
                                         "mode": "server-config", "candidate": ident["candidate"],
                                         "reference": ident["reference"], "concurrency": level,
                                         "budgets": settings.budgets, "alpha": args.alpha, **decode},
                                  {"study": name, "run_dir": str(run_dir)}, before.get("parent_run_id"))
    write_json(meta, {"parent_run_id": parent, "study": name, "mode": "server-config"})

    # 1. the screen, on search-split items: the knob check before any confirmation item is spent
    screen_items = bench.items(limit=args.items or None, seed=args.subset_seed, split="search")
    pool, sources = bench.confirmation_pool(screen_items)
    log(f"screen: {len(screen_items)} search-split items at concurrency {level}; confirmation pool: {len(pool):,} "
        f"held-apart items ({', '.join(f'{k} {v:,}' for k, v in sources.items())})")
    screen = run("screen", screen_items, level)
    refused = knob_check(reference, candidate, [screen], decode.get("temperature"))
    keys = [k for k in screen.reference.records if k in screen.candidate.records]
    sb = drop_bound([score_of(screen.reference.records[k]) for k in keys],
                    [score_of(screen.candidate.records[k]) for k in keys], args.alpha)
    speed = screen.candidate.tokens_per_s / screen.reference.tokens_per_s \
        if screen.reference.tokens_per_s > 0 else math.nan
    if refused is None and screen.reference.figures()["acceptance"] is None and \
            not isinstance(candidate.endpoint.extra_body.get("spec_decode"), dict):
        log("screen: the reference reports no speculation, so the knob check shows only that the candidate "
            "speculates, not that its lossy settings took effect: the configuration is recorded as stated")
    screen_fields = {"items": len(screen_items), "concurrency": level, "drop": sb.drop, "upper": sb.upper,
                     "lost": sb.losses, "won": sb.wins, "discordance": sb.discordance, "tokens_per_s_ratio": speed,
                     "tokens_per_s_interval": speed_interval(screen).to_dict(),
                     "reference": screen.reference.figures(), "candidate": screen.candidate.figures(),
                     "knob_check": refused or "applied"}
    log(f"screen: paired drop {sb.drop * 100:+.2f}% ({sb.losses} lost / {sb.wins} won, n={sb.n}), tokens/s "
        f"{speed_interval(screen).text()} the reference at concurrency {level}; knobs: {refused or 'applied'}")
    cand = Candidate(key=cand_key, speed=speed if math.isfinite(speed) else 1.0, search_drop=sb.drop,
                     search_upper=sb.upper, payload={"family": KEY}, search_discordance=sb.discordance)
    gate = getattr(args, "gate", None)
    gated = None  # the candidate as the gated budget confirms it, where the screen alone would skip that budget
    if gate is not None and cand.search_drop > gate and refused is None:
        log(f"screen: its drop is above the gated {gate * 100:g}%: that budget is confirmed all the same (--gate), so "
            "its verdict can be refuted rather than left undecided")
        gated = replace(cand, search_drop=gate)

    def is_gate(b: float) -> bool:
        return gated is not None and abs(b - gate) < 1e-12

    candidates = [] if refused else [cand]
    alpha_stated = args.alpha / len(settings.budgets) if args.joint else args.alpha
    ledger = ledger_of(settings)
    wanted = args.items if args.confirm_items is None else args.confirm_items
    n_confirm = min(wanted, len(pool)) if wanted else len(pool)
    attempt, items, earlier, refusal, number, cap = None, pool[:n_confirm], [], refused, None, None
    plan_keys = tuple((cand_key,) if cand.search_drop <= b + 1e-9 or is_gate(b) else () for b in settings.budgets)
    if refused is None and any(plan_keys):
        plan = Plan(name, tuple(float(b) for b in settings.budgets), tuple(alpha_stated for _ in settings.budgets),
                    plan_keys, args.looks, n_confirm, str(run_dir.resolve()))
        try:
            attempt, ids, earlier = ledger.open(plan, [it.id for it in pool], bool(args.new_items), pair=args.pair_id,
                                                dtype="server", search_items=[it.id for it in screen_items],
                                                endpoint={"candidate": {**candidate.endpoint.describe(),
                                                                        "model_card": cards["candidate"]},
                                                          "reference": {**reference.endpoint.describe(),
                                                                        "model_card": cards["reference"]}})
            items = attempt_items(attempt, ids, pool, earlier, bool(args.new_items))
            mine = ledger.attempts()[attempt]
            number, cap = mine.get("number"), (mine.get("family") or {}).get("cap")
        except LedgerRefusal as err:
            refusal = f"the ledger ({ledger.path}) refused the attempt: {err}"
            log(f"confirmation {refusal}")
    held_attempt = Attempt(ledger, attempt, [], number=number, cap=cap)
    alpha_each = held_attempt.level(alpha_stated)  # the family's share for this attempt (workers.certify.family)
    for row in pool_outlook(candidates, settings.budgets, 1, len(pool), len(items), alpha_each):
        if row.get("items_needed") is not None and "search_drop" in row:
            log(f"budget {row['budget'] * 100:g}%: a certificate needs ~{row['items_needed']:,} items at the screen's "
                f"discordance {row['search_discordance']:.3f} (80% power, normal approximation; jobs.plan: exact)")

    # 2. confirmation, look by look, both sides interleaved at the deployment's concurrency
    runs: dict[int, Comparison] = {}

    def upto(n: int) -> Comparison:
        if n not in runs:
            runs[n] = run("confirm", items[:n], level)
        return runs[n]

    confirmation = Confirmation(lambda c, stop, n: upto(n).candidate.records, lambda n: upto(n).reference.records,
                                held_attempt.level(args.alpha), 1, [it.id for it in items], looks=args.looks)
    confirmation.plan_futility(candidates, settings.budgets, alpha_each)
    chosen: dict[str, Any] = {}

    def evidence_n() -> int:
        """The confirmation items the evidence ran on: up to a success stop's look, or a futility stop's, or all."""
        return confirmation.stopped.get(cand_key) or (max(runs) if runs else 0)

    said = statement(args.alpha, alpha_stated, held_attempt)
    for budget in settings.budgets:
        if refusal is not None:
            cert = Certificate(budget, alpha_each, False, None, None, [], None, f"refused: {refusal.removeprefix('refused: ')}")
        elif attempt is None:
            cert = Certificate(budget, alpha_each, False, None, None, [], None,
                               "not certified: no candidate (the screen's drop is above every budget)")
        else:
            cert = confirmation.certify([gated] if is_gate(budget) else candidates, budget, alpha_each)
            if cert.steps:  # the knob check again, on the evidence's own run
                last = upto(evidence_n())
                late = knob_check(reference, candidate, [last], decode.get("temperature"))
                if late is not None and cert.certified:
                    cert.certified, cert.reason = False, late
            ceiling = prior_refusal(ledger, attempt, budget)
            if cert.certified and ceiling is not None:
                cert.certified, cert.reason = False, ceiling
            if ceiling is not None and "; refuted:" not in ceiling:  # the first decision stands, refuting too
                cert.refutation = None
            ledger.decide(attempt, budget, cert.certified, cert.reason + refutation_note(cert), evidence_n() if cert.steps else 0)
        choice = {"budget": budget, "pair": args.pair_id, "benchmark": bench.name, "dtype": "server", "sweep": name,
                  "parent_run_id": parent, "decode": decode, "engine": "openai", "mode": "server-config",
                  "pair_fingerprint": ledger.pair_id, "certified": bool(cert.certified), "verdict": cert.verdict,
                  "policy": KEY if cert.steps else None, "params": candidate.params, "draft_len": None,
                  # what the certificate covers: this server configuration, against this reference, at this concurrency
                  "endpoint": {"base_url": args.base_url, "model": args.model, "pair_id": args.pair_id,
                               "model_card": cards["candidate"], "extra_body": candidate.endpoint.extra_body,
                               "server_config": candidate.params},
                  "reference": {"base_url": reference.endpoint.base_url, "model": reference.endpoint.model,
                                "model_card": cards["reference"], "extra_body": reference.endpoint.extra_body,
                                "server_config": reference.params},
                  "concurrency": level, "screen": screen_fields,
                  "certification": {**certificate_fields(cert, {"pool": len(pool), "pool_sources": sources},
                                                         evidence_n(), confirmation.counts,
                                                         confirmation.plan(alpha_each, budget), confirmation.stopped,
                                                         pool_sources(it.id for it in items[:evidence_n()])),
                                    "attempt": attempt, "new_items": bool(args.new_items), "statement": said,
                                    "family": family_fields(held_attempt, alpha_stated),
                                    "earlier_attempts": [AttemptLedger.describe(a) for a in earlier],
                                    "evidence_concurrency": level}}
        if cert.steps and runs:
            used = evidence_n()
            cmp = upto(used)
            ref_f, cand_f = cmp.reference.figures(), cmp.candidate.figures()
            choice["speed"] = {"concurrency": level, "items": used, "endpoint": args.base_url,
                               "reference_endpoint": reference.endpoint.base_url,
                               "tokens_per_s_ratio": cand_f["tokens_per_s"] / ref_f["tokens_per_s"]
                               if ref_f["tokens_per_s"] > 0 else None,
                               "tokens_per_s_interval": speed_interval(cmp).to_dict(),
                               "tpot_p50_ratio": cand_f["tpot_p50_s"] / ref_f["tpot_p50_s"]
                               if ref_f["tpot_p50_s"] > 0 else None,
                               "reference": ref_f, "candidate": cand_f,
                               "how": "the confirmation items, both sides interleaved chunk by chunk at this concurrency"}
        if not cert.certified and cert.steps:
            choice["note"] = "NOT certified: this configuration's evidence is kept, its budget is not met"
        chosen[str(budget)] = choice
        bound = cert.bound
        verdict = verdict_word(cert)
        log(f"budget {budget * 100:g}%: {verdict}: "
            + (f"upper bound {bound.upper * 100:.2f}% (drop {bound.drop * 100:+.2f}%, n={bound.n}, {bound.losses} lost / "
               f"{bound.wins} won, alpha {cert.alpha:g})" if bound is not None else cert.reason)
            + refutation_note(cert)
            + (f"; tokens/s {ratio_cell(choice['speed'])} the reference at concurrency {level}"
               if choice.get("speed") and choice["speed"]["tokens_per_s_ratio"] else ""))

    # 3. speed at each further concurrency, on the first --speed-items confirmation items (a description)
    speed_at: dict[str, Any] = {}
    if any(c.get("speed") for c in chosen.values()) and args.speed_items > 0:
        n = min(args.speed_items, evidence_n())  # never beyond the items the ledger was told the attempt used
        for at in levels(args)[1:]:
            cmp = run("speed", items[:n], at)
            ref_f, cand_f = cmp.reference.figures(), cmp.candidate.figures()
            speed_at[str(at)] = {"items": n, "reference": ref_f, "candidate": cand_f,
                                 "tokens_per_s_ratio": cand_f["tokens_per_s"] / ref_f["tokens_per_s"]
                                 if ref_f["tokens_per_s"] > 0 else None,
                                 "tokens_per_s_interval": speed_interval(cmp).to_dict()}
            log(f"speed at concurrency {at} ({n} confirmation items, interleaved): tokens/s "
                f"{speed_interval(cmp).text()} the reference")
    for choice in chosen.values():
        if speed_at and choice.get("speed"):
            choice["speed_at"] = speed_at
        write_json(out / f"chosen-budget-{choice['budget']}.json", choice)
    for key_, rows in confirmation.evidence.items():
        write_evidence(out / "evidence" / f"{key_}.csv", rows)
    used_items = items[:evidence_n()]
    write_json(out / "certification.json", {"budgets": chosen, "screen": screen_fields,
                                            "pool": {"pool": len(pool), "pool_sources": sources,
                                                     "confirm_used": len(used_items),
                                                     "confirm_sources": pool_sources(it.id for it in used_items)}})
    write_text(out / "certification.md", certification_page(name, chosen, speed_at))
    try:
        tracker.log_report(out, chosen)
        ratios = {f"confirm.budget_{b}.tokens_per_s_ratio": c["speed"]["tokens_per_s_ratio"]
                  for b, c in chosen.items() if (c.get("speed") or {}).get("tokens_per_s_ratio")}
        tracker.log_metrics({"screen.drop": sb.drop, "screen.tokens_per_s_ratio": speed, **ratios})
    finally:
        tracker.end()
    log(f"report: {out / 'certification.md'}")
    return SweepResult(run_dir.resolve(), parent, chosen)


def ratio_cell(speed: dict[str, Any]) -> str:
    """A tokens/s ratio with its 95% interval over paired chunks (workers.endpoint_checks.speed_interval), or
    saying there is none."""
    ci = speed.get("tokens_per_s_interval") or {}
    head = f"{speed['tokens_per_s_ratio']:.3f}x"
    if ci.get("low") is None:
        return head + f" (no interval: {ci.get('paired_chunks', 0)} paired chunks)"
    return head + f" ({ci['low']:.3f}-{ci['high']:.3f}" + (", holds 1.0)" if ci.get("holds_one") else ")")


def _not_certified(cert: dict[str, Any]) -> str:
    refuted = cert.get("verdict") == "refuted" and cert.get("refutation")
    return f"REFUTED: {refuted['reason'].removeprefix('refuted: ')}" if refuted else cert["reason"]


def certification_page(name: str, chosen: dict[str, Any], speed_at: dict[str, Any]) -> str:
    """``report/certification.md``: per budget, the decision, its bound and n, and the speed it came with."""
    first = next(iter(chosen.values()))
    ep, ref = first["endpoint"], first["reference"]
    lines = [f"# {name}: a fixed server configuration", "",
             f"- candidate: `{ep['base_url']}` model `{ep['model']}`, configuration as stated "
             f"`{json.dumps(ep['server_config'])}`, request fields `{json.dumps(ep['extra_body'])}`",
             f"- reference: `{ref['base_url']}` model `{ref['model']}`, configuration as stated "
             f"`{json.dumps(ref['server_config'])}`, request fields `{json.dumps(ref['extra_body'])}`",
             f"- pair id (the ledger's key): `{first['pair_fingerprint']}`; evidence at concurrency "
             f"{first['concurrency']}; screen: {first['screen']['items']} search-split items, knobs "
             f"{first['screen']['knob_check']}", "",
             f"- statement: {first['certification'].get('statement')}; looks: "
             f"{(first['certification'].get('sequential') or {}).get('looks', 1)}",
             "",
             "| budget | decision | upper bound | drop | p | n | lost / won | failed (reference / candidate) | "
             "tokens/s over the reference | TPOT p50 ratio |",
             "|---:|---|---:|---:|---:|---:|---|---|---:|---:|"]
    for b, c in chosen.items():
        cert, sp = c["certification"], c.get("speed") or {}

        def pct(v: Any) -> str:
            return f"{v * 100:.2f}%" if isinstance(v, float) and math.isfinite(v) else "-"

        step = shown_step(cert)
        p = cert.get("p_value")
        lines.append(f"| {float(b) * 100:g}% | {'CERTIFIED' if c['certified'] else _not_certified(cert)} | "
                     f"{pct(cert.get('bound'))} | {pct(cert.get('drop'))} | {f'{p:.3g}' if p is not None else '-'} | "
                     f"{cert.get('n') or '-'} | {step.get('losses', '-')} / {step.get('wins', '-')} | "
                     f"{cert.get('reference_failed', '-')} / {cert.get('candidate_failed', '-')} | "
                     + (ratio_cell(sp) if sp.get("tokens_per_s_ratio") else "-") + " | "
                     + (f"{sp['tpot_p50_ratio']:.3f}" if sp.get("tpot_p50_ratio") else "-") + " |")
    if speed_at:
        lines += ["", "Speed at further concurrency (descriptions; the evidence ran at the first):", ""]
        lines += [f"- concurrency {at}: tokens/s {ratio_cell(v)} on {v['items']} items"
                  for at, v in speed_at.items() if v.get("tokens_per_s_ratio")]
    return "\n".join(lines) + "\n"
