"""Benchmark: the CPU engine on the real pair — target-only vs lossless vs lossy rules, side by side.

    python -m jobs.bench.cpu_engine [--items 10] [--max-new-tokens 128] [--dtype bf16]

GSM8K test questions (zero-shot chat prompts), greedy. Every configuration runs on each item
before the next item starts, so load drifts hit all of them alike; speedups are paired per item
(Spec-Bench's convention: per-item tokens/s ratio, then the mean). Modelled speedups use the
pair's cost profile measured on this machine (``python -m workers.models.calibrate``; measured here if
absent). Prints a markdown table and writes the raw per-item rows as JSON under ``--out``.
No assertions: this is a measurement.
"""

from __future__ import annotations

import argparse
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
from workers.models.calibrate import get_profile
from workers.models.pair import load_pair
from workers.prompts import encode_chat


@dataclass
class Config:
    label: str
    policy: str | None  # None = target-only
    params: dict = field(default_factory=dict)
    draft_len: int = 5


CONFIGS = [
    Config("target-only", None, draft_len=0),
    Config("lossless L=3", "lossless", draft_len=3),
    Config("lossless L=5", "lossless", draft_len=5),
    Config("lossless L=8", "lossless", draft_len=8),
    Config("kl_judge τ=0.5", "kl_judge", {"threshold": 0.5}),
    Config("kl_judge τ=2", "kl_judge", {"threshold": 2.0}),
    Config("dropmatch js K=5 p=0.3", "dropmatch", {"k": 5, "p_drop": 0.3, "criterion": "js"}),
    Config("dropmatch naive K=8 p=0.4", "dropmatch", {"k": 8, "p_drop": 0.4, "criterion": "naive"}),
]


def gsm8k_prompts(tokenizer, n: int) -> list[tuple[str, list[int]]]:
    from workers.benchmarks import get_benchmark

    bench = get_benchmark("gsm8k")
    return [(item.id, encode_chat(tokenizer, bench.messages(item))) for item in bench.items(limit=n)]


def run(args: argparse.Namespace) -> dict:
    pair = load_pair(args.pair, dtype=args.dtype)
    profile = get_profile(pair)
    cost_ratio = args.cost_ratio if args.cost_ratio is not None else profile.cost_ratio
    engine = SpecDecoder(pair)
    prompts = gsm8k_prompts(pair.tokenizer, args.items)
    engine.generate(prompts[0][1], "lossless", draft_len=5, max_new_tokens=8)  # warm-up
    rows = []
    t_run = time.perf_counter()
    load_before = os.getloadavg()[0]
    for i, (item_id, ids) in enumerate(prompts):
        ref_tokens = None
        for cfg in CONFIGS:
            if cfg.policy is None:
                gen = engine.autoregressive(ids, max_new_tokens=args.max_new_tokens)
                ref_tokens = gen.token_ids
            else:
                policy = make_policy(cfg.policy, **cfg.params)
                gen = engine.generate(ids, policy, draft_len=cfg.draft_len, max_new_tokens=args.max_new_tokens)
            s = gen.stats
            rows.append({
                "item": item_id, "config": cfg.label, "draft_len": cfg.draft_len, "tokens": s.num_generated,
                "tokens_per_s": s.tokens_per_s, "decode_s": s.decode_time_s, "draft_s": s.draft_time_s,
                "verify_s": s.verify_time_s, "policy_s": s.policy_time_s, "other_s": s.other_time_s,
                "mean_acceptance_length": s.mean_acceptance_length,
                "modelled_speedup_vs_ar": speedup_vs_target_only(s.num_generated, s, cost_ratio, profile.verify_factor),
                "same_as_target_only": gen.token_ids == ref_tokens, "load_1m": os.getloadavg()[0],
            })
        done = i + 1
        eta = (time.perf_counter() - t_run) / done * (len(prompts) - done)
        print(f"[{done}/{len(prompts)}] {item_id}  elapsed {time.perf_counter() - t_run:.0f}s  ETA {eta:.0f}s  "
              f"load {os.getloadavg()[0]:.2f}", file=sys.stderr, flush=True)
    return {"pair": pair.name, "dtype": args.dtype, "items": len(prompts), "max_new_tokens": args.max_new_tokens,
            "cost_ratio": cost_ratio, "profile": profile.to_json(), "load_before": load_before,
            "load_after": os.getloadavg()[0], "rows": rows}


def summarize(result: dict) -> str:
    rows = result["rows"]
    by = {}
    for r in rows:
        by.setdefault(r["config"], {})[r["item"]] = r
    ar, base = by["target-only"], by.get("lossless L=5", {})
    out = [
        f"pair {result['pair']} {result['dtype']}, {result['items']} GSM8K items, greedy, max_new_tokens "
        f"{result['max_new_tokens']}; c = {result['cost_ratio']:.3f} (measured here); "
        f"load(1m) {result['load_before']:.2f} before, {result['load_after']:.2f} after",
        "",
        "| config | tok/s | mean acc. len | speedup vs target-only (measured) | (modelled) | vs lossless L=5 "
        "(measured) | draft / verify / rule / other % of decode | = target-only output |",
        "|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for cfg in CONFIGS:
        items = by[cfg.label]
        tok = sum(r["tokens"] for r in items.values())
        dec = sum(r["decode_s"] for r in items.values())
        spd = statistics.mean(items[k]["tokens_per_s"] / ar[k]["tokens_per_s"] for k in items)
        mod = statistics.mean(r["modelled_speedup_vs_ar"] for r in items.values())
        vsl = statistics.mean(items[k]["tokens_per_s"] / base[k]["tokens_per_s"] for k in items) if base else float("nan")
        drafts = sum(r["tokens"] / r["mean_acceptance_length"] for r in items.values() if r["mean_acceptance_length"])
        split = "/".join(f"{100 * sum(r[k] for r in items.values()) / dec:.1f}"
                         for k in ("draft_s", "verify_s", "policy_s", "other_s"))
        same = sum(r["same_as_target_only"] for r in items.values())
        out.append(f"| {cfg.label} | {tok / dec:.2f} | {tok / drafts:.2f} | {spd:.2f}x | {mod:.2f}x | {vsl:.2f}x "
                   f"| {split} | {same}/{len(items)} |")
    return "\n".join(out)


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", default="qwen2.5-coder-0.5b+1.5b", help="pair name or DRAFT+TARGET (local model directories or hub ids org/name[@revision] from the local Hugging Face cache)")
    ap.add_argument("--dtype", default="bf16", help="bf16 or fp32")
    ap.add_argument("--items", type=int, default=10, help="GSM8K test items (the first N)")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="tokens per generation")
    ap.add_argument("--cost-ratio", type=float, default=None, help="c for the modelled speedup (default: measured)")
    ap.add_argument("--out", default="runs/bench", help="directory for the raw JSON")
    args = ap.parse_args(argv)
    if args.items < 1 or args.max_new_tokens < 1:
        ap.error("--items and --max-new-tokens must be >= 1")
    result = run(args)
    table = summarize(result)
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"bench_engine-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({**result, "table": table}, indent=1))
    print(f"\nraw rows: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
