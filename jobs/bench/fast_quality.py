"""Benchmark: the fast CPU path's quality against fp32 — target-only accuracy and token agreement, paired.

    python -m jobs.bench.fast_quality [--items 200] [--fast int8] [--reference fp32] [--shots 8]

GSM8K test items (the first N), greedy target-only decoding in both dtypes, scored by the benchmark's scorer.

1. The fast dtype decodes every item (records under ``<runs>/fast-quality/``, resumed on a rerun).
2. The reference dtype does not decode what it would only repeat: one teacher-forced pass of its target over
   the prompt and the fast output finds the first position where its greedy token differs (or the end, where
   the fast run stopped on EOS, the reference's argmax must be an EOS too). Up to there the reference's greedy
   output *is* the fast output; from there it decodes greedily (``autoregressive(generated_prefix=...)``). An
   item the pass finds identical is the fast output, token for token. (What can make this differ from a full
   reference decode is the reference's own near-ties between a long pass and one-token steps; fp32 has none
   at the tiny pair's scale, and their count here is reported.)
3. Paired: accuracy of both, the exact one-sided bound on the drop (``workers.certify.decide.drop_bound``:
   the exact unconditional test inverted, valid at every n), items with identical outputs, and where the rest
   first differ. Writes ``quality.json``, ``quality.md`` and the per-item ``evidence.csv`` under ``--out``.

This is a description of the fast path, not a certificate of a rule: nothing is chosen with it.
"""

from __future__ import annotations

import argparse
import csv
import gc
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

from workers.benchmarks import get_benchmark
from workers.certify.decide import drop_bound
from workers.cli import one_line_errors
from workers.cpu_engine import SpecDecoder
from workers.evaluation import TARGET_ONLY, DecodeSpec, Record, evaluate_item
from workers.models.calibrate import machine_key
from workers.models.pair import dtype_tag, load_pair
from workers.prompts import encode_chat
from workers.results.quality import render
from workers.results.store import RecordStore, runs_root, slug, write_json, write_text


def _progress(label: str, done: int, total: int, t0: float, extra: str = "") -> None:
    rate = done / max(time.perf_counter() - t0, 1e-9)
    eta = (total - done) / rate if rate > 0 else math.nan
    print(f"[{label}] {done}/{total} items  {rate * 60:.1f} items/min  ETA {eta / 60:.1f} min  "
          f"load {os.getloadavg()[0]:.2f}{extra}", file=sys.stderr, flush=True)


def fast_records(args: argparse.Namespace, bench, items, spec: DecodeSpec, root: Path) -> dict[str, Record]:
    store = RecordStore(root / slug(f"{args.pair}-{args.fast}") / spec.key())
    held = store.load()
    todo = [it for it in items if it.id not in held]
    if todo:
        engine = SpecDecoder(load_pair(args.pair, dtype=args.fast))
        t0 = time.perf_counter()
        for i, item in enumerate(todo, 1):
            rec = evaluate_item(engine, bench, item, spec)
            store.append(rec)
            held[item.id] = rec
            _progress(f"{args.fast} target-only", i, len(todo), t0, f"  {rec.tokens_per_s:.1f} tok/s")
        del engine
        gc.collect()
    return held


@torch.inference_mode()
def reference_outputs(args: argparse.Namespace, bench, items, spec: DecodeSpec, fast: dict[str, Record],
                      root: Path) -> dict[str, dict]:
    path = root / slug(f"{args.pair}-{args.reference}-from-{args.fast}") / spec.key() / "items.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    held: dict[str, dict] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a torn last line: that item runs again
            held[row["item"]] = row
    todo = [it for it in items if it.id not in held and not fast[it.id].failed]
    if not todo:
        return held
    pair = load_pair(args.pair, dtype=args.reference)
    engine = SpecDecoder(pair)
    eos = set(pair.eos_token_ids)
    stop = list(bench.stop) or None
    t0 = time.perf_counter()
    with path.open("a") as out:
        for i, item in enumerate(todo, 1):
            rec = fast[item.id]
            ids = encode_chat(pair.tokenizer, bench.messages(item, shots=spec.shots), getattr(bench, "chat", None))
            tokens = list(rec.output_token_ids[0])
            finish = rec.finish_reasons[0]
            lm = engine.target
            lm.reuse(ids[:-1])
            if lm.length < len(ids) - 1:
                lm.forward(torch.tensor([ids[lm.length:len(ids) - 1]]))
            hidden = lm.forward(torch.tensor([[ids[-1], *tokens]]))
            argmax = lm.head(hidden)[0].argmax(dim=-1).tolist()  # row j predicts token j; row T the one after
            differ = next((j for j, t in enumerate(tokens) if argmax[j] != t), None)
            if differ is None and finish == "eos" and argmax[len(tokens)] not in eos:
                differ = len(tokens)  # the fast run stopped; the reference would not have
            if differ is None:
                row = {"item": item.id, "identical": True, "first_difference": None, "tokens": tokens,
                       "text": rec.outputs[0], "finish": finish, "decoded": 0}
            else:
                gen = engine.autoregressive(ids, max_new_tokens=spec.max_new_tokens, temperature=0.0, stop=stop,
                                            generated_prefix=tokens[:differ])
                row = {"item": item.id, "identical": gen.token_ids == tokens, "first_difference": differ,
                       "tokens": gen.token_ids, "text": gen.text or "", "finish": gen.finish_reason,
                       "decoded": len(gen.token_ids) - differ}
            row["score"] = float(bench.score(item, [row["text"]], reference_outputs=[row["text"]]).score)
            out.write(json.dumps(row) + "\n")
            out.flush()
            held[item.id] = row
            _progress(f"{args.reference} from {args.fast}", i, len(todo), t0,
                      f"  {'same' if row['identical'] else f'differs at {differ}'}")
    return held


