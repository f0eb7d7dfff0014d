"""The vLLM engine side by side: target-only, vLLM's own lossless rule, spectune's lossless rule
inside vLLM (the plugin's overhead), and lossy rules — interleaved round by round on the same
prompts, so the ratios share the machine's load (recorded per configuration).

    .vllm-venv/bin/python -m jobs.bench.vllm_engine [--pair qwen2.5-coder-0.5b+1.5b] [--items 4]
        [--max-new-tokens 64] [--rounds 2] [--rule dropmatch:k=5,p_drop=0.3] ...

Runs where vLLM runs (``.vllm-venv`` on this CPU; the GPU image on GPU nodes). GSM8K prompts,
0-shot chat, greedy. Prints a markdown table and writes it under ``runs/bench/``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import datetime

from workers.cli import one_line_errors, parse_rule, require_positive
from workers.results.store import runs_root

NATIVE = "vllm-native"


def run(args: argparse.Namespace) -> str:
    from policies import make_policy
    from workers.benchmarks import get_benchmark
    from workers.engines import make_engine
    from workers.prompts import encode_chat

    engine = make_engine("vllm", args.pair, args.dtype, draft_len=args.draft_len,
                         vllm={"gpu_memory_utilization": args.gpu_memory_utilization,
                               "target_only_memory_utilization": args.target_only_memory_utilization,
                               "max_model_len": args.max_model_len, "enforce_eager": args.enforce_eager})
    bench = get_benchmark("gsm8k")
    prompts = [encode_chat(engine.pair.tokenizer, bench.messages(it, shots=0)) for it in bench.items(limit=args.items)]
    configs: list[tuple[str, object]] = [("target-only", None), ("lossless (vLLM's rule)", NATIVE),
                                         ("lossless (spectune's, in vLLM)", "lossless")]
    for text in args.rule:
        name, params = parse_rule(text)
        configs.append((f"{name} {params}", make_policy(name, **params)))
    totals = {label: {"tokens": 0, "decode_s": 0.0, "drafts": 0, "draft_tokens": 0, "accepted": 0, "loads": []}
              for label, _ in configs}
    for label, policy in configs:  # warm-up: first calls compile / allocate
        gen = (engine.autoregressive(prompts[0], max_new_tokens=8) if policy is None else
               engine.generate(prompts[0], policy, draft_len=args.draft_len, max_new_tokens=8))
        assert gen.token_ids, label
    t0 = time.perf_counter()
    for r in range(args.rounds):
        for label, policy in configs:
            agg = totals[label]
            for ids in prompts:
                if policy is None:
                    gen = engine.autoregressive(ids, max_new_tokens=args.max_new_tokens)
                else:
                    gen = engine.generate(ids, policy, draft_len=args.draft_len, max_new_tokens=args.max_new_tokens)
                st = gen.stats
                agg["tokens"] += st.num_generated
                agg["decode_s"] += st.decode_time_s
                agg["drafts"] += st.num_drafts
                agg["draft_tokens"] += st.num_draft_tokens
                agg["accepted"] += st.num_accepted_tokens
                agg["loads"].append(os.getloadavg()[0])
        print(f"[bench_vllm] round {r + 1}/{args.rounds} done, {time.perf_counter() - t0:.0f}s", file=sys.stderr)
    tps = {k: v["tokens"] / v["decode_s"] if v["decode_s"] > 0 else 0.0 for k, v in totals.items()}
    base, native = tps["target-only"], tps["lossless (vLLM's rule)"]
    lines = [f"vLLM engine, {args.pair} ({args.dtype}), {len(prompts)} GSM8K prompts (0-shot chat) x {args.rounds} "
             f"rounds, greedy, L = {args.draft_len}, max_new_tokens {args.max_new_tokens}; configurations "
             f"interleaved per round; {datetime.now():%Y-%m-%d %H:%M}", "",
             "| config | tokens/s (decode) | vs target-only | vs vLLM's lossless | mean acc. len | "
             "draft acceptance | load(1m) |", "|---|---|---|---|---|---|---|"]
    for label, _ in configs:
        v = totals[label]
        mal = (v["tokens"] / v["drafts"]) if v["drafts"] else float("nan")
        acc = (v["accepted"] / v["draft_tokens"]) if v["draft_tokens"] else float("nan")
        load = f"{min(v['loads']):.2f}-{max(v['loads']):.2f}" if v["loads"] else "-"
        lines.append(f"| {label} | {tps[label]:.2f} | {tps[label] / base:.2f}x | "
                     f"{(tps[label] / native) if native else 0:.2f}x | "
                     f"{'-' if v['drafts'] == 0 else f'{mal:.2f}'} | {'-' if v['draft_tokens'] == 0 else f'{acc:.1%}'} "
                     f"| {load} |")
    table = "\n".join(lines)
    out = runs_root(args.runs_root) / "bench" / f"vllm-{datetime.now():%Y%m%d-%H%M%S}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(table + "\n")
    engine.close()
    return table + f"\n\nwritten to {out}"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", default="qwen2.5-coder-0.5b+1.5b")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--items", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--draft-len", type=int, default=5)
    ap.add_argument("--rule", action="append", default=None,
                    help="NAME[:k=v,...] (repeatable; default dropmatch js K=5 p=0.3 and kl_judge 0.5)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.4,
                    help="the speculative engine's share of the GPU (vLLM-CPU: of RAM, weights included)")
    ap.add_argument("--target-only-memory-utilization", type=float, default=0.25,
                    help="the target-only engine's share (a second engine on the same device)")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--runs-root", default=None)
    return ap


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.rule is None:
        args.rule = ["dropmatch:k=5,p_drop=0.3,criterion=js", "kl_judge:threshold=0.5"]
    require_positive(args, "items", "max_new_tokens", "rounds", "draft_len")
    print(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
