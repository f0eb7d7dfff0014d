"""The GPU check's correctness sections: exactness at T = 0, chi-square at T > 0, two processes bitwise, the
tiny pair end to end (``jobs.gpu_check`` runs them first; any failure is the exit code)."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import random
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from jobs.gpu.steps import (
    CHI2_P_MIN,
    DRAFT_LEN,
    FULL,
    SEED,
    SMALL,
    TEMPERATURES,
    Run,
    call_rule,
    fallbacks,
    rules,
    synthetic_step,
)

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
    # the repository root (jobs/gpu/correctness.py -> ..): `-m jobs.gpu_check` must import from a bare
    # checkout with no install of the project and PYTHONPATH unset, as on a fresh GPU box
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    procs = [subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
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
    from workers.models.tiny import tiny_random_pair
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
