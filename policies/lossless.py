"""The lossless rule (Leviathan et al. / vLLM's rejection sampler) and the helper every lossy rule
builds on: a lossy rule's acceptance is ``lossless | relaxed``, with the lossless uniforms drawn
first so that, from the same generator state, it accepts a superset of what ``lossless`` accepts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from policies.core import Decision, PolicyConfig, VerifyBatch
from policies.coupling import perturbed_argmax
from policies.distributions import gather_last
from policies.randomness import uniform
from policies.registry import Traits, register


def lossless_accept(batch: VerifyBatch) -> Decision:
    """T = 0: accept d iff d = argmax target. T > 0: accept iff u < min(1, p_t(d) / q(d)); under the coupled
    sampler (``batch.coupling``) iff d = argmax(target / T + g), the token target-only samples there.

    Scores: the target logit margin z(d) - max z (<= 0) at T = 0, the acceptance probability
    min(1, p_t(d)/q(d)) at T > 0. Without a draft distribution the drafter is taken as
    deterministic (q one-hot at d), which keeps the rule exactly lossless.
    """
    draft_ids = batch.draft_token_ids  # [B, L]
    target = batch.target_f32[:, :-1]  # [B, L, V]
    temperature = batch.temperature
    if temperature == 0.0:
        # d = argmax, the first index among ties (torch.argmax's rule, as target-only decoding picks);
        # ``score >= 0`` also rejects NaN rows. One argmax pass: on torch 2.13's CPU kernels it is ~5x
        # cheaper than the masked amax ("no earlier token reaches the max") this replaced.
        score = gather_last(target, draft_ids) - batch.target_max  # [B, L], 0 where d is a max
        accepted = (score >= 0) & (target.argmax(dim=-1) == draft_ids)
        return Decision(accepted=accepted, score=score)
    # Only p_t(d) and q(d) are needed: logit(d)/T - logsumexp(logits/T), no full softmax.
    # The log-partitions are the batch's, shared with any other rule (or DropMatch's rest atom) at this T.
    target_logp_d = gather_last(target, draft_ids) / temperature - batch.target_lse(temperature)
    if batch.draft_logits is None:  # (not draft_f32: that would make the T = 1 view, a full pass)
        draft_logp_d = torch.zeros_like(target_logp_d)
    else:
        draft_logp_d = gather_last(batch.draft_at(temperature), draft_ids) - batch.draft_lse(temperature)
    ratio = (target_logp_d - draft_logp_d).clamp(max=0.0).exp()  # [B, L]
    if batch.coupling is not None:  # the coupled sampler: d must be the target's own Gumbel-max token
        picked = perturbed_argmax(target, temperature, batch.coupling[:, :-1])
        return Decision(accepted=picked == draft_ids, score=ratio)
    uniforms = uniform(tuple(draft_ids.shape), batch.generator, draft_ids.device, batch.streams)
    return Decision(accepted=uniforms < ratio, score=ratio)


def with_lossless(lossless: Decision, relaxed: Tensor, score: Tensor | None) -> Decision:
    """Combine a relaxation with the lossless decision (lossy rules only ever add acceptances)."""
    return Decision(accepted=lossless.accepted | relaxed, score=score)


@dataclass(frozen=True)
class LosslessConfig(PolicyConfig):
    pass


@register("lossless", config=LosslessConfig, lossy=False, traits=Traits(cpu_block="fused", decides_on_distributions=True))
def decide_lossless(batch: VerifyBatch, config: LosslessConfig) -> Decision:
    """Exact speculative sampling: the output distribution is the target's."""
    return lossless_accept(batch)
