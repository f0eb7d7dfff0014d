"""Benchmark: replay evaluation against full speculative decoding, on the same items, in one run.

    python -m jobs.bench.replay --pair tiny-random --benchmark gsm8k --items 8 --policy kl_judge
    python -m jobs.bench.replay --pair qwen2.5-coder-0.5b+1.5b --benchmark gsm8k --items 8 --policy kl_judge \\
        --param threshold=0.1 --param confidence=0.7 --draft-len 5 --shots 8 --max-new-tokens 192

For each item (GSM8K test rows in file order, or the benchmark's first N): target-only decoding (the
reference both arms start from; its time is in neither figure), then the rule by replay (``workers.replay``:
one teacher-forced pass per model, the rule's decisions at every position, decoding only from the round
that left the target-only prefix) and the rule by full speculative decoding, one after the other before
the next item, so load drifts hit both alike. With several ``--draft-len`` values one pass serves every L.

Prints one line per figure: ``items``, ``diverged`` (items a live run leaves the target-only output on,
with the median position), ``agreement: X/N`` (item x L cases whose replayed tokens, acceptance counts and
modelled cost equal full decoding's), ``near-ties`` (cases decoded in full because the pass's argmax
disagreed with the reference: numerics, explained in ``workers.replay``), ``replay/full time: R`` (replay's
seconds over full decoding's, same items and L), then what each part cost, the machine and its load.
No assertions: this is a measurement (the exactness contract is ``tests/workers/test_replay.py``).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

from workers.cli import one_line_errors, parse_params
from workers.metrics.cost import modelled_cost

FIELDS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_position", "target_forwards",
          "draft_forwards", "num_generated")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description="Replay evaluation vs full speculative decoding on the same items.")
    ap.add_argument("--pair", default="tiny-random", help="pair name or DRAFT+TARGET (default tiny-random)")
    ap.add_argument("--benchmark", default="gsm8k", help="benchmark name or task file (default gsm8k)")
    ap.add_argument("--items", type=int, default=8, help="items (the benchmark's first N; default 8)")
    ap.add_argument("--policy", default="kl_judge", help="the rule (default kl_judge)")
    ap.add_argument("--param", action="append", default=[], help="a knob, NAME=VALUE (repeatable)")
    ap.add_argument("--draft-len", default="5", help="draft length(s), comma separated (default 5)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default: 48 on tiny-random, else the benchmark's")
    ap.add_argument("--shots", type=int, default=0, help="few-shot exemplars (default 0)")
    ap.add_argument("--dtype", default="fp32", help="fp32 (default) or bf16")
    ap.add_argument("--seed", type=int, default=0)
    return ap


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    from policies import make_policy
    from workers.benchmarks import get_benchmark
    from workers.cpu_engine import SpecDecoder
    from workers.models.pair import load_pair
    from workers.prompts import encode_chat
    from workers.replay import decisions, forced_pass, replay

    lengths = sorted({int(x) for x in args.draft_len.split(",") if x.strip()})
    if not lengths or min(lengths) < 1 or args.items < 1:
        raise ValueError("--draft-len values and --items must be >= 1")
    policy = make_policy(args.policy, **parse_params(args.param))
    bench = get_benchmark(args.benchmark)
    pair = load_pair(args.pair, dtype=args.dtype)
    engine = SpecDecoder(pair)
    max_new = args.max_new_tokens or (48 if args.pair == "tiny-random" else bench.default_max_new_tokens)
    items = bench.items(limit=args.items)
    stop = list(bench.stop) or None
    from workers.evaluation import DecodeSpec, workload_profile

    profile = workload_profile(pair, bench, items, DecodeSpec(max_new_tokens=max_new, shots=args.shots))
    load_before = os.getloadavg()[0]
    speed = {"ref_tok": 0, "ref_s": 0.0, "ref_cost": 0.0, "tok": 0, "s": 0.0, "cost": 0.0}
    t = {"reference": 0.0, "forced": 0.0, "decide": 0.0, "decode": 0.0, "simulate": 0.0, "full": 0.0}
    agree = cases = near = 0
    diverged: dict[str, int] = {}
    with torch.inference_mode():
        for n, item in enumerate(items, 1):
            ids = encode_chat(pair.tokenizer, bench.messages(item, shots=args.shots), getattr(bench, "chat", None))
            t0 = time.perf_counter()
            ref = engine.autoregressive(ids, max_new_tokens=max_new, stop=stop, seed=args.seed)
            t1 = time.perf_counter()
            forced = forced_pass(engine, ids, ref.token_ids, ref.finish_reason)
            t2 = time.perf_counter()
            acc = decisions(engine, forced, policy, args.seed)
            t3 = time.perf_counter()
            t["reference"] += t1 - t0
            t["forced"] += t2 - t1
            t["decide"] += t3 - t2
            for draft_len in lengths:
                t4 = time.perf_counter()
                got = replay(engine, ids, ref, policy, draft_len, max_new, seed=args.seed, stop=stop, forced=forced,
                             accepted=acc)
                t5 = time.perf_counter()
                full = engine.generate(ids, policy, draft_len=draft_len, max_new_tokens=max_new, seed=args.seed,
                                       stop=stop)
                t6 = time.perf_counter()
                if draft_len == lengths[0]:  # the speed model against the measurement, same items, batch 1
                    st, rs = full.stats, ref.stats
                    speed["tok"] += st.num_generated
                    speed["s"] += st.decode_time_s
                    speed["cost"] += modelled_cost(st, profile.cost_ratio, profile.verify_factor)
                    speed["ref_tok"] += rs.num_generated
                    speed["ref_s"] += rs.decode_time_s
                    speed["ref_cost"] += modelled_cost(rs, profile.cost_ratio)
                decoded = got.seconds.get("decode_s", 0.0)
                t["decode"] += decoded
                t["simulate"] += (t5 - t4) - decoded
                t["full"] += t6 - t5
                cases += 1
                same = got.generation.token_ids == full.token_ids and all(
                    getattr(got.generation.stats, f) == getattr(full.stats, f) for f in FIELDS)
                agree += same
                near += got.reason == "near-tie"
                if got.diverged_at is not None and draft_len == lengths[0]:
                    diverged[item.id] = got.diverged_at
                if not same:
                    print(f"  DISAGREES: {item.id} L={draft_len} ({got.reason})", file=sys.stderr, flush=True)
            print(f"[{n}/{len(items)}] {item.id}: {len(ref.token_ids)} tokens, {forced.near_ties} near-tie rows; "
                  f"replay so far {t['forced'] + t['decide'] + t['simulate'] + t['decode']:.1f} s, full {t['full']:.1f} s",
                  file=sys.stderr, flush=True)
    replay_s = t["forced"] + t["decide"] + t["simulate"] + t["decode"]
    where = f" (median position {statistics.median(diverged.values()):g})" if diverged else ""
    print(f"items: {len(items)}")
    print(f"diverged: {len(diverged)}/{len(items)} at L={lengths[0]}{where}")
    print(f"agreement: {agree}/{cases} ({len(items)} items x L in {lengths}: tokens, acceptance counts, modelled cost)")
    print(f"near-ties: {near} case(s) decoded in full because the pass's argmax disagreed with the reference")
    print(f"replay/full time: {replay_s / t['full']:.3f}" if t["full"] > 0 else "replay/full time: n/a")
    print(f"replay {replay_s:.1f} s (forced passes {t['forced']:.1f}, decisions {t['decide']:.1f}, simulation "
          f"{t['simulate']:.2f}, decoding {t['decode']:.1f}); full decoding {t['full']:.1f} s; target-only reference "
          f"{t['reference']:.1f} s (in neither)")
    if speed["s"] > 0 and speed["ref_s"] > 0 and speed["cost"] > 0:
        measured = (speed["tok"] / speed["s"]) / (speed["ref_tok"] / speed["ref_s"])
        modelled = (speed["tok"] / speed["cost"]) / (speed["ref_tok"] / speed["ref_cost"])
        print(f"speed over target-only at L={lengths[0]}: modelled {modelled:.3f}x (c = {profile.cost_ratio:.3f}, verify "
              f"factor {profile.verify_factor(lengths[0]):.2f}, calibrated at load {profile.load_1m:.2f}), measured "
              f"{measured:.3f}x (ratio of sums, batch 1, same items): the model is off by "
              f"{100 * (modelled / measured - 1):+.1f}%")
    print(f"machine: {platform.node()}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}, "
          f"load(1m) {load_before:.2f} -> {os.getloadavg()[0]:.2f}; {args.pair} {args.dtype}, {args.benchmark}, "
          f"{args.policy} {parse_params(args.param)}, max_new_tokens {max_new}, shots {args.shots}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
