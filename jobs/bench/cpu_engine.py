"""Benchmark: the CPU engine on the real pair — target-only vs lossless vs lossy rules, side by side, in one or
more pair dtypes.

    python -m jobs.bench.cpu_engine [--dtypes fp32,int4+int8] [--items 6] [--max-new-tokens 128] [--shots 0]

GSM8K test questions (chat prompts, ``--shots`` worked examples before each: 8 is the sweep's few-shot setting,
~1,410 tokens), greedy. Every configuration of every dtype runs on each item
before the next item starts, so load drifts hit all of them alike; speedups are paired per item
(Spec-Bench's convention: per-item tokens/s ratio, then the mean). Modelled speedups use each dtype's cost
profile measured on this machine at the context these items decode at (``workers.models.calibrate.workload_context``;
measured here if absent); where that is not the default 128 positions, a second column models them with the
128-position profile too, so the gap a short calibration leaves at long contexts is seen beside the fix. The first
dtype is the baseline, the last the fast one: beside the table it prints target-only speed of the last over the
first, lossless at its fastest L over target-only, and the last dtype's c and v(5). Prints a markdown table per
dtype and writes the raw per-item rows as JSON under ``--out``. No assertions: this is a measurement.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from policies import make_policy
from workers.cli import one_line_errors
from workers.cpu_engine import SpecDecoder
from workers.metrics.cost import speedup_vs_target_only
from workers.models.calibrate import CONTEXT, get_profile, machine_key, workload_context
from workers.models.pair import auto_dtype, load_pair, native_dtype, resolve_dtype
from workers.prompts import encode_chat


@dataclass
class Config:
    label: str
    policy: str | None  # None = target-only
    params: dict = field(default_factory=dict)
    draft_len: int = 5


CONFIGS = [
    Config("target-only", None, draft_len=0),
    *(Config(f"lossless L={n}", "lossless", draft_len=n) for n in (2, 3, 4, 5, 6, 8)),
    Config("kl_judge τ=0.5", "kl_judge", {"threshold": 0.5}),
    Config("kl_judge τ=2", "kl_judge", {"threshold": 2.0}),
    Config("dropmatch js K=5 p=0.3", "dropmatch", {"k": 5, "p_drop": 0.3, "criterion": "js"}),
    Config("dropmatch naive K=8 p=0.4", "dropmatch", {"k": 8, "p_drop": 0.4, "criterion": "naive"}),
]
BASELINE_CONFIGS = [c for c in CONFIGS if c.label in ("target-only", "lossless L=3")]


def gsm8k_prompts(tokenizer, n: int, shots: int = 0) -> list[tuple[str, list[int]]]:
    from workers.benchmarks import get_benchmark

    bench = get_benchmark("gsm8k")
    return [(item.id, encode_chat(tokenizer, bench.messages(item, shots=shots))) for item in bench.items(limit=n)]


def run(args: argparse.Namespace) -> dict:
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    engines, profiles, costs, short = {}, {}, {}, {}
    prompts: list[tuple[str, list[int]]] = []  # one tokenizer for every dtype: encoded once, with the first pair
    context = CONTEXT  # the KV length the items decode at: each profile is timed there (workload_context)
    for dtype in reversed(dtypes):  # the fast dtype first: its fp32 load is let go before the others load
        pair = load_pair(args.pair, dtype=dtype)
        gc.collect()
        if not prompts:
            prompts = gsm8k_prompts(pair.tokenizer, args.items, args.shots)
            context = workload_context([len(ids) for _, ids in prompts], args.max_new_tokens)
        profile = get_profile(pair, context=context)
        if context != CONTEXT:  # the short calibration beside it: how far off it models these items
            short[dtype] = get_profile(pair)
        engines[dtype] = SpecDecoder(pair)
        profiles[dtype] = profile
        costs[dtype] = args.cost_ratio if args.cost_ratio is not None else profile.cost_ratio
        print(f"{dtype}: c = {profile.cost_ratio:.3f}, v(5) = {profile.verify_factor(5):.2f}, target step "
              f"{profile.target_step_s * 1e3:.1f} ms (load {profile.load_1m:.2f}, {profile.threads} threads, "
              f"{profile.layers} layers, {profile.context} positions)", file=sys.stderr, flush=True)
    engines = {d: engines[d] for d in dtypes}
    name = next(iter(engines.values())).pair.name
    for engine in engines.values():
        engine.generate(prompts[0][1], "lossless", draft_len=5, max_new_tokens=8)  # warm-up
    rows = []
    t_run = time.perf_counter()
    load_before = os.getloadavg()[0]
    for i, (item_id, ids) in enumerate(prompts):
        for n, (dtype, engine) in enumerate(engines.items()):
            ref_tokens = None
            configs = CONFIGS if n == len(engines) - 1 else BASELINE_CONFIGS
            for cfg in configs:
                if cfg.policy is None:
                    gen = engine.autoregressive(ids, max_new_tokens=args.max_new_tokens)
                    ref_tokens = gen.token_ids
                else:
                    policy = make_policy(cfg.policy, **cfg.params)
                    gen = engine.generate(ids, policy, draft_len=cfg.draft_len, max_new_tokens=args.max_new_tokens)
                s = gen.stats
                rows.append({
                    "dtype": dtype, "item": item_id, "config": cfg.label, "draft_len": cfg.draft_len,
                    "tokens": s.num_generated, "tokens_per_s": s.tokens_per_s, "decode_s": s.decode_time_s,
                    "draft_s": s.draft_time_s, "verify_s": s.verify_time_s, "policy_s": s.policy_time_s,
                    "other_s": s.other_time_s, "mean_acceptance_length": s.mean_acceptance_length,
                    "modelled_speedup_vs_ar": speedup_vs_target_only(s.num_generated, s, costs[dtype],
                                                                     profiles[dtype].verify_factor),
                    **({"modelled_speedup_vs_ar_128": speedup_vs_target_only(
                        s.num_generated, s, short[dtype].cost_ratio, short[dtype].verify_factor)} if dtype in short
                       else {}),
                    "target_forwards": s.target_forwards, "draft_forwards": s.draft_forwards,
                    "same_as_target_only": gen.token_ids == ref_tokens, "load_1m": os.getloadavg()[0],
                })
        done = i + 1
        eta = (time.perf_counter() - t_run) / done * (len(prompts) - done)
        print(f"[{done}/{len(prompts)}] {item_id}  elapsed {time.perf_counter() - t_run:.0f}s  ETA {eta:.0f}s  "
              f"load {os.getloadavg()[0]:.2f}", file=sys.stderr, flush=True)
    return {"pair": name, "dtypes": dtypes, "items": len(prompts), "max_new_tokens": args.max_new_tokens,
            "shots": args.shots, "context": context, "profiles_128": {d: p.to_json() for d, p in short.items()},
            "machine": machine_key(), "cpu_flags": _cpu_kind(),
            "cost_ratio": costs, "profiles": {d: p.to_json() for d, p in profiles.items()}, "load_before": load_before,
            "load_after": os.getloadavg()[0], "rows": rows}


def _cpu_kind() -> str:
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return "unknown"
    return "avx512_bf16" if "avx512_bf16" in flags else "avx2-only" if "avx2" in flags else "other"


def _by(rows: list[dict], dtype: str) -> dict[str, dict[str, dict]]:
    by: dict[str, dict[str, dict]] = {}
    for r in rows:
        if r["dtype"] == dtype:
            by.setdefault(r["config"], {})[r["item"]] = r
    return by


def _paired(items: dict[str, dict], base: dict[str, dict]) -> float:
    keys = [k for k in items if k in base and base[k]["tokens_per_s"] > 0]
    return statistics.mean(items[k]["tokens_per_s"] / base[k]["tokens_per_s"] for k in keys) if keys else float("nan")


def headline(result: dict) -> list[str]:
    """The four lines: target-only speed of the last dtype over each other one, lossless at its fastest L over
    target-only (measured, paired), and the last dtype's c and v(5) as calibrated."""
    dtypes = result["dtypes"]
    fast = dtypes[-1]
    fast_by = _by(result["rows"], fast)
    fast_ar = fast_by["target-only"]
    ratios = [f"target-only speed, {fast} over {d}: {_paired(fast_ar, _by(result['rows'], d)['target-only']):.2f}"
              for d in dtypes[:-1]]
    lossless = {int(label.split("=")[1]): _paired(items, fast_ar)
                for label, items in fast_by.items() if label.startswith("lossless L=")}
    best = max(lossless, key=lambda n: lossless[n])
    profile = result["profiles"][fast]
    v5 = _verify_factor(profile, 5)
    return [*ratios,
            f"lossless at its best L over target-only, {fast}: {lossless[best]:.2f} (L={best})",
            f"cost ratio c, {fast}: {profile['cost_ratio']:.3f}",
            f"verify factor v(5), {fast}: {v5:.2f}"]


