"""Rank-based baselines: Judge Decoding's Top-K and TensorRT-LLM's relaxed top-n acceptance.

Rank of d = number of tokens whose target logit is strictly larger than d's, so ``d in top-k``
is ``rank < k`` — one comparison pass, no sort.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from policies.core import Decision, PolicyConfig, SearchRange, Valid, VerifyBatch, knob
from policies.distributions import gather_last
from policies.lossless import lossless_accept, with_lossless
from policies.registry import Leniency, register


def target_rank(target: Tensor, draft_ids: Tensor) -> Tensor:
    """[B, L, V] x [B, L] -> [B, L] long: 0 for the argmax; V for a token the target's distribution excludes (a
    -inf logit: outside a top-k / top-p truncation), which no bound min(k, V) admits."""
    at = gather_last(target, draft_ids)
    rank = (target > at.unsqueeze(-1)).sum(dim=-1)
    return torch.where(torch.isneginf(at), target.shape[-1], rank)


@dataclass(frozen=True)
class TopKConfig(PolicyConfig):
    k: int = knob(4, valid=Valid(low=1), search=SearchRange(2, 64, log=True, integer=True), doc="accept d in top-k(p_t)")


@register(
    "top_k",
    config=TopKConfig,
    off={"k": 1},
    off_exact_when_sampling=False,
    leniency=Leniency("k", (1, 2, 4, 16, 64)),
)
def decide_top_k(batch: VerifyBatch, config: TopKConfig) -> Decision:
    """Accept a draft token within the target's top-k. Score: the token's rank (0 = argmax)."""
    lossless = lossless_accept(batch)
    rank = target_rank(batch.target_f32[:, :-1], batch.draft_token_ids)
    return with_lossless(lossless, rank < min(config.k, batch.vocab_size), rank.to(torch.float32))


@dataclass(frozen=True)
class RelaxedTopKConfig(PolicyConfig):
    n: int = knob(3, valid=Valid(low=1), search=SearchRange(1, 16, integer=True), doc="candidate set top-n(p_t)")
    delta: float = knob(
        0.3, valid=Valid(low=0.0, high=1.0), search=SearchRange(0.0, 1.0), doc="max gap p_t(top1) - p_t(d)"
    )


@register(
    "relaxed_topk",
    config=RelaxedTopKConfig,
    off={"n": 1, "delta": 0.0},
    off_exact_when_sampling=False,
    leniency=Leniency("delta", (0.0, 0.05, 0.2, 0.5, 1.0), {"n": 8}),
)
def decide_relaxed_topk(batch: VerifyBatch, config: RelaxedTopKConfig) -> Decision:
    """Accept d in top-n(p_t) with p_t(d) >= p_t(top1) - delta. Score: p_t(top1) - p_t(d)."""
    lossless = lossless_accept(batch)
    rank = target_rank(batch.target_f32[:, :-1], batch.draft_token_ids)
    logp = batch.target_logp  # [B, L, V], shared with other rules on this batch
    gap = logp.amax(dim=-1).exp() - gather_last(logp, batch.draft_token_ids).exp()
    relaxed = (rank < min(config.n, batch.vocab_size)) & (gap <= config.delta)
    return with_lossless(lossless, relaxed, gap)
