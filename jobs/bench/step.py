"""Benchmark: one vLLM verify step decided by spectune's plugin code, next to vLLM's greedy core.

    python -m jobs.bench.step [--requests 32] [--draft-len 5] [--vocab 151936] [--reps 7]
        [--rule lossless] [--rule kl_judge:threshold=0.5] ...

The step as the plugin sees it (``workers.vllm.step.decide_step``: vLLM's flat ``[N, V]`` target logits,
one group per rule, the lossless fallback armed), greedy, fp32, synthetic seeded logits of the real
target's vocabulary, drafts equal to the target's choice except every 7th. The reference is the
``argmax`` over the same logits that vLLM's greedy rejection needs at least. No draft distribution or
hidden states are handed over, so a rule that reads them times the step's lossless fallback. Prints the median and
min milliseconds of ``--reps`` timed calls per rule and the machine's load before and after. No
assertions: this is a measurement (README "Plugin overhead").
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

from workers.cli import one_line_errors, parse_rule, require_positive


def timed_ms(fn: Callable[[], object], reps: int) -> tuple[float, float]:
    fn()  # warm-up (allocator, lazy imports)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), min(times)


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    from policies import make_policy
    from workers.vllm.step import decide_step

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32, help="requests in the step (B)")
    ap.add_argument("--draft-len", type=int, default=5, help="drafts per request (L)")
    ap.add_argument("--vocab", type=int, default=151936, help="V (the real target's: 151,936)")
    ap.add_argument("--reps", type=int, default=7, help="timed calls per rule (median and min reported)")
    ap.add_argument("--rule", action="append", default=None, help="NAME or NAME:k=v,... (repeatable; default lossless)")
    args = ap.parse_args(argv)
    require_positive(args, "requests", "draft_len", "vocab", "reps")
    rules = [parse_rule(r) for r in (args.rule or ["lossless"])]
    policies = [(name, make_policy(name, **params)) for name, params in rules]  # bad names/values: one line

    b, n, v = args.requests, args.draft_len, args.vocab
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(b * n, v, generator=gen)
    drafts = logits.argmax(dim=-1)
    drafts[::7] = (drafts[::7] + 1) % v  # some rejections
    bonus = torch.randint(0, v, (b, 1), generator=gen)
    print(f"B={b} L={n} V={v} fp32 T=0  torch threads={torch.get_num_threads()}  cpus={os.cpu_count()}  "
          f"load(1m) before={os.getloadavg()[0]:.2f}")
    print("| step decided by | median ms | min ms | vs argmax |\n|---|---:|---:|---:|")
    ref, ref_min = timed_ms(lambda: logits.argmax(dim=-1), args.reps)
    for (name, params), (_, policy) in zip(rules, policies, strict=True):
        med, low = timed_ms(lambda p=policy: decide_step(
            p, draft_token_ids=drafts, num_draft_tokens=[n] * b, max_spec_len=n, target_logits=logits,
            bonus_token_ids=bonus, temperatures=[0.0] * b), args.reps)
        label = name + (f" {params}" if params else "")
        print(f"| {label} (decide_step) | {med:.1f} | {low:.1f} | {med / ref:.1f}x |")
    print(f"| argmax only (vLLM's greedy core) | {ref:.1f} | {ref_min:.1f} | 1.0x |")
    print(f"load(1m) after={os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
