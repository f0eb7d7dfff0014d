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
``timing`` (median of timed calls against ``argmax`` over the same logits; CUDA events on CUDA).
Writes ``results.json`` and ``results.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

CORRECTNESS = ("exactness", "chi_square", "determinism", "tiny_pair")
MEASUREMENTS = ("syncs", "launches", "memory", "timing")
SECTIONS = CORRECTNESS + MEASUREMENTS
TEMPERATURES = (0.0, 0.7)
DRAFT_LEN = 5
CHI2_P_MIN = 1e-3
SEED = 1234


@dataclass(frozen=True)
class Shapes:
    batches: tuple[int, ...]
    vocabs: tuple[int, ...]  # each with the hidden size of a real target with that vocabulary
    hidden: dict[int, int]
    probe: tuple[int, int]  # (B, V) of the syncs/launches/determinism cases
    memory_heads: tuple[tuple[int, int], ...]  # DropMatch LM heads [V, d] for the memory section
    exact_batch: int
    chi2_rows: int
    pair_tokens: int
    warmup: int
    reps: int


FULL = Shapes(batches=(64, 256, 1024), vocabs=(151_936, 152_064), hidden={151_936: 1536, 152_064: 3584},
              probe=(64, 151_936), memory_heads=((152_064, 3584), (128_256, 8192)), exact_batch=256,
              chi2_rows=200_000, pair_tokens=48, warmup=2, reps=10)
SMALL = Shapes(batches=(2, 8), vocabs=(1000, 1024), hidden={1000: 64, 1024: 64}, probe=(8, 1000),
               memory_heads=((1024, 64), (1000, 128)), exact_batch=64, chi2_rows=20_000, pair_tokens=24,
               warmup=1, reps=3)


def rules() -> list[tuple[str, dict[str, Any]]]:
    """Every registered rule with its registry example parameters (lossless first)."""
    from policies import POLICIES, get_spec

    names = sorted(POLICIES, key=lambda n: (n != "lossless", n))
    return [(name, dict(get_spec(name).example)) for name in names]


# -- synthetic steps in vLLM's flat layout ---------------------------------------------------------------

@dataclass
class Step:
    """One verify step as the plugin hands it to decide_step (flat rows, request-major)."""

    draft_token_ids: torch.Tensor  # [N] int32
    num_draft_tokens: list[int]
    target_logits: torch.Tensor  # [N, V] fp32 (vLLM's sampler works in fp32)
    draft_logits: torch.Tensor  # [N, V] fp32
    bonus_token_ids: torch.Tensor  # [B, 1] int32
    hidden: torch.Tensor  # [N, d] in the head's dtype
    weight: torch.Tensor  # [V, d]
    as_handed: dict[float, torch.Tensor] = field(default_factory=dict)  # plugin_draft's, made once per T

    def plugin_draft(self, temperature: float) -> torch.Tensor:
        """The draft's logits as the plugin hands them to decide_step (``draft_scaled``): divided by T (by 1
        at T = 0), in bf16 on a GPU as a bf16 drafter's are (fp32 on CPU, where the pair runs in fp32). Made
        once per temperature, outside any timing: the drafter makes them, not the verify step."""
        if temperature not in self.as_handed:
            dtype = torch.bfloat16 if self.draft_logits.is_cuda else self.draft_logits.dtype
            self.as_handed[temperature] = (self.draft_logits / (temperature or 1.0)).to(dtype)
        return self.as_handed[temperature]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.draft_token_ids, self.target_logits,
                                                            self.draft_logits, self.bonus_token_ids,
                                                            self.hidden, self.weight))


def synthetic_step(b: int, vocab: int, hidden_size: int, device: torch.device, seed: int = SEED,
                   draft_len: int = DRAFT_LEN, head_dtype: torch.dtype = torch.bfloat16) -> Step:
    """jobs.bench.rules.synthetic_windows' recipe built on the device at any shape: target logits are
    the hidden states through a random LM head (so DropMatch's heads reproduce them), the draft's are
    the target's plus unit noise, drafts are the draft's argmax (some accepted, some not)."""
    g = torch.Generator(device=device).manual_seed(seed)
    n = b * draft_len
    std = 0.035 * (1536 / hidden_size) ** 0.5  # logit scale independent of d (~2.7, as in the bench)
    weight = (torch.randn(vocab, hidden_size, generator=g, device=device) * std).to(head_dtype)
    hidden = (torch.randn(n, hidden_size, generator=g, device=device) * 2.0).to(head_dtype)
    target = (hidden @ weight.T).float()
    draft = torch.randn(n, vocab, generator=g, device=device).add_(target)
    drafts = draft.argmax(dim=-1).to(torch.int32)
    bonus = torch.randint(0, vocab, (b, 1), generator=g, device=device, dtype=torch.int32)
    return Step(drafts, [draft_len] * b, target, draft, bonus, hidden, weight)


