"""Per-generation statistics (vLLM's names): counts and seconds, nothing about models. What a run costs in
target-step units is the cost model's (``workers.metrics.cost``), from these counts."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class GenerationStats:
    draft_len: int = 0  # L; 0 for target-only decoding
    num_generated: int = 0  # tokens emitted (after truncation at EOS / stop / max_new_tokens)
    num_drafts: int = 0  # verify rounds = target forward passes after prefill
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [L] rounds accepting position i
    target_forwards: int = 0  # after prefill
    draft_forwards: int = 0  # after prefill
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens whose KV entries came from the prefix cache
    prefill_time_s: float = 0.0
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    policy_time_s: float = 0.0
    wall_time_s: float = 0.0
    # verify rounds the rule could not decide (an input missing, or it failed) and that the lossless
    # rule decided instead (vLLM engine; the CPU engine never falls back)
    lossless_fallback_steps: int = 0

    @property
    def mean_acceptance_length(self) -> float:
        """Generated tokens per target call (accepted + 1 per round; MAT / tau in the papers)."""
        return self.num_generated / self.num_drafts if self.num_drafts else float(self.num_generated > 0)

    @property
    def draft_acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def decode_time_s(self) -> float:
        return self.wall_time_s - self.prefill_time_s

    @property
    def other_time_s(self) -> float:
        """Decode time outside draft forwards, target forwards and the rule: the engine's overhead."""
        return max(0.0, self.decode_time_s - self.draft_time_s - self.verify_time_s - self.policy_time_s)

    @property
    def tokens_per_s(self) -> float:
        """Decode throughput (prefill excluded, as the papers report)."""
        return self.num_generated / self.decode_time_s if self.decode_time_s > 0 else 0.0

    def plus(self, later: GenerationStats) -> GenerationStats:
        """This run's counts and seconds with a ``later`` run's added (the turns of an item; a replayed prefix
        and the live decode after it): one merge for both. Per-position acceptance adds up position by
        position; the prompt fields are the later run's."""
        summed = {name: getattr(self, name) + getattr(later, name) for name in _SUMMED}
        if self.accepted_per_position and later.accepted_per_position:
            positions = [a + b for a, b in zip(self.accepted_per_position, later.accepted_per_position, strict=True)]
        else:
            positions = list(self.accepted_per_position or later.accepted_per_position)
        return GenerationStats(draft_len=self.draft_len, accepted_per_position=positions,
                               prompt_tokens=later.prompt_tokens, cached_prompt_tokens=later.cached_prompt_tokens,
                               **summed)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for name in ("mean_acceptance_length", "draft_acceptance_rate", "other_time_s", "tokens_per_s"):
            d[name] = getattr(self, name)
        return d


_SUMMED = ("num_generated", "num_drafts", "num_draft_tokens", "num_accepted_tokens", "target_forwards",
           "draft_forwards", "prefill_time_s", "draft_time_s", "verify_time_s", "policy_time_s", "wall_time_s",
           "lossless_fallback_steps")


@dataclass
class Generation:
    token_ids: list[int]  # generated tokens only (stop token / EOS excluded)
    text: str | None  # decoded, cut before a stop string; None without a tokenizer
    finish_reason: str  # "eos", "stop" (a stop string), "length", or "abort" (on_tokens said stop)
    stats: GenerationStats
    trace: list[tuple[int, Any]] | None = None  # (first position, target logits [L+1, V]) per round, if asked
