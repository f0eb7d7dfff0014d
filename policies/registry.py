"""The rule registry: one entry per rule, refused twice, looked up with errors that list names.

Besides the decide function and config class, each entry records two facts the shared contract
suite and the search driver need, as data rather than code paths:

- ``off``: the parameters that switch the rule's relaxation off (the rule then reproduces
  ``lossless`` exactly), and whether that holds when sampling (T > 0) or only greedily;
- ``leniency``: one knob and a list of values ordered from strict to lenient, with fixed
  companions, along which acceptance can only grow;
- ``lookahead`` / ``local``, for a rule whose decision at a position reads later positions of the same
  block (FLy): how many, and the part of the decision a position's own inputs make (what replay can
  use; :func:`lookahead` and :func:`decide_local`);
- ``traits``: what the rule needs and promises under a config (:class:`Traits`: hidden states, random draws at
  T = 0, exact replay, its blocks in a ragged batch), read through :func:`traits` by code outside ``policies``
  instead of branching on a rule's name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from policies.core import DecideFn, PolicyConfig, Rule


@dataclass(frozen=True)
class Leniency:
    param: str
    values: tuple[Any, ...]  # strict -> lenient
    fixed: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Traits:
    """What a rule needs and promises under one config, declared where it registers: code outside ``policies``
    reads these (:func:`traits`) and never a rule's name. A composite rule (``any_of``) derives them from its
    members. The contract suite checks each declaration against the rule's decisions."""

    # reads VerifyBatch.target_hidden and the LM head (lm_head_weight, lm_head_bias): DropMatch's dropout heads
    # run on the target's final hidden state. A caller hands these over only to a rule that declares it.
    needs_hidden: bool = False
    # draws random numbers at T = 0 too (DropMatch's dropout masks): per-request keys matter even when greedy
    draws_when_greedy: bool = False
    # a position's decision is the same number whatever rows are decided beside it, so a teacher-forced pass over
    # hundreds of rows decides as a live round's few rows do (workers.replay). False for DropMatch's exact mode with
    # dropout on: its K full-vocabulary heads are one float GEMM over every row of the block
    replays_exactly: bool = True
    # its CPU block size class in a ragged batch (policies.ragged), where the fused statistics kernel runs:
    # "eager" (its full-vocabulary passes prefer small blocks), "fused" (that work is the fused kernel's: larger
    # blocks), "heads" (the fused kernel's, and many small per-chunk ops besides: the largest blocks)
    cpu_block: str = "eager"
    # full-vocabulary head logits it holds per row (DropMatch's exact mode: K): a ragged batch's chunks shrink by
    # it (twice that at T > 0), so that the heads stay within one block
    vocab_heads: int = 0
    # what it adds to lossless decides on the two distributions (p_t, q) alone, never on the token drawn: at each
    # position it emits the draft's token where it relaxes and lossless's outcome elsewhere, a law the sampler does
    # not change, so its quality under the coupled sampler is its quality under the standard one (policies.coupling).
    # False for rules that look at the token (its rank, its probability, a dropout head's vote, a look-ahead)
    decides_on_distributions: bool = False

    def __post_init__(self) -> None:
        if self.cpu_block not in ("eager", "fused", "heads"):
            raise ValueError(f"cpu_block must be 'eager', 'fused' or 'heads', got {self.cpu_block!r}")


NO_TRAITS = Traits()


@dataclass(frozen=True)
class PolicySpec:
    name: str
    config_cls: type
    fn: DecideFn
    lossy: bool
    off: Mapping[str, Any] | None  # params with the relaxation off; None for lossless itself
    off_exact_when_sampling: bool  # does `off` reproduce lossless at T > 0 too?
    leniency: Leniency | None
    example: Mapping[str, Any]  # params that build a typical instance (defaults where they exist)
    summary: str
    # A decision at position i that reads positions up to i + lookahead(config) of its block (0: none), and
    # local(batch, config) -> (the decision where the block is not read, [B, L] bool where it still could
    # accept). None for rules whose decisions are their positions' own.
    lookahead: Callable[[Any], int] | None = None
    local: Callable[[Any, Any], tuple[Any, Any]] | None = None
    lookahead_knob: str | None = None  # the integer knob that sets lookahead (a search draws it below L)
    traits: Callable[[Any], Traits] = lambda config: NO_TRAITS  # config -> what it needs and promises (Traits)

    @property
    def param_names(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self.config_cls)]

    def build_config(self, params: Mapping[str, Any]) -> Any:
        unknown = sorted(set(params) - set(self.param_names))
        if unknown:
            raise ValueError(
                f"unknown parameter(s) {unknown} for policy {self.name!r}; valid: {self.param_names or 'none'}"
            )
        return self.config_cls(**params)


POLICIES: dict[str, PolicySpec] = {}