def call_rule(policy: Any, step: Step, temperature: float, seed: int = 0, call: int = 0) -> Any:
    """decide_step as workers.vllm.plugin.apply_rule calls it (one rule for the step)."""
    from workers.vllm.step import decide_step

    b = len(step.num_draft_tokens)
    return decide_step(policy, draft_token_ids=step.draft_token_ids, num_draft_tokens=step.num_draft_tokens,
                       max_spec_len=max(step.num_draft_tokens, default=0), target_logits=step.target_logits,
                       bonus_token_ids=step.bonus_token_ids, temperatures=[temperature] * b,
                       draft_logits=step.plugin_draft(temperature), draft_scaled=True, target_hidden=step.hidden,
                       lm_head=lambda: (step.weight, None), seed=seed, step=call)


def fallbacks(outcome: Any) -> list[str]:
    return sorted({r for r in outcome.fallback if r is not None})


# -- bookkeeping --------------------------------------------------------------------------------------

class Run:
    def __init__(self, device: torch.device, shapes: Shapes, budget_s: float, small: bool) -> None:
        self.device, self.shapes, self.budget_s, self.small = device, shapes, budget_s, small
        self.t0 = time.perf_counter()
        self.skipped: list[dict[str, Any]] = []

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def log(self, msg: str) -> None:
        print(f"[{self.elapsed():7.1f}s] {msg}", flush=True)

    def over_budget(self, section: str, case: dict[str, Any]) -> bool:
        if self.elapsed() <= self.budget_s:
            return False
        reason = f"time budget {self.budget_s:g} s spent ({self.elapsed():.0f} s elapsed)"
        if not any(s["section"] == section for s in self.skipped):
            self.log(f"NOTE: {section}: {reason}; skipping its remaining cases (recorded as skipped)")
        case.update(skipped=True, reason=reason)
        self.skipped.append({"section": section, **{k: v for k, v in case.items() if k != "skipped"}})
        return True

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def free(self) -> None:
        if self.cuda:
            torch.cuda.empty_cache()


def timed_ms(run: Run, fn: Callable[[], object]) -> tuple[float, float]:
    """(median, min) milliseconds of ``reps`` calls after ``warmup``; CUDA events on CUDA."""
    for _ in range(run.shapes.warmup):
        fn()
    run.sync()
    times = []
    for _ in range(run.shapes.reps):
        if run.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), min(times)


# -- correctness: exactness at T = 0 ------------------------------------------------------------------

def vllm_greedy_reference(draft: np.ndarray, nums: list[int], logits_f32: np.ndarray, bonus: np.ndarray,
                          max_len: int) -> np.ndarray:
    """vLLM's greedy rejection, on the host: accept while draft == argmax (first maximal index), emit the
    argmax at the first mismatch or the bonus after a full run; -1 after."""
    argmax = logits_f32.argmax(axis=-1)  # numpy: the first occurrence of the maximum
    out = np.full((len(nums), max_len + 1), -1, dtype=np.int64)
    offset = 0
    for i, n in enumerate(nums):
        k = 0
        while k < n and int(draft[offset + k]) == int(argmax[offset + k]):
            out[i, k] = draft[offset + k]
            k += 1
        out[i, k] = int(argmax[offset + k]) if k < n else int(bonus[i])
        offset += n
    return out


