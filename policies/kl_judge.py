"""The KL judge (arXiv 2601.04766): accept a draft token when KL(p_t ‖ q) <= threshold, except
where the target is confident (max p_t > confidence), where the lossless rule decides alone.
Score: KL(p_t ‖ q) in nats (T = 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from policies.core import Decision, PolicyConfig, SearchRange, Valid, VerifyBatch, knob, require
from policies.distributions import kl_from_logprobs
from policies.lossless import lossless_accept, with_lossless
from policies.registry import Leniency, Traits, register


@dataclass(frozen=True)
class KLJudgeConfig(PolicyConfig):
    threshold: float = knob(
        0.5, valid=Valid(low=0.0), search=SearchRange(0.01, 5.0, log=True), doc="KL threshold tau (nats)"
    )
    confidence: float = knob(
        0.9, valid=Valid(low=0.0, high=1.0), search=SearchRange(0.5, 1.0), doc="lossless-only above this max p_t"
    )


@register(
    "kl_judge",
    config=KLJudgeConfig,
    off={"threshold": 0.0},
    leniency=Leniency("threshold", (0.0, 0.05, 0.5, 2.0, 10.0, math.inf), {"confidence": 1.0}),
    # its KL and max p are the fused kernel's (policies.fused), and decide on (p_t, q) alone
    traits=Traits(cpu_block="fused", decides_on_distributions=True),
)
def decide_kl_judge(batch: VerifyBatch, config: KLJudgeConfig) -> Decision:
    """Accept when KL(target ‖ draft) <= threshold where the target is not confident."""
    require(batch, "draft_logits", "kl_judge", "KL(target ‖ draft) needs the draft's distribution")
    stats = batch.fused  # one fused pass (policies.fused) where it runs: first, so the lossless part shares it
    lossless = lossless_accept(batch)
    if stats is not None and stats.kl1 is not None:
        kl, max_p = stats.kl1, stats.max_prob1
    else:
        kl = kl_from_logprobs(batch.target_logp, batch.draft_logp, batch.target_probs)  # [B, L]
        max_p = batch.target_logp.amax(dim=-1).exp()
    confident = max_p > config.confidence  # [B, L] max p_t
    relaxed = ~confident & (kl <= config.threshold)
    return with_lossless(lossless, relaxed, kl)
