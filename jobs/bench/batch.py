"""Throughput of one GSM8K shard per rule: the CPU engine at batch 1 vs vLLM at batch 1 vs vLLM with the
whole shard in one ``generate`` (continuous batching) — target-only, vLLM's own lossless rule,
spectune's lossless rule inside vLLM, and lossy rules.

    .vllm-venv/bin/python -m jobs.bench.batch --enforce-eager [--items 32] [--b1-items 4] [--shots 8]
        [--max-new-tokens 128] [--kv-cache-gb 3] [--rule dropmatch:k=5,p_drop=0.3,criterion=js] ...

Runs where vLLM runs (``.vllm-venv`` on this CPU). GSM8K test items, ``--shots``-shot chat prompts,
greedy, one draft length. Phases run one after another in this one invocation: the CPU engine (a
child process, so its pair's memory is gone before vLLM starts), then vLLM's speculative engine
(every spectune/native rule: batch 1 on the first ``--b1-items`` items, configurations interleaved
item by item; then the whole shard per configuration), then vLLM's target-only engine (vLLM-CPU
runs one engine at a time). Each prompt set is prefilled once before timing (prefix cache), so the
figures are decoding throughput with cached prompts: tokens/s = generated tokens / wall seconds of
the calls, items/s likewise. The 1-minute load average is recorded per row. Prints markdown tables
and writes them with the raw rows under ``runs/bench/``. No assertions: this is a measurement.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from datetime import datetime
from typing import Any

from workers.cli import one_line_errors, parse_rule, require_positive
from workers.results.store import runs_root

NATIVE = "vllm-native"
TARGET_ONLY = "target-only"


def configs(rules: list[str], only: str | None = None) -> list[tuple[str, str, dict]]:
    """(label, rule name, params): target-only, vLLM's lossless, spectune's lossless, then ``rules``;
    ``only``: a comma list of the rule names to keep (``target-only``, ``vllm-native``, ``lossless``...)."""
    out = [(TARGET_ONLY, TARGET_ONLY, {}), ("lossless (vLLM's rule)", NATIVE, {}),
           ("lossless (spectune's)", "lossless", {})]
    for text in rules:
        name, params = parse_rule(text)
        out.append((f"{name} {json.dumps(params, sort_keys=True)}", name, params))
    if only:
        keep = {n.strip() for n in only.split(",") if n.strip()}
        unknown = keep - {name for _, name, _ in out}
        if unknown:
            raise ValueError(f"--only names {sorted(unknown)}, not among {[name for _, name, _ in out]}")
        out = [c for c in out if c[1] in keep]
    return out


def shard(tokenizer: Any, items: int, shots: int) -> tuple[Any, list[Any], list[list[int]]]:
    from workers.benchmarks import get_benchmark
    from workers.prompts import encode_chat

    bench = get_benchmark("gsm8k")
    chosen = bench.items(limit=items)
    return bench, chosen, [encode_chat(tokenizer, bench.messages(it, shots=shots)) for it in chosen]


def _row(engine: str, mode: str, label: str, gens: list[Any], items: list[Any], bench: Any, wall: float) -> dict:
    ok = [(g, it) for g, it in zip(gens, items, strict=True) if not isinstance(g, BaseException)]
    tokens = sum(g.stats.num_generated for g, _ in ok)
    drafts = sum(g.stats.num_drafts for g, _ in ok)
    correct = sum(float(bench.score(it, [g.text or ""]).score) for g, it in ok)
    return {"engine": engine, "mode": mode, "config": label, "items": len(items), "failed": len(items) - len(ok),
            "tokens": tokens, "wall_s": wall, "tok_s": tokens / wall if wall > 0 else 0.0,
            "items_s": len(ok) / wall if wall > 0 else 0.0, "drafts": drafts,
            "first_error": next((f"{type(g).__name__}: {g}" for g in gens if isinstance(g, BaseException)), None),
            "mean_acc_len": tokens / drafts if drafts else None, "correct": correct,
            "fallback_steps": sum(g.stats.lossless_fallback_steps for g, _ in ok), "load": os.getloadavg()[0]}


def _fallbacks(row: dict) -> str:
    """Lossless-fallback steps, with the plugin's reasons where the row has them: "2 (reason: 2)"."""
    reasons = row.get("fallback_reasons") or {}
    return str(row["fallback_steps"]) + (" (" + ", ".join(f"{k}: {v}" for k, v in reasons.items()) + ")"
                                         if reasons else "")


