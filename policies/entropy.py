"""Entropy baselines: accept where the target is unsure (high H(p_t)) or the draft is sure
(low H(q)). Score: the entropy in nats (T = 1)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from policies.core import Decision, PolicyConfig, SearchRange, Valid, VerifyBatch, knob, require
from policies.distributions import entropy_from_logprobs
from policies.lossless import lossless_accept, with_lossless
from policies.registry import Leniency, Traits, register


@dataclass(frozen=True)
class TargetEntropyConfig(PolicyConfig):
    threshold: float = knob(
        2.0, valid=Valid(low=0.0), search=SearchRange(0.1, 6.0), doc="accept where H(p_t) >= threshold"
    )


@register(
    "target_entropy",
    config=TargetEntropyConfig,
    off={"threshold": math.inf},
    leniency=Leniency("threshold", (math.inf, 6.0, 3.0, 1.0, 0.1, 0.0)),
    traits=Traits(decides_on_distributions=True),  # H(p_t)
)
def decide_target_entropy(batch: VerifyBatch, config: TargetEntropyConfig) -> Decision:
    """Accept any draft token where the target's entropy is at least the threshold."""
    lossless = lossless_accept(batch)
    entropy = entropy_from_logprobs(batch.target_logp, batch.target_probs)  # [B, L]
    return with_lossless(lossless, entropy >= config.threshold, entropy)


@dataclass(frozen=True)
class DraftEntropyConfig(PolicyConfig):
    threshold: float = knob(
        0.3, valid=Valid(low=0.0), search=SearchRange(0.01, 3.0, log=True), doc="accept where H(q) <= threshold"
    )


@register(
    "draft_entropy",
    config=DraftEntropyConfig,
    off={"threshold": 0.0},
    leniency=Leniency("threshold", (0.0, 0.01, 0.3, 1.0, 3.0, math.inf)),
    traits=Traits(decides_on_distributions=True),  # H(q)
)
def decide_draft_entropy(batch: VerifyBatch, config: DraftEntropyConfig) -> Decision:
    """Accept any draft token the draft model was confident about (entropy at most the threshold)."""
    require(batch, "draft_logits", "draft_entropy", "H(q) needs the draft's distribution")
    lossless = lossless_accept(batch)
    entropy = entropy_from_logprobs(batch.draft_logp)  # [B, L]
    # threshold 0 is "off": even a one-hot draft (H = 0 up to rounding) is not relaxed.
    relaxed = (entropy <= config.threshold) & (config.threshold > 0.0)
    return with_lossless(lossless, relaxed, entropy)
