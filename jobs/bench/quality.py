"""Benchmark: accuracy and speed of the rules on the real pair, side by side (the papers' Table 6).

    python -m jobs.bench.quality [--items 50] [--draft-len 5] [--shots 8] [--dtype bf16]

GSM8K test items (the first N), greedy, scored by the benchmark's own scorer. For every item the
configurations run one after another before the next item starts (target-only, lossless, then
each rule), so load drifts hit all of them alike; speedups are paired per item. The engine's
prefix cache keeps the few-shot preamble, so prefill is paid once per item, not per rule.

Records go to ``<runs>/quality/<pair>-<dtype>/<config>/records.jsonl`` as they are made; a rerun
of the same command resumes where it stopped. Prints a markdown table: accuracy (95% interval),
paired drop vs target-only, mean acceptance length, tokens/s, speedup vs target-only (measured
and modelled with the c seen in this run), speedup vs lossless, outputs equal to target-only,
and the 1-minute load average seen while running. No assertions: this is a measurement.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

from workers.benchmarks import get_benchmark
from workers.cli import one_line_errors, parse_rule
from workers.cpu_engine import SpecDecoder
from workers.evaluation import TARGET_ONLY, DecodeSpec, Record, evaluate_item, workload_profile
from workers.metrics.trial import aggregate, noise_floor
from workers.results.store import RecordStore, reference_dir, runs_root, slug

DEFAULT_RULES = ["kl_judge:threshold=0.5", "dropmatch:k=5,p_drop=0.3,criterion=js"]


def _pct(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{100 * x:.1f}%"


def _ci(ci: tuple[float, float]) -> str:
    return f"[{_pct(ci[0])}, {_pct(ci[1])}]"


def run(args: argparse.Namespace) -> dict:
    from workers.models.pair import load_pair

    bench = get_benchmark("gsm8k")
    settings = dict(temperature=0.0, seed=0, max_new_tokens=args.max_new_tokens, shots=args.shots)
    specs = [DecodeSpec.make(TARGET_ONLY, **settings), DecodeSpec.make("lossless", {}, args.draft_len, **settings)]
    specs += [DecodeSpec.make(name, params, args.draft_len, **settings) for name, params in map(parse_rule, args.rule)]
    pair = load_pair(args.pair, dtype=args.dtype)
    items = bench.items(limit=args.items)
    profile = workload_profile(pair, bench, items, specs[0])  # timed at the context these items decode at
    engine = SpecDecoder(pair)
    root = runs_root(args.runs_root) / "quality" / slug(f"gsm8k-{args.pair}-{args.dtype}")
    # target-only and lossless share the sweep's reference cache (same items + settings = same key)
    stores = {s: RecordStore(reference_dir(runs_root(args.runs_root), args.pair, args.dtype, bench.name, s)
                             if s.policy in (TARGET_ONLY, "lossless") else root / f"{slug(s.label())}-{s.key()}")
              for s in specs}
    done = {s: stores[s].load() for s in specs}
    loads: list[float] = []
    t0, n_new = time.perf_counter(), 0
    todo = [it for it in items if any(it.id not in done[s] for s in specs)]
    for n, item in enumerate(todo, 1):
        for spec in specs:
            if item.id in done[spec]:
                continue
            ref = done[specs[0]].get(item.id)
            record = evaluate_item(engine, bench, item, spec, reference_outputs=ref.outputs if ref else None)
            stores[spec].append(record)
            done[spec][item.id] = record
            n_new += 1
            loads.append(os.getloadavg()[0])
        elapsed = time.perf_counter() - t0
        eta = elapsed / n * (len(todo) - n)
        scores = " ".join(f"{done[s][item.id].score:.0f}" for s in specs)
        print(f"[{n}/{len(todo)}] {item.id} scores {scores} | elapsed {elapsed:.0f}s ETA {eta:.0f}s | "
              f"load {os.getloadavg()[0]:.2f}", file=sys.stderr, flush=True)
    records = {s: [done[s][it.id] for it in items] for s in specs}
    for s in specs:
        stores[s].write_parquet(records[s])
    return {"pair": pair.name, "dtype": args.dtype, "items": len(items), "specs": specs, "records": records,
            "cost_ratio": profile.cost_ratio, "profile": profile, "loads": loads, "computed": n_new}


def summarize(result: dict) -> str:
    specs: list[DecodeSpec] = result["specs"]
    recs: dict[DecodeSpec, list[Record]] = result["records"]
    ar, ll = recs[specs[0]], recs[specs[1]]
    profile = result["profile"]
    floor = noise_floor(ll, ar)
    loads = result["loads"]
    load = f"{min(loads):.2f}–{max(loads):.2f}" if loads else "n/a (all cached)"
    lines = [
        f"pair {result['pair']} {result['dtype']}, first {result['items']} GSM8K test items, "
        f"{specs[0].shots}-shot, greedy, L = {specs[1].draft_len}, max_new_tokens {specs[0].max_new_tokens}; "
        f"calibrated c = {result['cost_ratio']:.3f}; load(1m) while running {load}",
        "",
        "| config | accuracy [95% CI] | drop vs target-only [95% CI] | mean acc. len | tok/s | speedup vs "
        "target-only measured | modelled (c here) | vs lossless measured | = target-only output |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for spec in specs:
        m = aggregate(recs[spec], ar, ll if spec is not specs[0] else None, cost_ratio=result["cost_ratio"],
                      verify_factor=profile.verify_factor)
        same = 1 - m.output_divergence_vs_ar
        if spec is specs[0]:
            lines.append(f"| {TARGET_ONLY} | {_pct(m.accuracy)} {_ci(m.accuracy_ci)} | — | 1.00 | {m.tokens_per_s:.2f} "
                         f"| 1.00x | 1.00x | — | — |")
            continue
        lines.append(
            f"| {spec.label()} | {_pct(m.accuracy)} {_ci(m.accuracy_ci)} | {_pct(m.accuracy_drop)} "
            f"{_ci(m.accuracy_drop_ci)} | {m.mean_acceptance_length:.2f} | {m.tokens_per_s:.2f} | "
            f"{m.speedup_vs_ar_measured:.2f}x | {m.speedup_vs_ar_modelled_in_situ:.2f}x (c={m.cost_ratio_in_situ:.2f}) "
            f"| {m.speedup_vs_lossless_measured:.2f}x | {_pct(same)} |")
    lines += ["", f"noise floor (lossless vs target-only): outputs differ on {_pct(floor.divergence_rate)} of items, "
              f"accuracy diff {_pct(floor.accuracy_diff)} {_ci(floor.accuracy_diff_ci)}"]
    return "\n".join(lines)


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", default="qwen2.5-coder-0.5b+1.5b", help="pair name or DRAFT+TARGET (local model directories or hub ids org/name[@revision] from the local Hugging Face cache)")
    ap.add_argument("--dtype", default="bf16", help="bf16 or fp32")
    ap.add_argument("--items", type=int, default=50, help="the first N GSM8K test items")
    ap.add_argument("--draft-len", type=int, default=5, help="draft length L")
    ap.add_argument("--shots", type=int, default=8, help="GSM8K exemplars (0 or 8)")
    ap.add_argument("--max-new-tokens", type=int, default=256, help="tokens per answer")
    ap.add_argument("--rule", action="append", default=None,
                    help=f"NAME:K=V,K=V (repeatable; default {' and '.join(DEFAULT_RULES)})")
    ap.add_argument("--runs-root", default=None, help="where records live (default ./runs)")
    args = ap.parse_args(argv)
    args.rule = args.rule or DEFAULT_RULES
    if args.items < 1 or args.max_new_tokens < 1:
        ap.error("--items and --max-new-tokens must be >= 1")
    table = summarize(run(args))
    print(table)
    out = runs_root(args.runs_root) / "quality" / f"table-{time.strftime('%Y%m%d-%H%M%S')}.md"
    out.write_text(table + "\n")
    print(f"\ntable: {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