def _say(row: dict) -> None:
    print(f"[bench_batch] {row['engine']} {row['mode']} {row['config']}: {row['items']} items, {row['tokens']} tok "
          f"in {row['wall_s']:.0f}s ({row['tok_s']:.2f} tok/s), load {row['load']:.2f}"
          + (f", lossless fallbacks {row['fallback_reasons']}" if row.get("fallback_reasons") else ""),
          file=sys.stderr, flush=True)


def _one(engine: Any, name: str, params: dict, ids: list[int], args: argparse.Namespace, stop: list[str] | None,
         max_new_tokens: int | None = None) -> Any:
    from policies import make_policy

    common = dict(max_new_tokens=max_new_tokens or args.max_new_tokens, temperature=0.0, stop=stop)
    if name == TARGET_ONLY:
        return engine.autoregressive(ids, **common)
    policy = name if name == NATIVE else make_policy(name, **params)
    return engine.generate(ids, policy, draft_len=args.draft_len, **common)


def batch1(engine: Any, kind: str, cfgs: list[tuple[str, str, dict]], bench: Any, items: list[Any],
           prompts: list[list[int]], args: argparse.Namespace) -> list[dict]:
    """Every config on item i before item i+1 (interleaved, so load drifts hit all alike)."""
    stop = list(bench.stop) or None
    for _, name, params in cfgs:  # warm-up: first calls compile / allocate / cache the shared preamble
        _one(engine, name, params, prompts[0], args, stop, max_new_tokens=2)
    gens: dict[str, list[Any]] = {label: [] for label, _, _ in cfgs}
    walls = dict.fromkeys(gens, 0.0)
    for i, ids in enumerate(prompts):
        for label, name, params in cfgs:
            t0 = time.perf_counter()
            gens[label].append(_one(engine, name, params, ids, args, stop))
            walls[label] += time.perf_counter() - t0
        print(f"[bench_batch] {kind} batch 1: item {i + 1}/{len(prompts)}", file=sys.stderr, flush=True)
    rows = [_row(kind, "batch 1", label, gens[label], items, bench, walls[label]) for label, _, _ in cfgs]
    for row in rows:
        _say(row)
    return rows


def batched(engine: Any, cfgs: list[tuple[str, str, dict]], bench: Any, items: list[Any],
            prompts: list[list[int]], args: argparse.Namespace) -> list[dict]:
    from policies import make_policy

    stop = list(bench.stop) or None
    rows = []
    for r in range(args.rounds):  # configurations interleaved round by round
        for label, name, params in cfgs:
            common = dict(max_new_tokens=args.max_new_tokens, temperature=0.0, stop=stop)
            before = dict(engine.fallback_totals.get("reasons", {}))
            t0 = time.perf_counter()
            if name == TARGET_ONLY:
                gens = engine.autoregressive_batch(prompts, **common)
            else:
                policy = name if name == NATIVE else make_policy(name, **params)
                gens = engine.generate_batch(prompts, policy, draft_len=args.draft_len, **common)
            row = _row("vLLM", f"batched {len(prompts)}", label, gens, items, bench, time.perf_counter() - t0)
            row["round"] = r + 1
            # why steps fell back to lossless (the plugin's running totals, per reason, over this call)
            after = engine.fallback_totals.get("reasons", {})
            row["fallback_reasons"] = {k: v - before.get(k, 0) for k, v in after.items() if v > before.get(k, 0)}
            rows.append(row)
            _say(row)
    return rows


def merge_rounds(rows: list[dict]) -> list[dict]:
    """Rows of the same (engine, mode, config) from several rounds as one: sums, then the rates."""
    merged: dict[tuple, dict] = {}
    for r in rows:
        key = (r["engine"], r["mode"], r["config"])
        if key not in merged:
            merged[key] = {**r, "loads": [r["load"]]}
            continue
        m = merged[key]
        for k in ("items", "failed", "tokens", "wall_s", "drafts", "correct", "fallback_steps"):
            m[k] += r[k]
        for reason, n in r.get("fallback_reasons", {}).items():
            m["fallback_reasons"] = reasons = dict(m.get("fallback_reasons", {}))
            reasons[reason] = reasons.get(reason, 0) + n
        m["loads"].append(r["load"])
    for m in merged.values():
        m["tok_s"] = m["tokens"] / m["wall_s"] if m["wall_s"] > 0 else 0.0
        m["items_s"] = (m["items"] - m["failed"]) / m["wall_s"] if m["wall_s"] > 0 else 0.0
        m["mean_acc_len"] = m["tokens"] / m["drafts"] if m["drafts"] else None
        m["load"] = max(m["loads"])
    return list(merged.values())