def tied_greedy_step(b: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, list[int], torch.Tensor,
                                                                dict[str, int]]:
    """(bf16 logits [N, V], drafts [N] int32, counts, bonus [B, 1], coverage) built on the host. Most
    rows carry 2-4 exact ties at the top; drafts are the first tied index (accept), a later tied index
    (must be rejected: vLLM's argmax takes the first), a random token, or vLLM's -1 placeholder."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    nums = [rng.choice([0, 1, 3, DRAFT_LEN, DRAFT_LEN, DRAFT_LEN, DRAFT_LEN]) for _ in range(b)]
    n = sum(nums)
    logits = (torch.randn(n, vocab, generator=g) * 2.0).to(torch.bfloat16)
    tied_rows = later_tie_drafts = placeholders = 0
    ties: list[list[int]] = []
    for r in range(n):
        if rng.random() < 0.8:
            idx = sorted(rng.sample(range(vocab), rng.randint(2, 4)))
            top = float(logits[r].float().max())
            logits[r, idx] = torch.tensor(top + 0.5).to(torch.bfloat16)  # one bf16 value: an exact tie
            tied_rows += 1
        row = logits[r].float()
        ties.append(torch.nonzero(row == row.max()).flatten().tolist())
    drafts = torch.empty(n, dtype=torch.int32)
    for r in range(n):
        u = rng.random()
        if u < 0.7:
            d = ties[r][0]
        elif u < 0.85 and len(ties[r]) > 1:
            d = rng.choice(ties[r][1:])
            later_tie_drafts += 1
        elif u < 0.95:
            d = rng.randrange(vocab)
        else:
            d = -1
            placeholders += 1
        drafts[r] = d
    bonus = torch.randint(0, vocab, (b, 1), generator=g, dtype=torch.int32)
    coverage = {"requests": b, "rows": n, "rows_with_injected_ties": tied_rows,
                "rows_with_any_tie": sum(len(t) > 1 for t in ties), "drafts_at_a_later_tie": later_tie_drafts,
                "placeholder_drafts": placeholders, "requests_without_drafts": nums.count(0)}
    return logits, drafts, nums, bonus, coverage


def check_exactness(run: Run) -> dict[str, Any]:
    from policies import make_policy
    from workers.vllm.step import decide_step

    policy = make_policy("lossless")
    checks = []
    for i, vocab in enumerate(run.shapes.vocabs):
        logits, drafts, nums, bonus, coverage = tied_greedy_step(run.shapes.exact_batch, vocab, SEED + i)
        expected = vllm_greedy_reference(drafts.numpy(), nums, logits.float().numpy(), bonus.numpy().ravel(),
                                         DRAFT_LEN)
        for dtype in (torch.bfloat16, torch.float32):
            outcome = decide_step(policy, draft_token_ids=drafts.to(run.device), num_draft_tokens=nums,
                                  max_spec_len=DRAFT_LEN, target_logits=logits.to(run.device, dtype),
                                  bonus_token_ids=bonus.to(run.device), temperatures=[0.0] * len(nums))
            got = outcome.output_token_ids.cpu().long().numpy()
            wrong = [int(r) for r in np.nonzero((got != expected).any(axis=1))[0]]
            full = sum(int((expected[j, :n] >= 0).all()) for j, n in enumerate(nums) if n > 0)
            checks.append({"vocab": vocab, "dtype": str(dtype).removeprefix("torch."), **coverage,
                           "full_acceptances": full, "mismatched_requests": len(wrong),
                           "first_mismatches": [{"request": r, "expected": expected[r].tolist(),
                                                 "got": got[r].tolist()} for r in wrong[:3]],
                           "fallback": fallbacks(outcome), "passed": not wrong and not fallbacks(outcome)})
            run.log(f"exactness V={vocab} {checks[-1]['dtype']}: {len(wrong)} of {len(nums)} requests differ "
                    f"({coverage['rows_with_any_tie']} tied rows, {coverage['drafts_at_a_later_tie']} drafts "
                    f"at a later tie)")
    return {"definition": "T = 0: accept drafts while draft == argmax, argmax = first maximal index "
                          "(torch.argmax / numpy rule, on the host); emit argmax at the first mismatch, the "
                          "bonus token after a full run; -1 after",
            "checks": checks, "passed": all(c["passed"] for c in checks)}


# -- correctness: chi-square at T > 0 -----------------------------------------------------------------

def chi_square_p(observed: np.ndarray, expected: np.ndarray) -> tuple[float, int, float]:
    """(statistic, degrees of freedom, p) of Pearson's test; bins expecting < 5 are pooled."""
    order = np.argsort(expected)
    obs, exp = observed[order].astype(np.float64), expected[order].astype(np.float64)
    small = np.cumsum(exp) < 5.0
    if small.any():
        k = int(small.sum()) + 1
        obs = np.concatenate([[obs[:k].sum()], obs[k:]])
        exp = np.concatenate([[exp[:k].sum()], exp[k:]])
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = len(exp) - 1
    p = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                      torch.tensor(stat / 2, dtype=torch.float64)))
    return stat, df, p


