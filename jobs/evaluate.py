"""Evaluate one acceptance rule on one benchmark, on this machine, without Ray.

    python -m jobs.evaluate --benchmark gsm8k --pair qwen2.5-coder-0.5b+1.5b \\
        --policy kl_judge --param threshold=0.5 --draft-len 5 --limit 20

    python -m jobs.evaluate --engine openai --base-url http://127.0.0.1:8000/v1 --model spectune/tiny-random \\
        --benchmark gsm8k --limit 8 --concurrency 1,4 --policy kl_judge

Runs (or reuses from the cache) the target-only reference and the lossless run at the same draft
length on the same items, then the rule; prints accuracy with a 95% interval, the paired accuracy
drop vs target-only, the noise floor (lossless vs target-only), acceptance length and speedups
(measured and modelled); writes per-item records (JSONL + parquet) and a summary.json. A rerun of
the same command skips items already done. With ``--engine openai`` the reference and the candidate are two
configurations of a running server (or two servers), run interleaved at each ``--concurrency``
(``workers.endpoint_cli``; docs/endpoints.md).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from types import SimpleNamespace
from typing import Any

from workers.benchmarks import BENCHMARKS, Benchmark, Item, get_benchmark
from workers.cli import parse_batch_size, parse_params, parse_shard, sampling_settings  # noqa: F401  (parse_params re-exported: jobs.serve, tests)
from workers.cpu_engine import SpecDecoder
from workers.engine_registry import engine_names, engine_traits
from workers.evaluation import TARGET_ONLY, DecodeSpec, Record, evaluate_item, items_context, workload_profile
from workers.metrics.speed import measured_text, ratio_text
from workers.metrics.trial import NoiseFloor, TrialMetrics, aggregate, noise_floor
from workers.models.calibrate import CostProfile
from workers.results.store import RecordStore, reference_dir, runs_root, slug


def run_items(engine: Any, bench: Benchmark, items: list[Item], spec: DecodeSpec, store: RecordStore,
              label: str, references: dict[str, Record] | None = None, batch: int = 1) -> dict[str, Record]:
    """Evaluate the items the store lacks, appending each record as it is made; show progress. ``batch`` > 1: that
    many items at once (the vLLM engine: one batched ``generate``; the CPU engine: its batched rows, each record
    the one batch 1 makes), each item keeps its own record."""
    done = store.load()
    todo = [it for it in items if it.id not in done]
    if not todo:
        print(f"{label}: {len(items)} items cached in {store.dir}", file=sys.stderr)
    t0 = time.perf_counter()
    tokens, n = 0, 0
    for start in range(0, len(todo), batch):
        group = todo[start: start + batch]
        refs = {it.id: references[it.id].outputs for it in group if references and it.id in references}
        if batch > 1:
            made = engine.evaluate_items(bench, group, spec, refs)
        else:
            made = [evaluate_item(engine, bench, group[0], spec, reference_outputs=refs.get(group[0].id))]
        for item, record in zip(group, made, strict=True):
            n += 1
            store.append(record)
            done[item.id] = record
            tokens += record.tokens
            elapsed = time.perf_counter() - t0
            eta = elapsed / n * (len(todo) - n)
            status = "FAILED " + record.reason if record.failed else f"score {record.score:.2f}"
            print(f"{label} [{n}/{len(todo)}] {item.id} {status} | {tokens / elapsed:.2f} tok/s | "
                  f"ETA {eta:.0f}s", file=sys.stderr, flush=True)
    ordered = {it.id: done[it.id] for it in items}
    store.write_parquet(ordered.values())
    return ordered


def fmt(x: float, pct: bool = False) -> str:
    if isinstance(x, float) and math.isnan(x):
        return "n/a"
    return f"{100 * x:.1f}%" if pct else f"{x:.3f}"


def report(args: argparse.Namespace, metrics: TrialMetrics, floor: NoiseFloor | None, profile: CostProfile) -> str:
    lo, hi = metrics.accuracy_ci
    dlo, dhi = metrics.accuracy_drop_ci
    lines = [
        f"benchmark {args.benchmark}, pair {args.pair} ({profile.dtype}), policy {args.policy} "
        f"{json.dumps(parse_params(args.param))} L={args.draft_len}, T={args.temperature}, items {metrics.items} "
        f"(failures {metrics.failures})",
        f"  accuracy            {fmt(metrics.accuracy, True)}  95% CI [{fmt(lo, True)}, {fmt(hi, True)}]"
        f"   target-only {fmt(metrics.reference_accuracy, True)}",
        f"  accuracy drop       {fmt(metrics.accuracy_drop, True)}  95% CI [{fmt(dlo, True)}, {fmt(dhi, True)}] (paired)",
        f"  mean accept. length {fmt(metrics.mean_acceptance_length)}   draft acceptance {fmt(metrics.draft_acceptance_rate, True)}",
        f"  tokens/s            {fmt(metrics.tokens_per_s)}",
        f"  speedup vs target-only  {measured_text(metrics.speedup_vs_ar_measured, 3)}   modelled "
        f"{ratio_text(metrics.speedup_vs_ar_modelled, 3, 'n/a')}"
        f" (c = {metrics.cost_ratio:.3f}{', calibrated here' if args.cost_ratio is None else ''});"
        f" with c seen in this run ({fmt(metrics.cost_ratio_in_situ)}): "
        f"{ratio_text(metrics.speedup_vs_ar_modelled_in_situ, 3, 'n/a')}",
        f"  speedup vs lossless     {measured_text(metrics.speedup_vs_lossless_measured, 3)}   modelled "
        f"{ratio_text(metrics.speedup_vs_lossless_modelled, 3, 'n/a')}",
        f"  outputs differing from target-only: {fmt(metrics.output_divergence_vs_ar, True)}",
    ]
    if floor is not None:
        lines.append(f"  noise floor (lossless vs target-only, {floor.items} items): outputs differ on "
                     f"{fmt(floor.divergence_rate, True)}, accuracy diff {fmt(floor.accuracy_diff, True)} "
                     f"[{fmt(floor.accuracy_diff_ci[0], True)}, {fmt(floor.accuracy_diff_ci[1], True)}] — a budget "
                     "inside this interval cannot be told from zero")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description="Evaluate one acceptance rule on one benchmark (no Ray).")
    ap.add_argument("--benchmark", required=True, help=f"one of {sorted(BENCHMARKS)}, or a task file PATH.yaml (docs/tasks.md)")
    ap.add_argument("--judge-url", default=None,
                    help="a task file's judge scorer: the OpenAI-compatible base url (overrides judge.url; sets SPECTUNE_JUDGE_URL)")
    ap.add_argument("--pair", default="qwen2.5-coder-0.5b+1.5b", help="pair name (or tiny-random, or DRAFT+TARGET: local model directories or hub ids org/name[@revision] from the local Hugging Face cache)")
    ap.add_argument("--dtype", default="bf16", help="bf16, fp32, int8 (the fast CPU path), int4+int8 (its 4-bit draft) or auto "
                    "(int4+int8 with AVX-512, int8 with AVX2)")
    ap.add_argument("--policy", default="lossless", help=f"a registered rule, or {TARGET_ONLY}")
    ap.add_argument("--param", action="append", default=[], help="rule parameter NAME=VALUE (repeatable)")
    ap.add_argument("--draft-len", type=int, default=5, help="draft length L")
    ap.add_argument("--limit", type=int, default=None, help="first N items (after --subset-seed)")
    ap.add_argument("--subset-seed", type=int, default=None, help="seeded random subset order")
    ap.add_argument("--shard", default=None, help="I/N: evaluate shard I of N")
    ap.add_argument("--shots", type=int, default=0, help="few-shot exemplars (gsm8k: 0 or 8; mmlu: 0 or 5)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--top-p", type=float, default=1.0,
                    help="nucleus sampling at T > 0: every arm samples the target's distribution cut to this mass and "
                         "the rule judges that distribution (1: off)")
    ap.add_argument("--top-k", type=int, default=0, help="top-k sampling at T > 0, as --top-p (0: off)")
    ap.add_argument("--sampler", default="standard", help="standard, or coupled (T > 0, CPU engine): every arm "
                    "draws token t by Gumbel-max with noise keyed by --seed, the item and t, so lossless output equals "
                    "target-only's and a lossy rule is the only source of a difference (its acceptance, and so every "
                    "speed figure it gives, is below the standard sampler's)")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default: the benchmark's own")
    ap.add_argument("--cost-ratio", type=float, default=None, help="c for modelled speedups (default: measured here)")
    ap.add_argument("--runs-root", default=None, help="where runs and reference caches live (default ./runs)")
    ap.add_argument("--no-lossless-ref", action="store_true", help="skip the lossless reference run")
    ap.add_argument("--batch-size", default="auto",
                    help="CPU engine: items decoded at once, each row exact to batch 1 (workers/cpu_batch.py); auto "
                         "(default) times the step at 1..32 rows and picks, 1 is one item after another")
    vl = ap.add_argument_group("the vLLM engine (--engine vllm): docs/vllm-engine.md")
    vl.add_argument("--batch", type=int, default=32, help="vllm: items per batched generate (continuous batching)")
    vl.add_argument("--gpu-memory-utilization", type=float, default=None, help="vllm: fraction of each GPU")
    vl.add_argument("--max-model-len", type=int, default=None, help="vllm: context length to plan for")
    vl.add_argument("--enforce-eager", action="store_true", help="vllm: no CUDA graphs")
    vl.add_argument("--kv-cache-gb", type=float, default=None, help="vllm: KV cache size (vLLM-CPU needs one)")
    vl.add_argument("--tensor-parallel-size", type=int, default=1, help="vllm: GPUs per pair")
    vl.add_argument("--vllm-python", default=None,
                    help="vllm: the interpreter that imports vllm (default: this one, $SPECTUNE_VLLM_PYTHON or the "
                         "checkout's .vllm-venv); the command reruns itself there")
    ep = ap.add_argument_group("an OpenAI-compatible server (--engine openai): docs/endpoints.md")
    ep.add_argument("--engine", choices=engine_names(), default="cpu",
                    help="cpu: the pair in this process (default); vllm: the pair in vLLM with spectune's rules "
                         "inside, in this process (GPU nodes; vLLM-CPU here); openai: a running server at --base-url")
    ep.add_argument("--base-url", help="the candidate's server, e.g. http://127.0.0.1:8000/v1")
    ep.add_argument("--model", help="the model name the server serves (as /v1/models lists it)")
    ep.add_argument("--api-key-env", help="the environment variable holding the server's API key")
    ep.add_argument("--reference-url", help="the reference's server (default: --base-url)")
    ep.add_argument("--reference-model", help="the reference's model name (default: --model)")
    ep.add_argument("--knobs", choices=("spectune", "vllm", "none"), default="spectune",
                    help="spectune: --policy/--param/--draft-len go in the request's spec_decode field (spectune's "
                         "Serve endpoint) and the reference sends speculation off; vllm: --policy/--param go as "
                         "vllm_xargs.spectune_rule to a stock `vllm serve` with spectune's plugin, the reference "
                         "sends none (the server's lossless rule); none: only --extra-body / "
                         "--reference-extra-body (a server configured by its own flags)")
    ep.add_argument("--extra-body", default=None, help="JSON merged into every candidate request")
    ep.add_argument("--reference-extra-body", default=None, help="JSON merged into every reference request")
    ep.add_argument("--concurrency", default="1", help="requests in flight, one value or several: 1,4,16")
    ep.add_argument("--request-timeout", type=float, default=600.0,
                    help="seconds to wait for a server's next bytes (a request that streams is never cut)")
    ep.add_argument("--retries", type=int, default=4,
                    help="retries per request after a 5xx, a timeout or a broken stream (429s are waited out apart)")
    ep.add_argument("--tag", default="", help="names what the servers run that the requests do not show (their "
                                              "flags): another tag is another run, never resumed from this one")
    ep.add_argument("--fresh", action="store_true", help="start over: drop this configuration's held records")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        # the command line only: a caller's process is never replaced
        if engine_traits(args.engine).own_interpreter and argv is None:
            _in_vllm_python(args, sys.argv[1:])
        return _main(args)
    except ValueError as err:  # bad names/values, an unreachable server: one clear line, no traceback
        print(f"error: {err}", file=sys.stderr)
        return 2


def _in_vllm_python(args: argparse.Namespace, argv: list[str]) -> None:
    """``--engine vllm`` where this interpreter lacks vllm: rerun the same command in the one that has it (the
    checkout's .vllm-venv on CPU machines: vLLM pins its own torch and transformers). A ValueError naming the fix
    where there is none."""
    import importlib.util

    from workers.engines import vllm_python

    if args.vllm_python is None and importlib.util.find_spec("vllm") is not None:
        return  # this interpreter runs it
    python = vllm_python(args.vllm_python)
    if python is not None and os.path.abspath(python) != os.path.abspath(sys.executable):  # venvs share a binary
        print(f"--engine vllm: rerunning in {python}", file=sys.stderr, flush=True)
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout, wherever it is run from
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        os.execv(python, [python, "-m", "jobs.evaluate", *argv])


def vllm_engine(args: argparse.Namespace, dtype: str) -> tuple[Any, Any]:
    """The vLLM engine of ``args.pair`` at ``args.draft_len``, and what the report reads of a profile: c is not
    timed through vLLM (``--cost-ratio`` is required) and a verify pass counts one target step."""
    from workers.engines import make_engine
    from workers.metrics.cost import unit_verify

    if args.cost_ratio is None:
        raise ValueError("--engine vllm needs --cost-ratio: vLLM does not time draft and target steps apart "
                         "(python -m workers.calibrate --engine vllm --pair ...)")
    if args.batch < 1:
        raise ValueError(f"--batch must be >= 1, got {args.batch}")
    import importlib.util

    if importlib.util.find_spec("vllm") is None:  # a caller's process (main(argv)) is never re-executed
        raise ValueError("--engine vllm needs vllm in this interpreter: run `python -m jobs.evaluate ...` from a "
                         "shell (it reruns itself in the vLLM environment) or use the vLLM environment's python")
    options = {"gpu_memory_utilization": args.gpu_memory_utilization, "max_model_len": args.max_model_len,
               "enforce_eager": args.enforce_eager or None,
               "kv_cache_memory_bytes": None if args.kv_cache_gb is None else int(args.kv_cache_gb * 2**30)}
    engine = make_engine("vllm", args.pair, dtype, draft_len=args.draft_len,
                         tensor_parallel_size=args.tensor_parallel_size,
                         vllm={k: v for k, v in options.items() if v is not None})
    profile = SimpleNamespace(dtype=f"vllm {dtype}", cost_ratio=args.cost_ratio, verify_factor=unit_verify,
                              to_json=lambda: {"engine": "vllm", "dtype": dtype, "cost_ratio": args.cost_ratio})
    return engine, profile


def _main(args: argparse.Namespace) -> int:
    traits = engine_traits(args.engine)
    if traits.needs_server:
        from workers.endpoint_cli import run_endpoint_evaluation

        return run_endpoint_evaluation(args)
    from workers.models.assets import AssetError
    from workers.models.pair import auto_dtype, load_pair

    if not traits.fast_path:  # vLLM runs bf16 where the device has it (a GPU, an avx512_bf16 CPU), else fp32
        from workers.models.pair import fast_path, native_dtype

        dtype = native_dtype() if args.dtype == "auto" else args.dtype
        if fast_path(dtype):
            raise ValueError(f"--dtype {dtype} is the CPU engine's fast path; --engine vllm runs bf16, fp16 or fp32")
    else:
        dtype = auto_dtype() if args.dtype == "auto" else args.dtype
    if args.judge_url:
        os.environ["SPECTUNE_JUDGE_URL"] = args.judge_url
    bench = get_benchmark(args.benchmark)
    max_new = args.max_new_tokens or bench.default_max_new_tokens
    parse_batch_size(args.batch_size)  # a bad value is one line now, not after the pair loads
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {args.limit}")
    settings = dict(temperature=args.temperature, seed=args.seed, max_new_tokens=max_new, shots=args.shots,
                    **sampling_settings(args))
    spec = DecodeSpec.make(args.policy, parse_params(args.param), args.draft_len, **settings)
    items = bench.items(limit=args.limit, shard=parse_shard(args.shard), seed=args.subset_seed)
    batch = 1
    try:
        if not traits.measures_cost:  # c from --cost-ratio, not timed here
            engine, profile = vllm_engine(args, dtype)
            batch, tag = args.batch, f"vllm-{dtype}"  # vLLM's records are its own: never the CPU engine's cache
        else:
            pair = load_pair(args.pair, dtype=dtype)
            profile = workload_profile(pair, bench, items, spec)  # timed at the context these items decode at
            engine, tag = SpecDecoder(pair), dtype
            engine.batch_size = parse_batch_size(args.batch_size)
            batch = engine.batcher(context=items_context(pair, bench, items, spec)).size
            if engine.batch_size == batch and getattr(engine, "batch_choice", None):
                print(f"batch size {batch} (auto: {engine.batch_choice})", file=sys.stderr)
    except AssetError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    cost_ratio = args.cost_ratio if args.cost_ratio is not None else profile.cost_ratio
    root = runs_root(args.runs_root)

    ar_spec = DecodeSpec.make(TARGET_ONLY, **settings)
    ar = run_items(engine, bench, items, ar_spec,
                   RecordStore(reference_dir(root, args.pair, tag, bench.key, ar_spec)), TARGET_ONLY, batch=batch)
    lossless = None
    if spec.policy != TARGET_ONLY and not args.no_lossless_ref:
        ll_spec = DecodeSpec.make("lossless", {}, args.draft_len, **settings)
        lossless = run_items(engine, bench, items, ll_spec,
                             RecordStore(reference_dir(root, args.pair, tag, bench.key, ll_spec)),
                             f"lossless L={args.draft_len}", references=ar, batch=batch)
    if spec.policy == TARGET_ONLY:
        records = ar
    elif spec.policy == "lossless" and lossless is not None and not spec.params:
        records = lossless
    else:
        run_dir = root / "eval" / slug(f"{bench.key}-{args.pair}-{tag}") / f"{slug(spec.label())}-{spec.key()}"
        records = run_items(engine, bench, items, spec, RecordStore(run_dir), spec.label(), references=ar, batch=batch)
    metrics = aggregate(list(records.values()), list(ar.values()), list(lossless.values()) if lossless else None,
                        cost_ratio=cost_ratio, verify_factor=profile.verify_factor)
    floor = noise_floor(list(lossless.values()), list(ar.values())) if lossless else None
    text = report(args, metrics, floor, profile)
    print(text)
    if batch > 1 and traits.batches_shards:
        print(f"  (vLLM: {batch} items per batch, so a record's seconds overlap others': the measured speedups "
              "compare batched runs, not one request's latency)")
    elif batch > 1:
        print(f"  (CPU engine: {batch} items at once, each exact to batch 1; a batched record's seconds overlap its "
              "neighbours', so no measured speedup is stated: --batch-size 1 times one item at a time, "
              "python -m jobs.bench.throughput the batched engine's throughput)")
    if spec.sampler == "coupled":
        print("  (coupled sampler: every arm drew token t with the same noise, keyed by --seed, the item and t, so lossless "
              "output is target-only's and the rule alone makes a difference; its acceptance is below the standard "
              "sampler's, so these speeds understate a deployment's and may overstate a lossy rule's gain over lossless)")
    close = getattr(engine, "close", None)
    if close is not None:
        close()
    out = root / "eval" / "summaries"
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{slug(bench.name + '-' + spec.label())}-{spec.key()}-{len(items)}.json"
    path.write_text(json.dumps({"args": vars(args), "metrics": metrics.to_dict(),
                                "noise_floor": None if floor is None else floor.__dict__,
                                "profile": profile.to_json()}, indent=1, default=str))
    print(f"summary: {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
