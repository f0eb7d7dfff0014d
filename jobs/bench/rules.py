"""Benchmark: the cost of every acceptance rule next to the target LM-head matmul, and DropMatch's
candidate-mode agreement with exact mode.

    python -m jobs.bench.rules [--source auto|real|synthetic] [--reps 30]

One verify step at B = 1, L = 5 with the target's real LM head (V = 151,936, d = 1,536) and real
hidden states / logits from a teacher-forced passage (``real``), or random ones of the same shape
(``synthetic``). For each rule: median time of ``verify`` (decide + emission), and that time as a
percentage of the LM-head matmul over the same L+1 positions, in bf16 and fp32. Prints the
machine's load next to the figures. No assertions: this is a measurement.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from policies import POLICIES, VerifyBatch, get_spec, make_policy, verify

PASSAGE = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?\n"
    "Natalia sold 48 / 2 = 24 clips in May. Altogether she sold 48 + 24 = 72 clips in April and May. "
    "The answer is 72.\n"
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
    "How much did she earn?\nWeng earns 12 / 60 = $0.2 per minute. Working 50 minutes, she earned "
    "0.2 x 50 = $10. The answer is 10.\n"
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
)


@dataclass
class Windows:
    """Teacher-forced verify windows from one passage: rows j..j+L of the target, draft argmax."""

    hidden: torch.Tensor  # [N, d] target final hidden states (post-norm)
    target_logits: torch.Tensor  # [N, V]
    draft_logits: torch.Tensor  # [N, V]
    weight: torch.Tensor  # [V, d]
    source: str

    def weight_as(self, dtype: torch.dtype) -> torch.Tensor:
        # the engine holds its LM head in one dtype; converting 233M weights per call would
        # dominate every timing, so cache one copy per dtype
        cache = self.__dict__.setdefault("_weights", {})
        if dtype not in cache:
            cache[dtype] = self.weight.to(dtype)
        return cache[dtype]

    def batch(self, start: int, draft_len: int, dtype: torch.dtype, seed: int) -> VerifyBatch:
        sl = slice(start, start + draft_len + 1)
        draft = self.draft_logits[start : start + draft_len].to(dtype).unsqueeze(0)
        return VerifyBatch(
            draft_token_ids=draft.float().argmax(-1),
            draft_logits=draft,
            target_logits=self.target_logits[sl].to(dtype).unsqueeze(0),
            target_hidden=self.hidden[sl].to(dtype).unsqueeze(0),
            lm_head_weight=self.weight_as(dtype),
            temperature=0.0,
            generator=torch.Generator().manual_seed(seed),
        )

    @property
    def count(self) -> int:
        return self.hidden.shape[0]


def real_windows(pair_name: str) -> Windows:
    from workers.models.pair import load_pair

    pair = load_pair(pair_name, dtype=torch.bfloat16)
    ids = torch.tensor([pair.tokenizer.encode(PASSAGE)])
    with torch.inference_mode():
        out = pair.target(ids, output_hidden_states=True)
        draft_out = pair.draft(ids)
    weight = pair.target.get_output_embeddings().weight.detach()
    hidden = out.hidden_states[-1][0].detach()
    return Windows(hidden, out.logits[0].detach().float(), draft_out.logits[0].detach().float(), weight, "real")


def synthetic_windows(n: int = 96, vocab: int = 151_936, hidden_size: int = 1536) -> Windows:
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(vocab, hidden_size, generator=g) * 0.035
    hidden = torch.randn(n, hidden_size, generator=g) * 2.0
    target = hidden @ weight.T
    draft = target + torch.randn(n, vocab, generator=g) * 1.0
    return Windows(hidden, target, draft, weight, "synthetic")


def median_ms(fn: Callable[[], object], reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def rule_variants() -> list[tuple[str, dict]]:
    variants = []
    for name in sorted(POLICIES):
        if name == "dropmatch":
            for mode in ("candidate", "exact"):
                for criterion in ("js", "naive"):
                    variants.append((name, {"mode": mode, "criterion": criterion}))
        else:
            variants.append((name, dict(get_spec(name).example)))
    return variants


def agreement(win: Windows, draft_len: int, seeds: int) -> list[tuple[str, int, int]]:
    rows = []
    for criterion in ("js", "naive"):
        agree = total = 0
        for start in range(0, win.count - draft_len - 1):
            for seed in range(seeds):
                exact = make_policy("dropmatch", criterion=criterion, mode="exact").decide(
                    win.batch(start, draft_len, torch.float32, seed)
                )
                cand = make_policy("dropmatch", criterion=criterion, mode="candidate").decide(
                    win.batch(start, draft_len, torch.float32, seed)
                )
                agree += int((exact.accepted == cand.accepted).sum())
                total += exact.accepted.numel()
        rows.append((criterion, agree, total))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", choices=("auto", "real", "synthetic"), default="auto",
                    help="real: the target's LM head and hidden states from the real pair (needs the fetched assets)")
    ap.add_argument("--pair", default="qwen2.5-coder-0.5b+1.5b", help="pair for --source real")
    ap.add_argument("--reps", type=int, default=30, help="timed repetitions per cell (median reported)")
    ap.add_argument("--draft-len", type=int, default=5, help="L")
    ap.add_argument("--agreement-seeds", type=int, default=3, help="dropout seeds per window for the agreement check")
    args = ap.parse_args(argv)

    if args.source == "synthetic":
        win = synthetic_windows()
    else:
        try:
            win = real_windows(args.pair)
        except Exception as err:  # the asset layer's errors name the missing file and the fix
            if args.source == "real":
                print(f"error: {err}", file=sys.stderr)
                return 2
            print(f"note: real pair unavailable ({err}); using synthetic logits", file=sys.stderr)
            win = synthetic_windows()

    n = args.draft_len
    load_before = os.getloadavg()
    print(f"source={win.source}  B=1 L={n} V={win.weight.shape[0]} d={win.weight.shape[1]}  "
          f"torch threads={torch.get_num_threads()}  cpus={os.cpu_count()}  load(1m) before={load_before[0]:.2f}")
    results: dict[tuple[str, str], float] = {}
    lm_head: dict[str, float] = {}
    for dtype, tag in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        batch = win.batch(10, n, dtype, 0)
        weight, hidden = batch.lm_head_weight, batch.target_hidden
        lm_head[tag] = median_ms(lambda w=weight, h=hidden: F.linear(h, w), args.reps)
        for name, params in rule_variants():
            policy = make_policy(name, **params)
            label = name + ("" if name != "dropmatch" else f" ({params['mode']}, {params['criterion']})")
            reps = max(3, args.reps // 5) if params.get("mode") == "exact" else args.reps
            # A fresh VerifyBatch per call (its float32 statistics are cached per batch, as in the
            # engine), built from tensors prepared outside the timed region.
            results[(label, tag)] = median_ms(
                lambda p=policy, b=batch: verify(p, replace(b, generator=torch.Generator().manual_seed(0))), reps
            )
    load_after = os.getloadavg()

    print("\n| rule | bf16 ms | % of LM head | fp32 ms | % of LM head |\n|---|---:|---:|---:|---:|")
    print(f"| target LM-head matmul ({n + 1} positions) | {lm_head['bf16']:.2f} | 100 | {lm_head['fp32']:.2f} | 100 |")
    labels = list(dict.fromkeys(label for label, _ in results))
    for label in labels:
        b, f = results[(label, "bf16")], results[(label, "fp32")]
        print(f"| {label} | {b:.2f} | {100 * b / lm_head['bf16']:.1f} | {f:.2f} | {100 * f / lm_head['fp32']:.1f} |")
    print(f"\nload(1m) after={load_after[0]:.2f}")

    print("\nDropMatch candidate (top-64 + draft + rest) vs exact decisions, K=5, p_drop=0.3, fp32:")
    for criterion, agree, total in agreement(win, n, args.agreement_seeds):
        print(f"  {criterion:5s}: {agree}/{total} = {100 * agree / total:.2f}% agree")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
