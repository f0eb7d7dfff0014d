"""FLy: entropy-gated deferred verification (Li et al., "FLy", arXiv 2511.22972; vLLM 0.33's
``rejection_sample_method="fly"``).

Where the lossless rule rejects a draft token the target finds plausible enough, FLy looks ahead instead:
if the target is unsure at that position (its top-k entropy is at least a threshold) and the next W draft
tokens of the same block are each accepted by the lossless rule, the mismatch is taken to be a harmless
rewording and accepted. Decisions past it are the lossless rule's own.

- T = 0: the native decision is d = argmax p_t; T > 0: u < min(1, p_t(d)/q(d)) with the lossless rule's own
  uniforms, so FLy accepts a superset of what ``lossless`` accepts from the same generator state.
- p_t(d) > 0 (and q(d) > 0 when sampling with a draft distribution) as float32 probabilities at T, as vLLM's
  V1 runner tests them (its V2 runner tests log-probabilities instead: a draft token more than ~103 nats below
  the top is deferrable there, not here).
- Entropy: -Σ p log p over the target's k most likely tokens, p the full softmax at the batch's temperature
  (T = 1 when greedy), as vLLM computes it. It is at most k/e, so a threshold above that switches FLy off.
- A deferral needs the whole window inside the block: position i of a block of n drafts defers only when
  i + W < n, so at draft length L <= W nothing defers (FLy is then lossless). In a ragged batch the block is
  the request's own drafts (``VerifyBatch.draft_valid``); a placeholder is never a native acceptance.
- The target row at i + 1 is conditioned on the draft token at i, so a decision reads later positions of the
  same verify pass: it is not a function of its own position (what replay relies on for other rules).
  :func:`local` gives replay the part that is (``workers.replay``: where a deferral could happen, it decodes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from policies.core import Decision, PolicyConfig, SearchRange, Valid, VerifyBatch, knob
from policies.distributions import gather_last
from policies.lossless import lossless_accept, with_lossless
from policies.registry import Leniency, register

OFF = math.inf  # an entropy threshold no top-k entropy reaches


@dataclass(frozen=True)
class FlyConfig(PolicyConfig):
    window: int = knob(1, valid=Valid(low=1), search=SearchRange(1, 8, integer=True),
                       doc="W: the next W drafts of the block must each be accepted natively (vLLM's default is "
                           "min(6, L - 1); at L <= W nothing defers)")
    entropy_threshold: float = knob(0.3, valid=Valid(low=0.0), search=SearchRange(0.0, 1.1),
                                    doc="defer only where the target's top-k entropy (nats) is at least this")
    top_k: int = knob(3, valid=Valid(low=1, high=64), search=SearchRange(1, 8, integer=True),
                      doc="how many of the target's most likely tokens the entropy sums over")


def topk_entropy(batch: VerifyBatch, k: int) -> Tensor:
    """[B, L] -Σ p log p over the target's k most likely tokens at each draft position (p at the batch's
    temperature, T = 1 when greedy; not renormalized)."""
    t = batch.temperature if batch.temperature > 0.0 else 1.0
    target = batch.target_f32[:, :-1]
    top = target.topk(min(k, target.shape[-1]), dim=-1).values  # [B, L, k]
    logp = (top if t == 1.0 else top / t) - batch.target_lse(t).unsqueeze(-1)
    p = logp.exp()
    return -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(dim=-1)


def local(batch: VerifyBatch, config: FlyConfig) -> tuple[Decision, Tensor]:
    """The lossless decision and, per position, whether FLy may still defer a rejection there ([B, L] bool):
    what a position's own inputs decide. Whether it does depends on the block (its length and the next W
    native decisions), which :func:`decide_fly` adds."""
    native = lossless_accept(batch)
    entropy = topk_entropy(batch, config.top_k)
    ids = batch.draft_token_ids
    t = batch.temperature
    target = batch.target_f32[:, :-1]
    if t == 0.0:
        plausible = torch.isfinite(gather_last(target, ids))  # p_t(d) > 0
    else:  # p_t(d) > 0 and q(d) > 0 as float32 probabilities at T (vLLM's V1 kernel tests them so)
        plausible = (gather_last(target, ids) / t - batch.target_lse(t)).exp() > 0
        if batch.draft_logits is not None:
            plausible = plausible & ((gather_last(batch.draft_at(t), ids) - batch.draft_lse(t)).exp() > 0)
    if batch.draft_valid is not None:
        plausible = plausible & batch.draft_valid
    deferrable = ~native.accepted & plausible & (entropy >= config.entropy_threshold)
    return Decision(accepted=native.accepted, score=entropy), deferrable


@register(
    "fly",
    config=FlyConfig,
    off={"entropy_threshold": OFF},
    leniency=Leniency("entropy_threshold", (OFF, 1.0, 0.6, 0.3, 0.1, 0.0), {"window": 1}),
    example={"window": 2, "entropy_threshold": 0.3, "top_k": 3},
    lookahead_knob="window",
    lookahead=lambda config: config.window,
    local=local,
)
def decide_fly(batch: VerifyBatch, config: FlyConfig) -> Decision:
    """Defer a rejection where the target's top-k entropy is high and the next W drafts are accepted
    natively. Score: the top-k entropy."""
    native, deferrable = local(batch, config)
    ok = native.accepted if batch.draft_valid is None else native.accepted & batch.draft_valid
    b, n = ok.shape
    w = config.window
    if w >= n:  # no window fits in the block
        return native
    # run[i]: the W positions after i are all natively accepted (and inside the request's drafts)
    after = torch.ones((b, n - w), dtype=torch.bool, device=ok.device)
    for offset in range(1, w + 1):
        after = after & ok[:, offset:n - w + offset]
    fits = torch.zeros_like(ok)
    fits[:, :n - w] = after
    return with_lossless(native, deferrable & fits, native.score)