def _verify_factor(profile: dict, draft_len: int) -> float:
    from workers.models.calibrate import CostProfile

    return CostProfile(**{k: v for k, v in profile.items() if k != "cost_ratio"}).verify_factor(draft_len)


def summarize(result: dict) -> str:
    out = [f"pair {result['pair']}, dtypes {', '.join(result['dtypes'])}, {result['items']} GSM8K items "
           f"({result.get('shots', 0)}-shot), greedy, max_new_tokens {result['max_new_tokens']}; profiles timed at "
           f"{result.get('context', CONTEXT)} positions; machine {result['machine']} ({result['cpu_flags']}); "
           f"load(1m) {result['load_before']:.2f} before, {result['load_after']:.2f} after"]
    for dtype in result["dtypes"]:
        by = _by(result["rows"], dtype)
        ar, base = by["target-only"], by.get("lossless L=5", {})
        profile = result["profiles"][dtype]
        two = any("modelled_speedup_vs_ar_128" in r for r in result["rows"] if r["dtype"] == dtype)
        out += ["", f"**{dtype}**: c = {result['cost_ratio'][dtype]:.3f}, v(5) = {_verify_factor(profile, 5):.2f}, "
                f"target step {profile['target_step_s'] * 1e3:.1f} ms, draft step {profile['draft_step_s'] * 1e3:.1f} ms",
                "",
                "| config | tok/s | mean acc. len | speedup vs target-only (measured) | (modelled) | "
                + ("(modelled, 128-position profile) | " if two else "") + "vs lossless L=5 "
                "(measured) | draft / verify / rule / other % of decode | = target-only output |",
                "|---|---:|---:|---:|---:|" + ("---:|" if two else "") + "---:|---|---:|"]
        for label, items in by.items():
            tok = sum(r["tokens"] for r in items.values())
            dec = sum(r["decode_s"] for r in items.values())
            spd = _paired(items, ar)
            mod = statistics.mean(r["modelled_speedup_vs_ar"] for r in items.values())
            vsl = _paired(items, base) if base else float("nan")
            drafts = sum(r["tokens"] / r["mean_acceptance_length"] for r in items.values() if r["mean_acceptance_length"])
            split = "/".join(f"{100 * sum(r[k] for r in items.values()) / dec:.1f}"
                             for k in ("draft_s", "verify_s", "policy_s", "other_s"))
            same = sum(r["same_as_target_only"] for r in items.values())
            vs_base = f"{vsl:.2f}x" if vsl == vsl else "—"  # no lossless L=5 in a baseline dtype's configs
            mod128 = (f"{statistics.mean(r['modelled_speedup_vs_ar_128'] for r in items.values()):.2f}x | "
                      if two else "")
            out.append(f"| {label} | {tok / dec:.2f} | {tok / drafts:.2f} | {spd:.2f}x | {mod:.2f}x | {mod128}{vs_base} "
                       f"| {split} | {same}/{len(items)} |")
    return "\n".join(out)


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", default="qwen2.5-coder-0.5b+1.5b", help="pair name or DRAFT+TARGET (local model directories or hub ids org/name[@revision] from the local Hugging Face cache)")
    ap.add_argument("--dtypes", default=None,
                    help="comma-separated pair dtypes, baseline first, fast last (default: this machine's float "
                         "dtype, then --dtype auto's fast path: int4+int8 with AVX-512, else int8)")
    ap.add_argument("--items", type=int, default=6, help="GSM8K test items (the first N)")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="tokens per generation")
    ap.add_argument("--shots", type=int, default=0, help="worked examples before each question (the sweep's: 8)")
    ap.add_argument("--cost-ratio", type=float, default=None, help="c for the modelled speedup (default: measured)")
    ap.add_argument("--out", default="runs/bench", help="directory for the raw JSON")
    args = ap.parse_args(argv)
    if args.items < 1 or args.max_new_tokens < 1:
        ap.error("--items and --max-new-tokens must be >= 1")
    if args.shots < 0:
        ap.error("--shots must be >= 0")
    if args.dtypes is None:
        args.dtypes = f"{native_dtype()},{auto_dtype()}"
    for dtype in args.dtypes.split(","):
        if dtype.strip():
            resolve_dtype(dtype.strip())  # an unknown dtype fails here, before any model loads
    result = run(args)
    table = summarize(result)
    print(table)
    if len(result["dtypes"]) > 1:
        print()
        print("\n".join(headline(result)))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"bench_engine-{time.strftime('%Y%m%d-%H%M%S')}.json"
    lines = headline(result) if len(result["dtypes"]) > 1 else []
    path.write_text(json.dumps({**result, "table": table, "headline": lines}, indent=1))
    print(f"\nraw rows: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