def summarize(args: argparse.Namespace, items, fast: dict[str, Record], ref: dict[str, dict]) -> dict:
    keys = [it.id for it in items if it.id in ref and not fast[it.id].failed]
    ref_scores = [ref[k]["score"] for k in keys]
    fast_scores = [fast[k].score for k in keys]
    bound = drop_bound(ref_scores, fast_scores, args.alpha)
    identical = sum(ref[k]["identical"] for k in keys)
    firsts = [ref[k]["first_difference"] for k in keys if not ref[k]["identical"]
              and ref[k]["first_difference"] is not None]
    n = len(keys)
    return {
        "pair": args.pair, "benchmark": "gsm8k", "shots": args.shots, "max_new_tokens": args.max_new_tokens,
        "fast": dtype_tag(args.fast), "reference": dtype_tag(args.reference), "n": n,
        "failed_fast_items": sum(fast[it.id].failed for it in items if it.id in fast),
        "accuracy_reference": sum(ref_scores) / n if n else math.nan,
        "accuracy_fast": sum(fast_scores) / n if n else math.nan,
        "drop": bound.drop, "drop_upper_bound": bound.upper, "alpha": args.alpha, "test": bound.method,
        "lost": bound.losses, "won": bound.wins,
        "identical_outputs": identical,
        "first_difference_median": sorted(firsts)[len(firsts) // 2] if firsts else None,
        "tokens_decoded_by_reference": sum(ref[k]["decoded"] for k in keys),
        "tokens_total": sum(len(fast[k].output_token_ids[0]) for k in keys),
        "fast_tokens_per_s": (sum(fast[k].tokens for k in keys) / sum(fast[k].decode_time_s for k in keys)
                              if keys else math.nan),
        "machine": machine_key(), "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv),
    }


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", default="qwen2.5-coder-0.5b+1.5b", help="pair name or DRAFT+TARGET")
    ap.add_argument("--fast", default="int8", help="the fast dtype (int8)")
    ap.add_argument("--reference", default="fp32", help="the dtype it is judged against (fp32)")
    ap.add_argument("--items", type=int, default=200, help="GSM8K test items (the first N)")
    ap.add_argument("--shots", type=int, default=8, help="few-shot exemplars (0 or 8)")
    ap.add_argument("--max-new-tokens", type=int, default=256, help="tokens per answer")
    ap.add_argument("--alpha", type=float, default=0.05, help="level of the one-sided bound")
    ap.add_argument("--runs-root", default=None, help="where records live (default ./runs)")
    ap.add_argument("--out", default="runs/bench/fast-quality", help="where quality.json/.md and evidence.csv go")
    args = ap.parse_args(argv)
    if args.items < 1 or args.max_new_tokens < 1:
        ap.error("--items and --max-new-tokens must be >= 1")
    dtype_tag(args.fast), dtype_tag(args.reference)  # unknown dtypes fail here, before any model loads
    bench = get_benchmark("gsm8k")
    items = bench.items(limit=args.items)
    spec = DecodeSpec.make(TARGET_ONLY, temperature=0.0, seed=0, max_new_tokens=args.max_new_tokens,
                           shots=args.shots)
    root = runs_root(args.runs_root) / "fast-quality"
    fast = fast_records(args, bench, items, spec, root)
    ref = reference_outputs(args, bench, items, spec, fast, root)
    summary = summarize(args, items, fast, ref)
    out = Path(args.out)
    write_json(out / "quality.json", summary)
    write_text(out / "quality.md", render(summary))
    with (out / "evidence.csv").open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["item", f"score_{summary['reference']}", f"score_{summary['fast']}", "identical",
                         "first_difference", "tokens_fast", "tokens_reference"])
        for it in items:
            if it.id in ref and not fast[it.id].failed:
                r = ref[it.id]
                writer.writerow([it.id, r["score"], fast[it.id].score, int(r["identical"]), r["first_difference"],
                                 len(fast[it.id].output_token_ids[0]), len(r["tokens"])])
    print(render(summary))
    print(f"written: {out}/quality.json, quality.md, evidence.csv")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
