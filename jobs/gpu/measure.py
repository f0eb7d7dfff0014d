"""The GPU check's measurements: host syncs, launches, peak memory, timing against argmax (never fail the run)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from jobs.gpu.steps import (
    DRAFT_LEN,
    SEED,
    TEMPERATURES,
    Run,
    call_rule,
    fallbacks,
    rules,
    synthetic_step,
    timed_ms,
)
from workers.vllm.memory import PLAN_DROPMATCH_K, rule_working_bytes

EXACT_HEADS = ("dropmatch", {"mode": "exact", "k": 16, "criterion": "js"})

# -- measurements -------------------------------------------------------------------------------------

def count_syncs(run: Run, fn: Callable[[], Any]) -> tuple[int | str, dict[str, int]]:
    """(CUDA sync-debug warnings or "n/a", HostSyncs' counts by kind) for one call."""
    from workers.vllm.host_syncs import HostSyncs

    with HostSyncs() as syncs:
        fn()
    by_kind = dict(syncs.by_kind)
    if not run.cuda:
        return "n/a", by_kind
    run.sync()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught), by_kind


def count_launches(run: Run, fn: Callable[[], Any]) -> dict[str, int]:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if run.cuda else [])
    with profile(activities=activities) as prof:
        fn()
        run.sync()
    events = list(prof.events())
    if run.cuda:
        device = [e for e in events if e.device_type == DeviceType.CUDA]
        copies = [e for e in device if e.name.startswith(("Memcpy", "Memset"))]
        api = [e for e in events if e.device_type == DeviceType.CPU and "LaunchKernel" in e.name]
        return {"kernels": len(device) - len(copies), "copies": len(copies), "launch_calls": len(api)}
    aten = [e for e in events if e.name.startswith("aten::")]
    leaves = [e for e in aten if not any(c.name.startswith("aten::") for c in e.cpu_children)]
    return {"aten_ops": len(aten), "leaf_aten_ops": len(leaves)}


def probe_cases(run: Run, section: str) -> list[dict[str, Any]]:
    from policies import make_policy

    b, vocab = run.shapes.probe
    step = synthetic_step(b, vocab, run.shapes.hidden[vocab], run.device)
    cases = []
    for name, params in rules():
        for t in TEMPERATURES:
            case: dict[str, Any] = {"rule": name, "params": params, "T": t, "B": b, "V": vocab, "L": DRAFT_LEN}
            cases.append(case)
            if run.over_budget(section, case):
                continue
            policy = make_policy(name, **params)
            holder: dict[str, Any] = {}

            def fn(p=policy, t=t, s=step, holder=holder):
                holder["outcome"] = call_rule(p, s, t, seed=SEED)

            fn()  # warm-up: lazy inits are not the step's
            run.sync()
            if section == "syncs":
                case["cuda_sync_warnings"], case["host_syncs_by_kind"] = count_syncs(run, fn)
                case["host_syncs"] = sum(case["host_syncs_by_kind"].values())
            else:
                case.update(count_launches(run, fn))
            case["fallback"] = fallbacks(holder["outcome"])
        run.log(f"{section}: {name} done")
    del step
    run.free()
    return cases


def memory_cases(run: Run) -> list[dict[str, Any]]:
    from policies import make_policy

    b = max(run.shapes.batches)
    cases = []
    for i, (vocab, d) in enumerate(run.shapes.memory_heads):
        # DropMatch's exact mode (K full-vocabulary heads) at the search's largest K: its heaviest memory case
        todo = [*(rules() if i == 0 else [(n, p) for n, p in rules() if n == "dropmatch"]), EXACT_HEADS]
        step = None
        for name, params in todo:
            for t in TEMPERATURES:
                case: dict[str, Any] = {"rule": name, "params": params, "T": t, "B": b, "V": vocab, "L": DRAFT_LEN,
                                        "head": [vocab, d], "head_dtype": "bfloat16"}
                cases.append(case)
                if run.over_budget("memory", case):
                    continue
                if step is None:
                    step = synthetic_step(b, vocab, d, run.device)
                policy = make_policy(name, **params)
                outcome = call_rule(policy, step, t, seed=SEED)  # warm-up
                case["fallback"] = fallbacks(outcome)
                case["inputs_mib"] = round(step.nbytes() / 2**20, 1)
                # what workers/vllm/memory.py keeps outside both engines' shares for a rule (the plan reserves
                # for PLAN_DROPMATCH_K heads whatever rule runs): the device's peak must stay under it
                case["plan_mib"] = round(rule_working_bytes(vocab, b * DRAFT_LEN, PLAN_DROPMATCH_K) / 2**20, 1)
                if not run.cuda:
                    case["peak_extra_mib"] = case["within_plan"] = "n/a"
                    continue
                run.sync()
                torch.cuda.reset_peak_memory_stats(run.device)
                base = torch.cuda.memory_allocated(run.device)
                call_rule(policy, step, t, seed=SEED)
                run.sync()
                case["peak_extra_mib"] = round((torch.cuda.max_memory_allocated(run.device) - base) / 2**20, 1)
                case["within_plan"] = case["peak_extra_mib"] <= case["plan_mib"]
            run.log(f"memory: {name} head [{vocab}, {d}] B={b}: "
                    + ", ".join(f"T={c['T']:g} {c.get('peak_extra_mib', 'skipped')}" for c in cases[-2:]))
        del step
        run.free()
    return cases


def timing_cases(run: Run) -> list[dict[str, Any]]:
    from policies import fused, make_policy

    cases = []
    for b in run.shapes.batches:  # smallest batch first: a spent budget cuts the biggest shapes
        for vocab in run.shapes.vocabs:
            step = None
            argmax_ms = None
            for name, params in rules():
                for t in TEMPERATURES:
                    case: dict[str, Any] = {"rule": name, "params": params, "T": t, "B": b, "V": vocab, "L": DRAFT_LEN}
                    cases.append(case)
                    if run.over_budget("timing", case):
                        continue
                    if step is None:
                        step = synthetic_step(b, vocab, run.shapes.hidden[vocab], run.device)
                        argmax_ms = timed_ms(run, lambda s=step: s.target_logits.argmax(dim=-1))[0]
                    policy = make_policy(name, **params)
                    holder: dict[str, Any] = {}

                    def fn(p=policy, t=t, s=step, holder=holder):
                        holder["outcome"] = call_rule(p, s, t, seed=SEED)

                    med, low = timed_ms(run, fn)
                    case.update(median_ms=round(med, 3), min_ms=round(low, 3), argmax_ms=round(argmax_ms, 3),
                                ratio=round(med / argmax_ms, 2) if argmax_ms else None,
                                reps=run.shapes.reps, fallback=fallbacks(holder["outcome"]))
                    if t > 0 and not fused.enabled(step.target_logits):
                        # the fused statistics kernel (policies.fused), off by default here, timed beside:
                        # what SPECTUNE_FUSED=1 would give on this device (its compilation in the warm-up)
                        with fused.forced("1"):
                            fmed, _ = timed_ms(run, fn)
                        case.update(fused_median_ms=round(fmed, 3), fused_failed=fused.failure())
            done = [c for c in cases[-2 * len(rules()):] if "median_ms" in c]
            if done:
                run.log(f"timing B={b} V={vocab}: argmax {argmax_ms:.3f} ms; "
                        + ", ".join(f"{c['rule']}@{c['T']:g} {c['median_ms']:.2f}" for c in done))
            del step
            run.free()
    return cases