def cpu_phase(args: argparse.Namespace) -> list[dict]:
    from workers.engines import make_engine

    engine = make_engine("cpu", args.pair, args.dtype)
    bench, items, prompts = shard(engine.pair.tokenizer, args.b1_items, args.shots)
    cfgs = [c for c in configs(args.rule, args.only) if c[1] != NATIVE]
    return batch1(engine, "CPU engine", cfgs, bench, items, prompts, args)


def vllm_phase(args: argparse.Namespace) -> tuple[list[dict], str]:
    from workers.engines import make_engine
    from workers.vllm.settings import CPU_BIND_ENV

    engine = make_engine("vllm", args.pair, args.dtype, draft_len=args.draft_len,
                         vllm={"max_model_len": args.max_model_len, "enforce_eager": args.enforce_eager,
                               "kv_cache_memory_bytes": int(args.kv_cache_gb * 2**30)})
    try:
        bench, items, prompts = shard(engine.pair.tokenizer, args.items, args.shots)
        cfgs = configs(args.rule, args.only)
        spec, ref = [c for c in cfgs if c[1] != TARGET_ONLY], [c for c in cfgs if c[1] == TARGET_ONLY]
        rows: list[dict] = []
        b1 = (items[:args.b1_items], prompts[:args.b1_items])
        if spec:
            engine.generate_batch(prompts, NATIVE, draft_len=args.draft_len, max_new_tokens=1)  # prefill once
            rows += batch1(engine, "vLLM", spec, bench, *b1, args) if args.b1_items else []
            rows += batched(engine, spec, bench, items, prompts, args)
        if ref:
            engine.autoregressive_batch(prompts, max_new_tokens=1)  # the reference engine's prefill
            rows += batch1(engine, "vLLM", ref, bench, *b1, args) if args.b1_items else []
            rows += batched(engine, ref, bench, items, prompts, args)
        return rows, os.environ.get(CPU_BIND_ENV, "unset")
    finally:
        engine.close()


