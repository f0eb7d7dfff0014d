"""The GPU check: spectune's verify step on one device at vLLM's real shapes, without vLLM.

    python -m jobs.gpu_check [--device cuda|cpu] [--small] [--out DIR] [--budget-s 270]
        [--sections exactness,chi_square,determinism,tiny_pair,syncs,launches,memory,timing]

Everything runs through :func:`workers.vllm.step.decide_step`, the function the vLLM plugin calls per
verify step with vLLM's flat tensors (``[N, V]`` target logits, drafts concatenated over requests, a
host list of draft counts), with the draft distribution, the target's hidden states and LM head handed
over as the plugin does, so no rule times or checks the lossless fallback by accident. It needs torch
and transformers; no vLLM, no network, no weights (synthetic logits, the seeded tiny random pair).

Correctness (the exit code: 1 if any fails; they always run first and are never skipped):

- ``exactness``: lossless at T = 0 on bf16 logits full of exact ties (and on their fp32 upcast) equals
  vLLM's greedy rejection: accept drafts while draft = argmax, emit the argmax at the first mismatch,
  the bonus token after a full run, where argmax is the **first** maximal index (torch.argmax's
  documented rule, numpy's; computed on the host here). Ragged draft counts (0 included) and vLLM's
  ``-1`` placeholders are in the batch.
- ``chi_square``: at T = 0.7 the first emitted token of lossless, over many requests with one target
  row (V = 16) and drafts sampled from q, against softmax(target / T): Pearson's chi-square, fail if
  p < 1e-3. Twice: with the draft distribution, and without one (q one-hot at the draft).
- ``determinism``: two fresh processes run the same seeded steps (every rule, T = 0 and 0.7); the
  outputs' sha256 must agree bitwise.
- ``tiny_pair``: the tiny random pair on the device, drafted greedily and verified by lossless at
  T = 0 through ``decide_step``, emits the CPU engine's target-only greedy tokens
  (``SpecDecoder.autoregressive``); then every rule decides one real step of it (hidden states, LM head).
- ``rules_decide``: no rule fell back to lossless in any case of any section (a rule that raises on the
  device would otherwise hide behind the fallback).

Measurements (never fail the run; skipped with a note, recorded as skipped, once ``--budget-s`` is
spent): ``syncs`` (CUDA sync-debug warnings and HostSyncs' dispatch count per call), ``launches``
(profiler: device kernels and copies on CUDA, leaf aten ops on CPU), ``memory`` (peak allocated above
the inputs per call, CUDA only; DropMatch with bf16 heads [152064, 3584] and [128256, 8192]) and
``timing`` (median of timed calls against ``argmax`` over the same logits; CUDA events on CUDA; at T > 0
also with the fused statistics kernel forced on where it is off by default, as on CUDA: policies.fused).
Writes ``results.json`` and ``results.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from jobs.gpu.correctness import (
    check_chi_square,
    check_determinism,
    check_exactness,
    check_tiny_pair,
    determinism_hashes,
)
from jobs.gpu.measure import memory_cases, probe_cases, timing_cases
from jobs.gpu.steps import (
    CORRECTNESS,
    DRAFT_LEN,
    FULL,
    MEASUREMENTS,
    SECTIONS,
    SMALL,
    TEMPERATURES,
    Run,
    Shapes,
    rules,
)

# -- the report ----------------------------------------------------------------------------------------

def rules_decide(results: dict[str, Any]) -> dict[str, Any]:
    """Every case of every section that ran: did the rule itself decide (no lossless fallback)?"""
    fell = []
    for section in ("syncs", "launches", "memory", "timing"):
        for c in results.get(section, {}).get("cases", []):
            if c.get("fallback"):
                fell.append(f"{section}: {c['rule']} T={c['T']:g} B={c['B']} V={c['V']}: {c['fallback']}")
    for key, why in (results.get("determinism", {}).get("fallback") or {}).items():
        fell.append(f"determinism: {key}: {why}")
    for key, entry in (results.get("tiny_pair", {}).get("rules_on_pair") or {}).items():
        if entry["fallback"]:
            fell.append(f"tiny_pair: {key}: {entry['fallback']}")
    return {"fallbacks": fell, "passed": not fell}


def markdown(results: dict[str, Any]) -> str:
    meta = results["meta"]
    lines = [f"# GPU check: {meta['device_name']} ({'small' if meta['small'] else 'full'} shapes), "
             f"{meta['elapsed_s']:.0f} s", "", "| check | passed |", "|---|---|"]
    for name, entry in results["correctness"]["checks"].items():
        lines.append(f"| {name} | {entry} |")
    lines.append(f"| **all** | **{results['correctness']['passed']}** |")
    if "timing" in results:
        lines += ["", "| rule | T | B | V | median ms | min ms | argmax ms | x argmax | fused kernel ms |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for c in results["timing"]["cases"]:
            if c.get("skipped"):
                lines.append(f"| {c['rule']} | {c['T']:g} | {c['B']} | {c['V']} | skipped | | | | |")
            else:
                fused_ms = ("failed" if c.get("fused_failed") else f"{c['fused_median_ms']:.3f}") \
                    if "fused_median_ms" in c else "-"
                lines.append(f"| {c['rule']} | {c['T']:g} | {c['B']} | {c['V']} | {c['median_ms']:.3f} | "
                             f"{c['min_ms']:.3f} | {c['argmax_ms']:.3f} | {c['ratio']} | {fused_ms} |")
    probes = {(c["rule"], c["T"]): c for s in ("syncs", "launches") for c in results.get(s, {}).get("cases", [])
              if not c.get("skipped")}
    if probes:
        syncs = {(c["rule"], c["T"]): c for c in results.get("syncs", {}).get("cases", []) if not c.get("skipped")}
        launches = {(c["rule"], c["T"]): c for c in results.get("launches", {}).get("cases", [])
                    if not c.get("skipped")}
        b, v = meta["probe"]
        lines += ["", f"Per call at B={b}, V={v}, L={DRAFT_LEN}:", "",
                  "| rule | T | CUDA sync warnings | host syncs | of which host-to-device | launches |",
                  "|---|---:|---:|---:|---:|---:|"]
        for key in dict.fromkeys(k for k in probes):
            s, la = syncs.get(key, {}), launches.get(key, {})
            count = la.get("kernels", la.get("leaf_aten_ops", ""))
            h2d = s.get("host_syncs_by_kind", {}).get("h2d", 0) if s else ""
            lines.append(f"| {key[0]} | {key[1]:g} | {s.get('cuda_sync_warnings', '')} | {s.get('host_syncs', '')} "
                         f"| {h2d} "
                         f"| {count} |")
    if "memory" in results:
        lines += ["", "Peak device memory of one step above its inputs, against what the memory plan "
                  "(workers/vllm/memory.py) keeps outside both engines' shares for a rule:", "",
                  "| rule | T | B | head [V, d] bf16 | inputs MiB | peak extra MiB | plan MiB | within plan |",
                  "|---|---:|---:|---|---:|---:|---:|---|"]
        for c in results["memory"]["cases"]:
            lines.append(f"| {c['rule']} | {c['T']:g} | {c['B']} | {c['head']} | {c.get('inputs_mib', '')} | "
                         f"{c.get('peak_extra_mib', 'skipped')} | {c.get('plan_mib', '')} | "
                         f"{c.get('within_plan', '')} |")
    if results["skipped"]:
        lines += ["", f"Skipped: {len(results['skipped'])} cases ({results['skipped'][0]['reason']})."]
    return "\n".join(lines) + "\n"


def environment(device: torch.device, small: bool, budget_s: float, shapes: Shapes) -> dict[str, Any]:
    from importlib import metadata
    from importlib.util import find_spec

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    return {"device": str(device), "small": small, "budget_s": budget_s,
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "cuda": torch.version.cuda, "triton": version("triton"),
            "transformers": version("transformers"), "vllm_importable": find_spec("vllm") is not None,
            "shapes": {"B": list(shapes.batches), "V": list(shapes.vocabs), "L": DRAFT_LEN,
                       "hidden": {str(k): v for k, v in shapes.hidden.items()}},
            "probe": list(shapes.probe), "reps": shapes.reps, "warmup": shapes.warmup,
            "rules": [name for name, _ in rules()], "temperatures": list(TEMPERATURES)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="small shapes (B 2/8, V 1000/1024, hidden 64): the tests'")
    ap.add_argument("--out", type=Path, default=None, help="write results.json and results.md here")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="soft time budget: measurement cases past it are skipped and recorded (default 270; "
                         "120 with --small)")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list out of {','.join(SECTIONS)}")
    ap.add_argument("--determinism-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from workers.host_memory import keep_freed_memory

    keep_freed_memory()  # as in the engines: the host's full-vocabulary temporaries (CPU runs) reuse the heap
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    if args.determinism_child:
        print(json.dumps(determinism_hashes(device, args.small)))
        return 0
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        print(f"error: unknown section(s) {unknown}; valid: {', '.join(SECTIONS)}", file=sys.stderr)
        return 2
    shapes = SMALL if args.small else FULL
    budget = args.budget_s if args.budget_s is not None else (120.0 if args.small else 270.0)
    run = Run(device, shapes, budget, args.small)
    results: dict[str, Any] = {"meta": environment(device, args.small, budget, shapes)}
    run.log(f"device {results['meta']['device_name']}, torch {torch.__version__}, "
            f"{'small' if args.small else 'full'} shapes, budget {budget:g} s, sections {','.join(sections)}")
    checks = {"exactness": check_exactness, "chi_square": check_chi_square, "determinism": check_determinism,
              "tiny_pair": check_tiny_pair}
    measures = {"syncs": lambda r: probe_cases(r, "syncs"), "launches": lambda r: probe_cases(r, "launches"),
                "memory": memory_cases, "timing": timing_cases}
    for section in SECTIONS:  # correctness first: never cut by the budget
        if section not in sections:
            continue
        run.log(f"== {section}")
        try:
            results[section] = checks[section](run) if section in checks else {"cases": measures[section](run)}
        except Exception as err:  # noqa: BLE001 - one broken section must not hide the others' results
            run.log(f"{section} FAILED with {type(err).__name__}: {err}")
            results[section] = {"error": f"{type(err).__name__}: {err}", "passed": False, "cases": []}
    ran = [s for s in CORRECTNESS if s in sections]
    verdicts = {s: bool(results[s]["passed"]) for s in ran}
    if any(s in sections for s in ("syncs", "launches", "memory", "timing", "determinism", "tiny_pair")):
        results["rules_decide"] = rules_decide(results)
        verdicts["rules_decide"] = results["rules_decide"]["passed"]
        for line in results["rules_decide"]["fallbacks"][:10]:
            run.log(f"FALLBACK {line}")
    for s in MEASUREMENTS:  # a measurement that broke is reported loudly, but never fails the run
        if s in sections and "error" in results[s]:
            run.log(f"NOTE: measurement section {s} did not complete: {results[s]['error']}")
    results["correctness"] = {"checks": verdicts, "passed": all(verdicts.values()),
                              "failed": sorted(k for k, v in verdicts.items() if not v)}
    results["skipped"] = run.skipped
    results["meta"]["elapsed_s"] = round(run.elapsed(), 1)
    table = markdown(results)
    print("\n" + table, flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
        (args.out / "results.md").write_text(table)
        run.log(f"wrote {args.out / 'results.json'} and {args.out / 'results.md'}")
    ok = results["correctness"]["passed"]
    run.log("all correctness checks passed" if ok else f"FAILED: {', '.join(results['correctness']['failed'])}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