def check_chi_square(run: Run, temperature: float = 0.7, vocab: int = 16, draft_len: int = 2) -> dict[str, Any]:
    from policies import make_policy
    from workers.vllm.step import decide_step

    policy = make_policy("lossless")
    g = torch.Generator().manual_seed(SEED)
    base_t = torch.randn(vocab, generator=g, dtype=torch.float64) * 1.5
    base_q = base_t + torch.randn(vocab, generator=g, dtype=torch.float64) * 1.5
    p = torch.softmax(base_t / temperature, dim=0).numpy()
    q = torch.softmax(base_q / temperature, dim=0)
    rows = run.shapes.chi2_rows
    n = rows * draft_len
    drafts = torch.multinomial(q.float(), n, replacement=True, generator=g).to(torch.int32)
    bonus = torch.randint(0, vocab, (rows, 1), generator=g, dtype=torch.int32)
    target = base_t.float().expand(n, vocab).contiguous()
    cases = []
    for label, draft_logits in (("with draft distribution", base_q.float().expand(n, vocab).contiguous()),
                                ("without (q one-hot)", None)):
        outcome = decide_step(policy, draft_token_ids=drafts.to(run.device), num_draft_tokens=[draft_len] * rows,
                              max_spec_len=draft_len, target_logits=target.to(run.device),
                              bonus_token_ids=bonus.to(run.device), temperatures=[temperature] * rows,
                              draft_logits=None if draft_logits is None else draft_logits.to(run.device),
                              seed=SEED)
        first = outcome.output_token_ids[:, 0].long().cpu().numpy()
        observed = np.bincount(first[first >= 0], minlength=vocab)[:vocab]
        stat, df, pval = chi_square_p(observed, p * rows)
        accepted = float((outcome.output_token_ids[:, 0].cpu() == drafts.view(rows, draft_len)[:, 0]).float().mean())
        cases.append({"q": label, "rows": rows, "vocab": vocab, "temperature": temperature, "statistic": stat,
                      "df": df, "p": pval, "first_token_is_draft": accepted, "fallback": fallbacks(outcome),
                      "passed": pval >= CHI2_P_MIN and not fallbacks(outcome) and int((first < 0).sum()) == 0})
        run.log(f"chi-square {label}: chi2={stat:.1f} df={df} p={pval:.3g} ({rows} rows)")
    return {"threshold_p": CHI2_P_MIN, "cases": cases, "passed": all(c["passed"] for c in cases)}


# -- correctness: two processes, bitwise ----------------------------------------------------------------

