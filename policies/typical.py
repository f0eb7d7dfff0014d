"""Typical acceptance (Medusa; vLLM V0's TypicalAcceptanceSampler):
accept d when p_t(d) > min(epsilon, delta * exp(-H(p_t))). Score: p_t(d) minus that threshold."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from policies.core import Decision, PolicyConfig, SearchRange, Valid, VerifyBatch, knob
from policies.distributions import entropy_from_logprobs, gather_last
from policies.lossless import lossless_accept, with_lossless
from policies.registry import Leniency, register


@dataclass(frozen=True)
class TypicalConfig(PolicyConfig):
    epsilon: float = knob(
        0.09, valid=Valid(low=0.0, high=1.0), search=SearchRange(0.01, 0.5, log=True), doc="posterior threshold"
    )
    delta: float = knob(0.3, valid=Valid(low=0.0), search=SearchRange(0.05, 1.0), doc="posterior alpha")


@register(
    "typical",
    config=TypicalConfig,
    # epsilon = 1 caps the threshold at 1 and p_t(d) > 1 never holds once delta*exp(-H) >= 1
    # everywhere, i.e. delta >= V; 1e12 covers any vocabulary.
    off={"epsilon": 1.0, "delta": 1e12},
    leniency=Leniency("epsilon", (1.0, 0.5, 0.1, 0.01, 0.0), {"delta": 1e12}),
)
def decide_typical(batch: VerifyBatch, config: TypicalConfig) -> Decision:
    """Accept a draft token whose target probability is typical for the target's entropy."""
    lossless = lossless_accept(batch)
    target_logp = batch.target_logp  # [B, L, V]
    entropy = entropy_from_logprobs(target_logp, batch.target_probs)  # [B, L]
    threshold = torch.minimum(
        torch.full_like(entropy, config.epsilon), config.delta * torch.exp(-entropy)
    )
    prob_d = gather_last(target_logp, batch.draft_token_ids).exp()
    return with_lossless(lossless, prob_d > threshold, prob_d - threshold)
