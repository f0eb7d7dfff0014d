"""The GPU check's shapes, its synthetic verify steps in vLLM's flat layout, the rule call as the plugin makes
it, and the run's bookkeeping (device, budget, timing)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

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


def call_rule(policy: Any, step: Step, temperature: float, seed: int = 0, call: int = 0,
              per_request: bool = False) -> Any:
    """decide_step as workers.vllm.plugin.apply_rule calls it: one rule for the step, or (``per_request``)
    every request carrying its own copy of the rule and its own seed, as per-request rules in vLLM do."""
    from workers.vllm.step import decide_step

    b = len(step.num_draft_tokens)
    own = dict(policies=[policy] * b, keys=["own"] * b, request_seeds=list(range(1, b + 1))) if per_request else {}
    return decide_step(policy, draft_token_ids=step.draft_token_ids, num_draft_tokens=step.num_draft_tokens,
                       max_spec_len=max(step.num_draft_tokens, default=0), target_logits=step.target_logits,
                       bonus_token_ids=step.bonus_token_ids, temperatures=[temperature] * b,
                       draft_logits=step.plugin_draft(temperature), draft_scaled=True, target_hidden=step.hidden,
                       lm_head=lambda: (step.weight, None), seed=seed, step=call, **own)


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
