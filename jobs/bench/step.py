"""Benchmark: one vLLM verify step decided by spectune's plugin code, next to vLLM's greedy core.

    python -m jobs.bench.step [--requests 32] [--draft-len 5] [--vocab 151936] [--reps 7]
        [--temperature 0.7] [--per-request-seeds] [--hidden-size 1536]
        [--rule lossless] [--rule kl_judge:threshold=0.5] ...

The step as the plugin sees it (``workers.vllm.step.decide_step``: vLLM's flat ``[N, V]`` target logits,
the draft's logits, the target's hidden states and LM head, the lossless fallback armed), fp32,
synthetic seeded logits of the real target's vocabulary (``jobs.gpu.steps.synthetic_step``: target logits
through a random LM head, the draft's with noise, drafts the draft's argmax, some rejected). With
``--per-request-seeds`` every request carries its own rule and seed, as per-request rules in vLLM do
(each request's random draws keyed by its own seed, whatever shares the batch). Every table also times
the reference figures side by side in the same run: the *greedy group* (lossless at T = 0, one rule for
the step: the cheapest decision) and the ``argmax`` over the same logits that vLLM's greedy rejection
needs at least. The draft's logits are handed over as the plugin hands them (divided by T, made once outside
the timing: the drafter makes them). Prints the median and min milliseconds of ``--reps`` rounds in which
every timed call takes its turn (interleaved: a slow spell hits all of them), the median page faults and
kernel milliseconds per call (``getrusage``: the host allocator's share, ``--glibc-default-malloc``), the fallbacks seen
(a rule that fell back is timing the lossless rule, not itself) and the machine's load before and after.
No assertions: this is a measurement (docs/measurements.md "Per-step cost").
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from workers.cli import one_line_errors, parse_rule, require_positive


def interleaved_ms(fns: dict[str, Callable[[], object]], reps: int
                   ) -> dict[str, tuple[float, float, float, float, float]]:
    """Per function over ``reps`` rounds, the functions taking turns within each round (a slow spell of a
    shared machine hits all of them, not the one that happened to run then): median and min wall ms, and
    the median page faults and kernel (system) ms per call, from ``getrusage`` (the host allocator's cost:
    workers.host_memory), and the first (warm-up) call's ms: one-time costs such as compiling the fused
    kernel (policies.fused)."""
    first: dict[str, float] = {}
    for name, fn in fns.items():  # warm-up (allocator, lazy imports, the fused kernel's compilation)
        t0 = time.perf_counter()
        fn()
        first[name] = (time.perf_counter() - t0) * 1e3
    times: dict[str, list[float]] = {name: [] for name in fns}
    faults: dict[str, list[float]] = {name: [] for name in fns}
    kernel: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            fn()
            t1, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
            times[name].append((t1 - t0) * 1e3)
            faults[name].append(r1.ru_minflt - r0.ru_minflt)
            kernel[name].append((r1.ru_stime - r0.ru_stime) * 1e3)
    return {name: (statistics.median(times[name]), min(times[name]), statistics.median(faults[name]),
                   statistics.median(kernel[name]), first[name]) for name in fns}


@contextmanager
def blocks_of(mib: float | None) -> Iterator[None]:
    """policies.ragged's CPU block size set to ``mib`` MiB (float32 elements) inside the block (None: as is)."""
    import policies.ragged as ragged

    if mib is None:
        yield
        return
    saved = ragged.CHUNK_ELEMENTS_CPU, ragged.CHUNK_ELEMENTS_CPU_FUSED, ragged.CHUNK_ELEMENTS_CPU_HEADS
    ragged.CHUNK_ELEMENTS_CPU = ragged.CHUNK_ELEMENTS_CPU_FUSED = ragged.CHUNK_ELEMENTS_CPU_HEADS = max(
        1, int(mib * (1 << 20)) // 4)
    try:
        yield
    finally:
        ragged.CHUNK_ELEMENTS_CPU, ragged.CHUNK_ELEMENTS_CPU_FUSED, ragged.CHUNK_ELEMENTS_CPU_HEADS = saved


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    from jobs.gpu.steps import call_rule, fallbacks, synthetic_step
    from policies import make_policy

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32, help="requests in the step (B)")
    ap.add_argument("--draft-len", type=int, default=5, help="drafts per request (L)")
    ap.add_argument("--vocab", type=int, default=151936, help="V (the real target's: 151,936)")
    ap.add_argument("--hidden-size", type=int, default=1536, help="d of the target's LM head (DropMatch's heads)")
    ap.add_argument("--reps", type=int, default=7, help="timed calls per rule (median and min reported)")
    ap.add_argument("--temperature", type=float, default=0.0, help="every request's temperature")
    ap.add_argument("--per-request-seeds", action="store_true",
                    help="each request its own rule and seed (vLLM per-request rules), not one rule for the step")
    ap.add_argument("--rule", action="append", default=None, help="NAME or NAME:k=v,... (repeatable; default lossless)")
    ap.add_argument("--compare-eager", action="store_true",
                    help="also time every rule with the fused statistics kernel off (policies.fused: SPECTUNE_FUSED=0), "
                         "in the same rounds")
    ap.add_argument("--chunk-mib", type=float, action="append", default=None,
                    help="the rules' float32 block per call on CPU, in MiB (repeatable: every rule timed at each; "
                         "default: policies.ragged's, 8 MiB with the eager kernels, 32 MiB with the fused one)")
    ap.add_argument("--glibc-default-malloc", action="store_true",
                    help="leave glibc's malloc thresholds as they are (freed blocks back to the kernel: fresh pages on "
                         "every pass), to measure workers.host_memory against them")
    args = ap.parse_args(argv)
    require_positive(args, "requests", "draft_len", "vocab", "reps", "hidden_size")
    if any(not mib > 0 for mib in args.chunk_mib or []):
        raise ValueError(f"--chunk-mib must be > 0, got {args.chunk_mib}")
    if not args.temperature >= 0.0:
        raise ValueError(f"--temperature must be >= 0, got {args.temperature}")
    from policies import fused

    fused_mode = fused.mode()  # a bad SPECTUNE_FUSED fails here, in one line
    rules = [parse_rule(r) for r in (args.rule or ["lossless"])]
    policies = [(name, make_policy(name, **params)) for name, params in rules]  # bad names/values: one line

    from workers.host_memory import keep_freed_memory

    kept = False if args.glibc_default_malloc else keep_freed_memory()
    b, n, v, t = args.requests, args.draft_len, args.vocab, args.temperature
    step = synthetic_step(b, v, args.hidden_size, torch.device("cpu"), draft_len=n, head_dtype=torch.float32)

    def call(policy, temperature: float, own: bool, mode: str | None = None, mib: float | None = None):
        with fused.forced(mode or fused_mode), blocks_of(mib):
            return call_rule(policy, step, temperature, per_request=own)

    mode = "per-request rules and seeds" if args.per_request_seeds else "one rule for the step"
    print(f"B={b} L={n} V={v} d={args.hidden_size} fp32 T={t:g} ({mode})  torch threads={torch.get_num_threads()}  "
          f"cpus={os.cpu_count()}  load(1m) before={os.getloadavg()[0]:.2f}  "
          f"freed memory kept (workers.host_memory)={kept}  SPECTUNE_FUSED={fused_mode}")
    print("| step decided by | median ms | min ms | vs greedy group | vs argmax | fallbacks | page faults / call "
          "| kernel ms / call | first call ms |\n|---|---:|---:|---:|---:|---|---:|---:|---:|")
    lossless = make_policy("lossless")
    fns: dict[str, Callable[[], object]] = {"argmax": lambda: step.target_logits.argmax(dim=-1),
                                             "group": lambda: call(lossless, 0.0, False)}
    variants = [(mode, mib) for mode in ([None, "0"] if args.compare_eager else [None])
                for mib in (args.chunk_mib or [None])]
    for i, (_, policy) in enumerate(policies):
        for mode, mib in variants:
            fns[f"rule{i}:{mode}:{mib}"] = lambda p=policy, m=mode, c=mib: call(p, t, args.per_request_seeds, m, c)
    timed = interleaved_ms(fns, args.reps)
    ref, group = timed["argmax"][0], timed["group"][0]

    def row(label: str, key: str, seen: str) -> None:
        med, low, flt, sys_ms, first = timed[key]
        print(f"| {label} | {med:.1f} | {low:.1f} | {med / group:.2f}x | {med / ref:.1f}x | {seen} | {flt:.0f} "
              f"| {sys_ms:.0f} | {first:.0f} |")

    for i, ((name, params), (_, policy)) in enumerate(zip(rules, policies, strict=True)):
        label = name + (f" {params}" if params else "")
        for mode, mib in variants:
            seen = fallbacks(call(policy, t, args.per_request_seeds, mode, mib))
            how = ", ".join(x for x in ("eager kernels" if mode == "0" else "",
                                        f"{mib:g} MiB blocks" if mib is not None else "") if x)
            row(f"{label} (decide_step{', ' + how if how else ''})", f"rule{i}:{mode}:{mib}", "; ".join(seen) or "none")
    row("greedy group: lossless T=0, one rule (decide_step)", "group", "none")
    row("argmax only (vLLM's greedy core)", "argmax", "-")
    print(f"load(1m) after={os.getloadavg()[0]:.2f}" + (f"  fused kernel failed: {fused.failure()}"
                                                        if fused.failure() else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