def determinism_hashes(device: torch.device, small: bool) -> dict[str, Any]:
    """The child's work: every rule x T on one seeded step; sha256 of inputs and outputs."""
    from policies import make_policy

    shapes = SMALL if small else FULL
    b, vocab = shapes.probe
    step = synthetic_step(b, vocab, shapes.hidden[vocab], device, seed=SEED + 7)
    digest = hashlib.sha256()
    for t in (step.draft_token_ids, step.target_logits, step.draft_logits, step.hidden, step.weight):
        t = t.detach().cpu().contiguous()
        digest.update((t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes())
    out: dict[str, Any] = {"inputs": digest.hexdigest()[:16], "outputs": {}, "fallback": {}}
    for name, params in rules():
        for t in TEMPERATURES:
            outcome = call_rule(make_policy(name, **params), step, t, seed=SEED, call=3)
            key = f"{name} T={t:g}"
            out["outputs"][key] = hashlib.sha256(outcome.output_token_ids.cpu().numpy().tobytes()).hexdigest()[:16]
            if fallbacks(outcome):
                out["fallback"][key] = fallbacks(outcome)
    return out


def check_determinism(run: Run) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "jobs.gpu_check", "--determinism-child", "--device", str(run.device)]
    cmd += ["--small"] if run.small else []
    root = Path(__file__).resolve().parents[1]
    procs = [subprocess.Popen(cmd, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    children = []
    for proc in procs:
        try:
            stdout, stderr = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        try:
            children.append(json.loads(stdout.strip().splitlines()[-1]))
        except (json.JSONDecodeError, IndexError):
            children.append({"error": f"rc {proc.returncode}: {stderr.strip()[-800:]}"})
    a, b = children
    errors = [c["error"] for c in children if "error" in c]
    differ = [] if errors else sorted(k for k in set(a["outputs"]) | set(b["outputs"])
                                      if a["outputs"].get(k) != b["outputs"].get(k))
    passed = not errors and not differ and a["inputs"] == b["inputs"] and len(a["outputs"]) == 2 * len(rules())
    run.log(f"determinism: {len(a.get('outputs', {}))} rule x T outputs per process, "
            f"{len(differ)} differ" + "".join(f"; child failed: {e.splitlines()[-1]}" for e in errors))
    return {"shape": {"B": run.shapes.probe[0], "V": run.shapes.probe[1], "L": DRAFT_LEN},
            "inputs_equal": not errors and a["inputs"] == b["inputs"], "differ": differ, "errors": errors,
            "hashes": None if errors else a["outputs"], "fallback": {} if errors else a["fallback"],
            "passed": passed}


# -- correctness: the tiny pair end to end -------------------------------------------------------------

def check_tiny_pair(run: Run, prompt: str = "def fibonacci(n):") -> dict[str, Any]:
    from policies import make_policy
    from workers.cpu_engine import SpecDecoder
    from workers.models.pair import tiny_random_pair
    from workers.vllm.step import decide_step

    max_new = run.shapes.pair_tokens
    # no end-of-sequence stop: the random pair emits one early, and the check wants max_new tokens
    cpu_pair = replace(tiny_random_pair(torch.float32, seed=0), eos_token_ids=())
    ids = cpu_pair.tokenizer.encode(prompt)
    reference = SpecDecoder(cpu_pair).autoregressive(ids, max_new_tokens=max_new, temperature=0.0).token_ids
    target, draft = copy.deepcopy(cpu_pair.target).to(run.device), copy.deepcopy(cpu_pair.draft).to(run.device)
    decoder, head = target.get_decoder(), target.get_output_embeddings()
    lossless = make_policy("lossless")
    tokens, generated, steps, accepted, loop_fallbacks = list(ids), [], 0, 0, set()
    last: dict[str, Any] = {}
    with torch.inference_mode():
        while len(generated) < max_new:
            seq = list(tokens)
            draft_rows = []
            for _ in range(DRAFT_LEN):
                row = draft(torch.tensor([seq], device=run.device)).logits[0, -1].float()
                draft_rows.append(row)
                seq.append(int(row.argmax()))
            hidden = decoder(torch.tensor([seq], device=run.device)).last_hidden_state[0, len(tokens) - 1:]
            logits = head(hidden).float()  # [L + 1, V]
            last = dict(draft_token_ids=torch.tensor(seq[len(tokens):], dtype=torch.int32, device=run.device),
                        num_draft_tokens=[DRAFT_LEN], max_spec_len=DRAFT_LEN, target_logits=logits[:DRAFT_LEN],
                        bonus_token_ids=logits[DRAFT_LEN].argmax().view(1, 1).to(torch.int32),
                        draft_logits=torch.stack(draft_rows), target_hidden=hidden[:DRAFT_LEN])
            outcome = decide_step(lossless, temperatures=[0.0], **last)
            loop_fallbacks.update(fallbacks(outcome))  # lossless must decide itself, not the greedy last resort
            emitted = [t for t in outcome.output_token_ids[0].tolist() if t >= 0]
            accepted += len(emitted) - 1
            generated += emitted
            tokens += emitted
            steps += 1
        equal = generated[:len(reference)] == reference
        divergence = None
        if not equal:  # how close to a tie was the reference there (device vs CPU numerics, or a real bug)?
            j = next(i for i, (a, b) in enumerate(zip(generated, reference, strict=False)) if a != b)
            ref_logits = cpu_pair.target(torch.tensor([ids + reference[:j]])).logits[0, -1].float()
            top2 = ref_logits.topk(2).values
            divergence = {"index": j, "speculative": generated[j], "reference": reference[j],
                          "reference_top2_margin": float(top2[0] - top2[1])}
        rules_on_pair = {}
        for name, params in rules():
            for t in TEMPERATURES:
                outcome = decide_step(make_policy(name, **params), temperatures=[t], seed=SEED,
                                      lm_head=lambda: (head.weight, head.bias), **last)
                rules_on_pair[f"{name} T={t:g}"] = {"output": outcome.output_token_ids[0].tolist(),
                                                    "fallback": fallbacks(outcome)}
    run.log(f"tiny pair: {steps} verify steps, {accepted} drafts accepted, {len(reference)} reference tokens, "
            f"{'equal' if equal else 'DIFFERENT'}")
    return {"prompt": prompt, "steps": steps, "accepted_drafts": accepted, "reference": reference,
            "speculative": generated[:len(reference)], "equal": equal, "first_divergence": divergence,
            "fallback": sorted(loop_fallbacks),
            "rules_on_pair": rules_on_pair, "passed": equal and len(reference) == max_new and not loop_fallbacks}


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
        todo = rules() if i == 0 else [(n, p) for n, p in rules() if n == "dropmatch"]
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
                if not run.cuda:
                    case["peak_extra_mib"] = "n/a"
                    continue
                run.sync()
                torch.cuda.reset_peak_memory_stats(run.device)
                base = torch.cuda.memory_allocated(run.device)
                call_rule(policy, step, t, seed=SEED)
                run.sync()
                case["peak_extra_mib"] = round((torch.cuda.max_memory_allocated(run.device) - base) / 2**20, 1)
            run.log(f"memory: {name} head [{vocab}, {d}] B={b}: "
                    + ", ".join(f"T={c['T']:g} {c.get('peak_extra_mib', 'skipped')}" for c in cases[-2:]))
        del step
        run.free()
    return cases


def timing_cases(run: Run) -> list[dict[str, Any]]:
    from policies import make_policy

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
            done = [c for c in cases[-2 * len(rules()):] if "median_ms" in c]
            if done:
                run.log(f"timing B={b} V={vocab}: argmax {argmax_ms:.3f} ms; "
                        + ", ".join(f"{c['rule']}@{c['T']:g} {c['median_ms']:.2f}" for c in done))
            del step
            run.free()
    return cases


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
        lines += ["", "| rule | T | B | V | median ms | min ms | argmax ms | x argmax |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for c in results["timing"]["cases"]:
            if c.get("skipped"):
                lines.append(f"| {c['rule']} | {c['T']:g} | {c['B']} | {c['V']} | skipped | | | |")
            else:
                lines.append(f"| {c['rule']} | {c['T']:g} | {c['B']} | {c['V']} | {c['median_ms']:.3f} | "
                             f"{c['min_ms']:.3f} | {c['argmax_ms']:.3f} | {c['ratio']} |")
    probes = {(c["rule"], c["T"]): c for s in ("syncs", "launches") for c in results.get(s, {}).get("cases", [])
              if not c.get("skipped")}
    if probes:
        syncs = {(c["rule"], c["T"]): c for c in results.get("syncs", {}).get("cases", []) if not c.get("skipped")}
        launches = {(c["rule"], c["T"]): c for c in results.get("launches", {}).get("cases", [])
                    if not c.get("skipped")}
        b, v = meta["probe"]
        lines += ["", f"Per call at B={b}, V={v}, L={DRAFT_LEN}:", "",
                  "| rule | T | CUDA sync warnings | host syncs | launches |", "|---|---:|---:|---:|---:|"]
        for key in dict.fromkeys(k for k in probes):
            s, la = syncs.get(key, {}), launches.get(key, {})
            count = la.get("kernels", la.get("leaf_aten_ops", ""))
            lines.append(f"| {key[0]} | {key[1]:g} | {s.get('cuda_sync_warnings', '')} | {s.get('host_syncs', '')} "
                         f"| {count} |")
    if "memory" in results:
        lines += ["", "| rule | T | B | head [V, d] bf16 | inputs MiB | peak extra MiB |", "|---|---:|---:|---|---:|---:|"]
        for c in results["memory"]["cases"]:
            lines.append(f"| {c['rule']} | {c['T']:g} | {c['B']} | {c['head']} | {c.get('inputs_mib', '')} | "
                         f"{c.get('peak_extra_mib', 'skipped')} |")
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