def register(
    name: str,
    *,
    config: type,
    lossy: bool = True,
    off: Mapping[str, Any] | None = None,
    off_exact_when_sampling: bool = True,
    leniency: Leniency | None = None,
    example: Mapping[str, Any] | None = None,
    summary: str = "",
    lookahead: Callable[[Any], int] | None = None,
    local: Callable[[Any, Any], tuple[Any, Any]] | None = None,
    lookahead_knob: str | None = None,
    traits: Traits | Callable[[Any], Traits] = NO_TRAITS,
) -> Callable[[DecideFn], DecideFn]:
    if not (dataclasses.is_dataclass(config) and issubclass(config, PolicyConfig)):
        raise TypeError(f"config for {name!r} must be a PolicyConfig dataclass")

    def deco(fn: DecideFn) -> DecideFn:
        if name in POLICIES:
            raise ValueError(f"policy {name!r} is already registered")
        POLICIES[name] = PolicySpec(
            name=name,
            config_cls=config,
            fn=fn,
            lossy=lossy,
            off=off,
            off_exact_when_sampling=off_exact_when_sampling,
            leniency=leniency,
            example=dict(example or {}),
            summary=summary or (fn.__doc__ or "").strip().splitlines()[0],
            lookahead=lookahead,
            local=local,
            lookahead_knob=lookahead_knob,
            traits=traits if callable(traits) else (lambda config, fixed=traits: fixed),
        )
        return fn

    return deco


def get_spec(name: str) -> PolicySpec:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; valid: {sorted(POLICIES)}") from None


def make_policy(name: str, **params: Any) -> Rule:
    """Build a validated policy: ``make_policy("kl_judge", threshold=0.5)``."""
    spec = get_spec(name)
    return Rule(name=name, config=spec.build_config(params), fn=spec.fn)


def policy_from_dict(d: Mapping[str, Any]) -> Rule:
    """``{"policy": "kl_judge", "params": {...}}`` (the form written by sweeps and served)."""
    if not isinstance(d, Mapping) or "policy" not in d:
        raise ValueError(f"a policy description needs a 'policy' key, got {d!r}")
    extra = sorted(set(d) - {"policy", "params"})
    if extra:
        raise ValueError(f"unknown key(s) {extra} in policy description; valid: ['policy', 'params']")
    params = d.get("params") or {}
    if not isinstance(params, Mapping):
        raise ValueError(f"'params' must be an object, got {type(params).__name__}")
    return make_policy(str(d["policy"]), **dict(params))


def lookahead(policy: Any) -> int:
    """How many later positions of its block ``policy``'s decision at a position may read (0 for most rules)."""
    spec = POLICIES.get(getattr(policy, "name", ""))
    return int(spec.lookahead(policy.config)) if spec is not None and spec.lookahead is not None else 0


def traits(policy: Any) -> Traits:
    """What ``policy`` needs and promises under its config (:class:`Traits`); the defaults for an object that
    is no registered rule."""
    spec = POLICIES.get(getattr(policy, "name", ""))
    return NO_TRAITS if spec is None else spec.traits(policy.config)


def decide_local(policy: Any, batch: Any) -> tuple[Any, Any]:
    """(accepted [B, L] bool, open [B, L] bool or None): ``policy``'s decision where it reads only its own
    position, and where a rejection could still turn into an acceptance through the positions after it
    (:func:`lookahead`). None: every decision is its position's own (``policy.decide``)."""
    spec = POLICIES.get(getattr(policy, "name", ""))
    if spec is None or spec.local is None:
        return policy.decide(batch).accepted, None
    decision, still_open = spec.local(batch, policy.config)
    return decision.accepted, still_open


_NEEDS_DRAFT: dict[str, bool] = {}


def needs_draft_logits(policy: Any) -> bool:
    """Whether ``policy`` reads the draft's distribution at T = 0 (lossless does not; the KL judge, draft entropy
    and DropMatch's js do). Probed once per rule and config on a tiny batch without one: a rule that asks for it
    (``MissingInputError``), or fails at all without it, needs it. At T > 0 every rule needs it (lossless's q)."""
    import torch

    from policies.core import VerifyBatch

    key = f"{getattr(policy, 'name', type(policy).__name__)}:{getattr(policy, 'config', None)!r}"
    hit = _NEEDS_DRAFT.get(key)
    if hit is None:
        g = torch.Generator().manual_seed(0)
        batch = VerifyBatch(draft_token_ids=torch.tensor([[1, 2]]), draft_logits=None,
                            target_logits=torch.randn(1, 3, 16, generator=g), target_hidden=torch.randn(1, 3, 8, generator=g),
                            lm_head_weight=torch.randn(16, 8, generator=g), temperature=0.0, generator=g)
        try:
            policy.decide(batch)
            hit = False
        except Exception:  # noqa: BLE001 - MissingInputError(draft_logits), or anything else: keep the draft's logits
            hit = True
        _NEEDS_DRAFT[key] = hit
    return hit
