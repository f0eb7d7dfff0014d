"""Benchmark: where the fast path's cost ratio c comes from — the draft step with its whole LM head and with the
proposal head (and with its layers run eagerly instead of as the scripted graph of ``workers.models.fast_step``),
beside the target step, interleaved in one run, and the share of each step spent in the GEMMs
(fbgemm's ``quantized::linear_dynamic`` for int8 weights, ``aten::_weight_int4pack_mm_for_cpu`` for the 4-bit
draft of ``--dtype int4+int8``, from the profiler).

    python -m jobs.bench.draft_cost [--pair qwen2.5-coder-0.5b+1.5b] [--dtype int8|int4+int8] [--context 300] [--rounds 60]
        [--threads N]

Prints the machine, its load before and after, the median step times and c with each head, and per model the
step body's time with the GEMMs' part of it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from workers.cli import one_line_errors

GEMMS = ("quantized::linear_dynamic", "aten::_weight_int4pack_mm_for_cpu")  # the fast path's int8 and int4 GEMMs


def _profiled_gemm_share(decoder, cache, context: int, steps: int = 5) -> tuple[float, float]:
    """(body ms, GEMM ms) per one-token step, from the profiler's self CPU times over ``steps`` steps."""
    from torch.profiler import profile

    with profile() as prof:
        for i in range(steps):
            cache.crop(context)
            decoder(input_ids=torch.tensor([[100 + i]]), past_key_values=cache)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events) / 1e3 / steps
    gemm = sum(e.self_cpu_time_total for e in events if e.key in GEMMS) / 1e3 / steps
    return total, gemm


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Benchmark: the fast path's draft step with its whole head and with the "
                                             "proposal head, beside the target step (one interleaved run).")
    ap.add_argument("--pair", default="qwen2.5-coder-0.5b+1.5b", help="pair name or DRAFT+TARGET")
    ap.add_argument("--dtype", default="int8", help="a fast-path dtype: int8 or int4+int8 (the 4-bit draft)")
    ap.add_argument("--context", type=int, default=300, help="tokens in the KV cache before each step")
    ap.add_argument("--rounds", type=int, default=60, help="interleaved rounds (the first 10 are warm-up)")
    ap.add_argument("--proposal-size", type=int, default=None,
                    help="the proposal vocabulary's size (default: the CPU engine's)")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads (0: torch's default, every core; a sweep's pair actors use 1 each)")
    args = ap.parse_args(argv)
    if args.context < 1 or args.rounds < 12:
        raise ValueError(f"--context must be >= 1 and --rounds >= 12, got {args.context} and {args.rounds}")
    if args.threads < 0:
        raise ValueError(f"--threads must be >= 0, got {args.threads}")
    if args.proposal_size is not None and args.proposal_size < 1:
        raise ValueError(f"--proposal-size must be >= 1, got {args.proposal_size}")
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace) -> int:
    from workers.models.pair import dtype_tag, fast_path

    if not fast_path(args.dtype):
        raise ValueError(f"--dtype must be a fast-path dtype (int8, int4+int8), got {args.dtype!r}")
    tag = dtype_tag(args.dtype)

    from workers.models.calibrate import machine_key
    from workers.models.fast import new_cache
    from workers.models.pair import load_pair
    from workers.models.proposal import for_pair

    load_before = os.getloadavg()[0]
    pair = load_pair(args.pair, dtype=tag)
    proposal = for_pair(pair) if args.proposal_size is None else for_pair(pair, args.proposal_size)
    if proposal is None:
        raise ValueError(f"pair {args.pair!r} has no proposal vocabulary (its tokenizer is within the proposal size)")
    g = torch.Generator().manual_seed(0)
    high = min(30_000, int(pair.draft.get_input_embeddings().num_embeddings))  # ids every head holds
    prompt = torch.randint(0, high, (1, args.context), generator=g)
    steps = torch.randint(0, high, (args.rounds,), generator=g)
    caches = {}
    with torch.inference_mode():
        for name, model in (("draft", pair.draft), ("target", pair.target)):
            caches[name] = new_cache(model)
            model.get_decoder()(input_ids=prompt, past_key_values=caches[name])
        arms = {"draft, whole head": (pair.draft, pair.draft.get_output_embeddings(), True),
                "draft, proposal head": (pair.draft, proposal.logits, True),
                "target": (pair.target, pair.target.get_output_embeddings(), True)}
        draft_decoder = pair.draft.get_decoder()
        if draft_decoder.uses_scripted():  # the same step run op by op from Python: what scripting saves
            arms["draft, proposal head, eager step"] = (pair.draft, proposal.logits, False)
        times: dict[str, list[float]] = {k: [] for k in arms}
        for r in range(args.rounds):
            for name, (model, head, scripted) in arms.items():
                cache = caches["draft" if model is pair.draft else "target"]
                cache.crop(args.context)
                model.get_decoder().scripted = scripted
                t0 = time.perf_counter()
                hidden = model.get_decoder()(input_ids=steps[r].view(1, 1), past_key_values=cache).last_hidden_state
                head(hidden[0])
                times[name].append(time.perf_counter() - t0)
                model.get_decoder().scripted = True
        med = {k: statistics.median(v[10:]) * 1e3 for k, v in times.items()}
        parts = {name: _profiled_gemm_share(pair.draft.get_decoder() if name == "draft" else pair.target.get_decoder(),
                                            caches[name], args.context) for name in ("draft", "target")}
    print(f"pair {args.pair}, {tag}, machine {machine_key()}, {torch.get_num_threads()} threads, context "
          f"{args.context}, {args.rounds - 10} rounds (median); load(1m) {load_before:.2f} before, "
          f"{os.getloadavg()[0]:.2f} after; proposal vocabulary {len(proposal.ids)} ids")
    for name, ms in med.items():
        print(f"{name}: {ms:.2f} ms a step")
    print(f"cost ratio c, whole head: {med['draft, whole head'] / med['target']:.3f}")
    print(f"cost ratio c, proposal head: {med['draft, proposal head'] / med['target']:.3f}")
    if "draft, proposal head, eager step" in med:
        eager = med["draft, proposal head, eager step"]
        print(f"scripted one-token step: {med['draft, proposal head']:.2f} ms against {eager:.2f} ms eager "
              f"({med['draft, proposal head'] / eager:.3f}x); cost ratio c with the eager step: "
              f"{eager / med['target']:.3f}")
    for name, (body, gemm) in parts.items():
        print(f"{name} step body (profiled, no LM head): {body:.1f} ms, GEMMs {gemm:.1f} ms ({gemm / body:.0%})")
    print(f"draft GEMMs / target GEMMs: {parts['draft'][1] / parts['target'][1]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
