"""``any_of``: a union of rules — accept where any member accepts. Members decide in order on the
same batch, each from the same generator state. Score: how many members accepted."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from policies.core import Decision, PolicyConfig, Rule, VerifyBatch
from policies.lossless import lossless_accept, with_lossless
from policies.registry import (
    Leniency,
    Traits,
    decide_local,
    lookahead,
    make_policy,
    policy_from_dict,
    register,
    traits,
)


def _member(spec: Any) -> Rule:
    if isinstance(spec, Rule):
        return spec
    if isinstance(spec, Mapping):
        return policy_from_dict(spec)
    if isinstance(spec, (tuple, list)) and len(spec) == 2 and isinstance(spec[0], str):
        return make_policy(spec[0], **dict(spec[1] or {}))
    raise ValueError(
        f"members: each member must be a policy, {{'policy': name, 'params': {{...}}}} or (name, params), got {spec!r}"
    )


@dataclass(frozen=True)
class AnyOfConfig(PolicyConfig):
    members: tuple = field(default=(), metadata={"doc": "member rules; accept where any accepts"})

    def validate(self) -> None:
        if isinstance(self.members, (str, bytes)) or not isinstance(self.members, (list, tuple)):
            raise ValueError(f"members must be a list of rules, got {self.members!r}")
        rules = tuple(_member(m) for m in self.members)
        if not rules:
            raise ValueError("members must name at least one rule")
        if any(r.name == "any_of" for r in rules):
            raise ValueError("members: nest rules flat; any_of inside any_of is not supported")
        object.__setattr__(self, "members", rules)

    def to_dict(self) -> dict[str, Any]:
        return {"members": [r.describe() for r in self.members]}


def union_traits(config: AnyOfConfig) -> Traits:
    """The members': the union needs what any member needs, draws where any draws, and replays exactly where
    every member does. Its blocks in a ragged batch stay the default ones (as before traits were declared: the
    union is no reader of the fused kernel itself, and its members' block sizes are not combined)."""
    members = [traits(m) for m in config.members]
    return Traits(needs_hidden=any(t.needs_hidden for t in members),
                  draws_when_greedy=any(t.draws_when_greedy for t in members),
                  replays_exactly=all(t.replays_exactly for t in members),
                  decides_on_distributions=all(t.decides_on_distributions for t in members))


@register(
    "any_of",
    config=AnyOfConfig,
    off={"members": (("kl_judge", {"threshold": 0.0}),)},
    example={"members": (("kl_judge", {"threshold": 0.5}), ("top_k", {"k": 4}))},
    lookahead=lambda config: max(lookahead(m) for m in config.members),
    local=lambda batch, config: _union(batch, config, local=True),
    traits=union_traits,
    leniency=Leniency(
        "members",
        (
            (("top_k", {"k": 2}),),
            (("top_k", {"k": 2}), ("target_entropy", {"threshold": 1.0})),
            (("top_k", {"k": 2}), ("target_entropy", {"threshold": 1.0}), ("typical", {"epsilon": 0.1})),
        ),
    ),
)
def decide_any_of(batch: VerifyBatch, config: AnyOfConfig) -> Decision:
    """Accept a draft token that any member rule accepts."""
    return _union(batch, config, local=False)[0]


def _union(batch: VerifyBatch, config: AnyOfConfig, local: bool) -> tuple[Decision, torch.Tensor]:
    """The union's decision and where it is still open (``local``: members decide from their own positions,
    :func:`policies.registry.decide_local`; all False otherwise)."""
    # Every member starts from the same generator state, so all of them (and this rule) draw the
    # same lossless uniforms: the union relaxes one lossless decision instead of OR-ing several
    # independent ones (which would accept more than lossless even with every member "off").
    # With per-row streams (batch.streams) the same holds by resetting their draw counter.
    streams = batch.streams
    generator = batch.generator
    if generator is None and streams is None:
        seed = int(torch.randint(0, 2**62, (1,)).item())
        generator = torch.Generator(device=batch.draft_token_ids.device).manual_seed(seed)
        batch = replace(batch, generator=generator)
    start = generator.get_state() if streams is None else streams.draws
    lossless = lossless_accept(batch)
    votes = torch.zeros_like(batch.draft_token_ids, dtype=torch.float32)
    accepted = torch.zeros_like(lossless.accepted)
    still_open = torch.zeros_like(lossless.accepted)
    for rule in config.members:
        if streams is None:
            generator.set_state(start)
        else:
            streams.draws = start
        if local:
            member, member_open = decide_local(rule, batch)
            if member_open is not None:
                still_open |= member_open
        else:
            member = rule.decide(batch).accepted
        accepted |= member
        votes += member.float()
    decision = with_lossless(lossless, accepted, votes)
    return decision, still_open & ~decision.accepted