def tables(rows: list[dict], args: argparse.Namespace, binding: str) -> str:
    head = (f"{args.pair} ({args.dtype}), GSM8K test, {args.shots}-shot chat, greedy, L = {args.draft_len}, "
            f"max_new_tokens {args.max_new_tokens}; batch 1 on the first {args.b1_items} items, batched = all "
            f"{args.items} in one generate ({args.rounds} round(s), configurations interleaved); {os.cpu_count()} CPUs, VLLM_CPU_OMP_THREADS_BIND={binding}; "
            f"{datetime.now():%Y-%m-%d %H:%M}")
    by = {(r["engine"], r["mode"].split()[0], r["config"]): r for r in rows}
    rows = merge_rounds(rows)
    labels = [label for label, _, _ in configs(args.rule) if any(r["config"] == label for r in rows)]
    summary = ["| config | CPU engine b1 tok/s | vLLM b1 tok/s | vLLM batched tok/s | batched items/s | "
               "batched / vLLM b1 | batched / CPU b1 |", "|---|---:|---:|---:|---:|---:|---:|"]

    def tps(key: tuple) -> str:
        return f"{by[key]['tok_s']:.2f}" if key in by else "—"

    def ratio(a: tuple, b: tuple) -> str:
        return f"{by[a]['tok_s'] / by[b]['tok_s']:.2f}x" if a in by and b in by and by[b]["tok_s"] else "—"

    for label in labels:
        cpu, v1, vb = ("CPU engine", "batch", label), ("vLLM", "batch", label), ("vLLM", "batched", label)
        ips = f"{by[vb]['items_s']:.3f}" if vb in by else "—"
        summary.append(f"| {label} | {tps(cpu)} | {tps(v1)} | {tps(vb)} | {ips} | {ratio(vb, v1)} | {ratio(vb, cpu)} |")
    detail = ["| engine | mode | config | items (failed) | tokens | wall s | tok/s | items/s | mean acc. len | "
              "correct | fallback steps | load(1m) |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        mal = "—" if r["mean_acc_len"] is None or r["config"] == TARGET_ONLY else f"{r['mean_acc_len']:.2f}"
        detail.append(f"| {r['engine']} | {r['mode']} | {r['config']} | {r['items']} ({r['failed']}) | {r['tokens']} | "
                      f"{r['wall_s']:.0f} | {r['tok_s']:.2f} | {r['items_s']:.3f} | {mal} | "
                      f"{r['correct']:.0f}/{r['items'] - r['failed']} | {_fallbacks(r)} | {r['load']:.2f} |")
    return "\n".join([head, "", *summary, "", *detail])


def run(args: argparse.Namespace, argv: list[str]) -> tuple[str, list[dict]]:
    rows: list[dict] = []
    if args.b1_items and not args.no_cpu:
        out = runs_root(args.runs_root) / "bench" / f".cpu-{os.getpid()}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        print("[bench_batch] CPU engine (child process)", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "jobs.bench.batch", *argv, "--phase", "cpu", "--rows", str(out)],
                       check=True)
        rows += json.loads(out.read_text())
        out.unlink()
        gc.collect()
    binding = "-"
    if not args.no_vllm:
        vrows, binding = vllm_phase(args)
        rows += vrows
    text = tables(rows, args, binding)
    stem = runs_root(args.runs_root) / "bench" / f"batch-{datetime.now():%Y%m%d-%H%M%S}"
    stem.with_suffix(".md").write_text(text + "\n")
    stem.with_suffix(".json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    return text + f"\n\nwritten to {stem}.md (.json: raw rows)", [r for r in rows if r["failed"]]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", default="qwen2.5-coder-0.5b+1.5b")
    ap.add_argument("--dtype", default=None, help="bf16 or fp32 (default: what this machine runs natively)")
    ap.add_argument("--items", type=int, default=32, help="the shard: items decoded together by vLLM")
    ap.add_argument("--b1-items", type=int, default=4, help="first items decoded one at a time (0: skip batch 1)")
    ap.add_argument("--shots", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--draft-len", type=int, default=5)
    ap.add_argument("--rule", action="append", default=None,
                    help="NAME[:k=v,...] (repeatable; default dropmatch js K=5 p=0.3 and kl_judge 0.5)")
    ap.add_argument("--kv-cache-gb", type=float, default=3.0, help="vLLM's KV cache per engine")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--enforce-eager", action="store_true", help="vLLM without torch.compile (CPU: see docs)")
    ap.add_argument("--rounds", type=int, default=1, help="batched passes per configuration, interleaved")
    ap.add_argument("--only", help="comma list of rule names to run (target-only, vllm-native, lossless, ...)")
    ap.add_argument("--no-cpu", action="store_true", help="skip the CPU engine")
    ap.add_argument("--no-vllm", action="store_true", help="only the CPU engine (batch 1)")
    ap.add_argument("--runs-root", default=None)
    ap.add_argument("--phase", choices=["cpu"], help=argparse.SUPPRESS)
    ap.add_argument("--rows", help=argparse.SUPPRESS)
    return ap


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.rule is None:
        args.rule = ["dropmatch:k=5,p_drop=0.3,criterion=js", "kl_judge:threshold=0.5"]
    require_positive(args, "items", "max_new_tokens", "draft_len", "max_model_len", "rounds")
    if args.shots < 0 or not args.kv_cache_gb > 0:
        raise ValueError(f"--shots must be >= 0 and --kv-cache-gb > 0, got {args.shots} and {args.kv_cache_gb}")
    if not 0 <= args.b1_items <= args.items:
        raise ValueError(f"--b1-items must be between 0 and --items ({args.items}), got {args.b1_items}")
    from policies import make_policy

    for text in args.rule:
        name, params = parse_rule(text)
        make_policy(name, **params)  # an unknown rule or parameter is one line now, not after engines start
    configs(args.rule, args.only)
    if args.dtype is None:
        from workers.models.pair import native_dtype

        args.dtype = native_dtype()
    if args.phase == "cpu":
        from pathlib import Path

        Path(args.rows).write_text(json.dumps(cpu_phase(args)))
        return 0
    text, failed = run(args, argv)
    print(text)
    for row in failed:  # the table is written either way; a run with failed items is not a clean figure
        print(f"bench_batch: {row['failed']}/{row['items']} items failed in {row['engine']} {row['mode']} "
              f"{row['config']} (first: {row['first_error']}); their tokens are not in the figures", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
