"""``jobs.evaluate --engine openai``: the flags turned into two sides (``workers.endpoint_eval.Side``), the servers
checked, the items run at each ``--concurrency`` and the figures printed and written.

Where the records go: ``<runs root>/eval-endpoint/<benchmark>-<model>/<digest>/c<C>/<side>/`` (the digest covers
both sides' servers and extra bodies and the decoding settings), so a rerun of the same command resumes and another
configuration never mixes with it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

from workers.endpoint import Endpoint, EndpointError, check
from workers.endpoint_eval import Side, compare, comparison_lines, knob_verdict, speed_interval


def concurrency_values(text: str) -> list[int]:
    try:
        values = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--concurrency must be integers like 1,4,16, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise ValueError(f"--concurrency must be integers >= 1, got {text!r}")
    return values


def json_object(flag: str, text: str | None) -> dict[str, Any]:
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{flag} must be a JSON object: {err.msg} at character {err.pos}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object, got {type(value).__name__}")
    return value


def sides(args: argparse.Namespace) -> tuple[Side, Side]:
    """The reference and the candidate the flags describe (the rule's knobs validated here, by the registry)."""
    from policies import make_policy
    from workers.cli import parse_params, sampling_truncation
    from workers.evaluation import TARGET_ONLY

    if not args.base_url:
        raise ValueError("--engine openai needs --base-url (the server's OpenAI base url, e.g. http://127.0.0.1:8000/v1)")
    extra = json_object("--extra-body", args.extra_body)
    ref_extra = json_object("--reference-extra-body", args.reference_extra_body)
    truncation = sampling_truncation(args)  # both sides sample the same truncated distribution
    for flag, body in (("--extra-body", extra), ("--reference-extra-body", ref_extra)):
        clash = sorted(set(truncation) & set(body))
        if clash:
            raise ValueError(f"{flag} sets {', '.join(clash)} and so does --{clash[0].replace('_', '-')}: give it once")
        body.update(truncation)
    params = parse_params(args.param)
    common = dict(api_key_env=args.api_key_env, timeout_s=args.request_timeout, retries=args.retries)
    reference_policy = TARGET_ONLY
    if args.knobs in ("spectune", "vllm"):
        if args.policy in (TARGET_ONLY, "lossless") and args.knobs == "vllm":
            raise ValueError("--knobs vllm compares a rule with the server's own (lossless) rejection sampling: "
                             "name a lossy rule")
        if args.policy == TARGET_ONLY:
            raise ValueError("--policy target-only is the reference itself: name the rule to compare with it")
        rule = make_policy(args.policy, **params)  # an unknown rule or knob: one line, before any request
        if args.knobs == "spectune":
            extra = {"spec_decode": {"policy": args.policy, "params": rule.config.to_dict(),
                                     "draft_len": args.draft_len}, **extra}
            ref_extra = {"spec_decode": {"policy": "off"}, **ref_extra}
            policy, draft_len = args.policy, args.draft_len
        else:  # a stock `vllm serve` with spectune's plugin: the rule as a JSON string in vllm_xargs
            from workers.vllm.rules import RULE_ARG

            carried = json.dumps({"policy": args.policy, "params": rule.config.to_dict(), "seed": args.seed})
            extra = {"vllm_xargs": {RULE_ARG: carried}, **extra}
            policy, draft_len, reference_policy = args.policy, 0, "server"  # L is the server's; lossless there
    else:
        policy, draft_len, params = "server", 0, {}
        reference_policy = "server"
    model = args.model
    if (args.reference_url or args.base_url) == args.base_url and (args.reference_model or model) == model \
            and ref_extra == extra:
        raise ValueError("the reference and the candidate are the same configuration (one server, the same extra "
                         "body): give --extra-body, --reference-extra-body or --reference-url, or --knobs spectune/vllm")
    reference = Side("reference", Endpoint(args.reference_url or args.base_url, args.reference_model or model,
                                           extra_body=ref_extra, **common), reference_policy)
    candidate = Side("candidate", Endpoint(args.base_url, model, extra_body=extra, **common), policy,
                     params if args.knobs != "none" else {}, draft_len)
    return reference, candidate


def run_endpoint_evaluation(args: argparse.Namespace) -> int:
    from workers.benchmarks import get_benchmark
    from workers.cli import parse_shard, sampling_truncation
    from workers.evaluation import DecodeSpec
    from workers.results.store import RecordStore, runs_root, slug

    levels = concurrency_values(args.concurrency)
    bench = get_benchmark(args.benchmark)
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {args.limit}")
    try:
        reference, candidate = sides(args)
        cards = {s.label: check(s.endpoint) for s in (reference, candidate)}
    except EndpointError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    items = bench.items(limit=args.limit, shard=parse_shard(args.shard), seed=args.subset_seed)
    max_new = args.max_new_tokens or bench.default_max_new_tokens
    decode = dict(shots=args.shots, max_new_tokens=max_new, temperature=args.temperature, seed=args.seed)
    spec_key = DecodeSpec.make(candidate.policy if args.knobs != "none" else "lossless", candidate.params,
                               max(1, candidate.draft_len), **decode, **sampling_truncation(args)).key()
    # what the servers run beyond the request (their flags) is not visible here: --tag names it
    identity = json.dumps({"reference": reference.endpoint.describe(), "candidate": candidate.endpoint.describe(),
                           "decode": decode, "benchmark": bench.key, "tag": args.tag}, sort_keys=True)
    digest = hashlib.sha1(identity.encode()).hexdigest()[:12]
    root = runs_root(args.runs_root) / "eval-endpoint" / slug(f"{bench.key}-{candidate.endpoint.model}") / digest
    if args.fresh and root.is_dir():
        import shutil

        shutil.rmtree(root)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({**json.loads(identity), "models": cards}, indent=1, default=str))
    print(f"endpoint evaluation: {bench.name}, {len(items)} items, concurrency {', '.join(map(str, levels))}; "
          f"candidate {candidate.endpoint.base_url} {json.dumps(candidate.endpoint.extra_body)}, reference "
          f"{reference.endpoint.base_url} {json.dumps(reference.endpoint.extra_body)}; records in {root}", file=sys.stderr)
    summary: dict[str, Any] = {"config": json.loads(identity), "levels": {}}
    comparisons = []
    for level in levels:
        def stores(label: str, level: int = level) -> tuple[RecordStore, Path]:
            where = root / f"c{level}" / label
            return RecordStore(where), where / "walls.jsonl"

        cmp = compare(reference, candidate, bench, items, level, stores,
                      log=lambda line: print(line, file=sys.stderr, flush=True), spec_key=spec_key, **decode)
        comparisons.append(cmp)
        print("\n".join(comparison_lines(cmp, max_new_tokens=max_new, shots=args.shots)), flush=True)
        summary["levels"][str(level)] = {"reference": cmp.reference.figures(), "candidate": cmp.candidate.figures(),
                                         "tokens_per_s_ratio": speed_interval(cmp).to_dict(), "resumed": cmp.resumed}
    # every level and every chunk pooled; at T = 0 the outputs at concurrency 1 too
    verdict = knob_verdict(reference, candidate, comparisons, args.temperature)
    summary["knobs_applied"] = verdict.applied
    summary["knob_check"] = verdict.to_dict()
    (root / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    print(f"summary: {root / 'summary.json'}", file=sys.stderr)
    if verdict.applied:
        print(verdict.line(), flush=True)
        return 0
    print(verdict.refusal(), file=sys.stderr)
    return 3
