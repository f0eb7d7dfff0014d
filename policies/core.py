"""The contracts every acceptance rule shares: inputs, outputs, configs and their knobs.

This module knows tensors and nothing else: no models, no tokenizers, no Ray. Shapes use
B (batch), L (draft length), V (vocabulary), d (hidden size) and K (dropout heads).

A rule ("policy") is a pure function ``decide(batch, config) -> Decision`` plus a frozen config
dataclass. Config fields are declared with :func:`knob`, which records two things as field
metadata: the *valid* interval (checked in ``__post_init__``; a bad value raises ``ValueError``
naming the field) and the *search* range (read by the sweep driver to build its space; rules
never see an optimizer).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Protocol

import torch
from torch import Tensor


def as_float(x: Tensor) -> Tensor:
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def _positive(temperature: float) -> float:
    if not temperature > 0.0:
        raise ValueError(f"a distribution at a temperature needs one > 0, got {temperature}")
    return float(temperature)


def log_partition(logits: Tensor, logp: Tensor | None = None) -> Tensor:
    """log Σ exp(logits) over the last dim, from the log-softmax ``logp`` of the same logits (computed here
    when not given): max(logits) - max(logp). ``torch.logsumexp`` makes three full-size passes and two
    temporaries on CPU (amax, the difference, exp); the fused log-softmax makes one temporary, and the two
    maxima are cheap. Exact in the sense that the kernel's max(logp) is -log Σ exp(logits - max)."""
    if logp is None:
        logp = torch.log_softmax(logits, dim=-1)
    return logits.amax(dim=-1) - logp.amax(dim=-1)


@dataclass(frozen=True)
class VerifyBatch:
    """Everything one verify step knows. Logits may be bf16; rules upcast what they read."""

    draft_token_ids: Tensor  # [B, L] long
    draft_logits: Tensor | None  # [B, L, V]; None for drafters without distributions
    target_logits: Tensor  # [B, L+1, V]; position i scores draft token i, L is the bonus slot
    target_hidden: Tensor | None = None  # [B, L+1, d] final hidden state after the final norm
    lm_head_weight: Tensor | None = None  # [V, d] target LM head
    lm_head_bias: Tensor | None = None  # [V]
    temperature: float = 0.0  # 0 = greedy
    generator: torch.Generator | None = None
    # Per-row random streams (policies.randomness.RowStreams): when set, every random number a rule draws
    # comes from its row's own stream instead of ``generator`` (a request's draws independent of the batch)
    streams: Any = None
    # ``draft_logits`` are z / T at the batch temperature (z itself at T = 0): the drafter's logits as vLLM
    # divides them before drawing the drafts from softmax(z / T). The vLLM plugin hands them over so, in the
    # draft's dtype (bf16 on a GPU: half the memory of a float32 distribution): q at T is softmax of them,
    # the distribution the drafts were drawn from, and the T = 1 view (``draft_f32``) is T times them.
    draft_scaled: bool = False
    # [B, L] bool, False at positions that hold no draft of the row's own (a ragged batch's padding, vLLM's
    # placeholders): None when every position does. Emission never reaches past the first of them; a rule
    # that reads later positions (FLy's look-ahead) must not count them as accepted.
    draft_valid: Tensor | None = None
    # [B, L+1, V'] Gumbel noise at the target's slots (policies.coupling), V' >= V, T > 0 only: the coupled
    # sampler. ``lossless`` then accepts a draft token iff it is argmax(target / T + noise) there and emission
    # takes that argmax, so lossless output equals target-only output under the same noise. None: the standard
    # sampler (uniforms against p/q, residual sampling).
    coupling: Tensor | None = None

    def __post_init__(self) -> None:
        ids, tl = self.draft_token_ids, self.target_logits
        if ids.dim() != 2:
            raise ValueError(f"draft_token_ids must be [B, L], got shape {tuple(ids.shape)}")
        b, n = ids.shape
        if tl.dim() != 3 or tl.shape[0] != b or tl.shape[1] != n + 1:
            raise ValueError(f"target_logits must be [B, L+1, V] = [{b}, {n + 1}, V], got {tuple(tl.shape)}")
        if self.draft_logits is not None and tuple(self.draft_logits.shape) != (b, n, tl.shape[2]):
            raise ValueError(
                f"draft_logits must be [B, L, V] = [{b}, {n}, {tl.shape[2]}], got {tuple(self.draft_logits.shape)}"
            )
        if self.draft_valid is not None and tuple(self.draft_valid.shape) != (b, n):
            raise ValueError(f"draft_valid must be [B, L] = [{b}, {n}], got {tuple(self.draft_valid.shape)}")
        if self.coupling is not None and (self.coupling.dim() != 3 or tuple(self.coupling.shape[:2]) != (b, n + 1)
                                          or self.coupling.shape[2] < tl.shape[2]):
            raise ValueError(f"coupling must be [B, L+1, >= V] = [{b}, {n + 1}, >= {tl.shape[2]}], got "
                             f"{tuple(self.coupling.shape)}")
        if self.target_hidden is not None and tuple(self.target_hidden.shape[:2]) != (b, n + 1):
            raise ValueError(f"target_hidden must be [B, L+1, d], got {tuple(self.target_hidden.shape)}")
        if not (self.temperature >= 0.0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")

    # Shared float32 views, computed once per batch and reused by every rule (any_of runs several
    # rules on one batch). bf16 reductions and indexing are 10-30x slower than float32 on CPU,
    # while the upcast itself costs well under a millisecond at V = 152k.
    @cached_property
    def target_f32(self) -> Tensor:  # [B, L+1, V]
        return as_float(self.target_logits)

    @cached_property
    def draft_f32(self) -> Tensor | None:  # [B, L, V] at T = 1
        if self.draft_logits is None:
            return None
        t = self.temperature
        return self._draft_given * t if self.draft_scaled and t > 0.0 and t != 1.0 else self._draft_given

    @cached_property
    def _draft_given(self) -> Tensor:  # the draft's logits as given, in float32
        return as_float(self.draft_logits)


    @cached_property
    def target_logp(self) -> Tensor:  # [B, L, V] log-softmax (T = 1) at the draft positions
        return torch.log_softmax(self.target_f32[:, :-1], dim=-1)

    @cached_property
    def target_probs(self) -> Tensor:  # [B, L, V] softmax (T = 1); softmax's fused kernel beats exp(logp)
        return torch.softmax(self.target_f32[:, :-1], dim=-1)

    @cached_property
    def target_max(self) -> Tensor:  # [B, L] max logit at the draft positions (amax: vectorized, no index)
        return self.target_f32[:, :-1].amax(dim=-1)

    @cached_property
    def draft_logp(self) -> Tensor | None:  # [B, L, V]
        return None if self.draft_f32 is None else torch.log_softmax(self.draft_f32, dim=-1)

    @cached_property
    def _at_t(self) -> dict[tuple[str, float], Tensor]:  # log-partitions and draft_at, by (what, T)
        return {}

    @cached_property
    def fused(self) -> Any:
        """The fused statistics of the draft positions at the batch's temperature and at T = 1
        (:class:`policies.fused.RowStats`: both log-partitions of the target and the draft, KL, max p) in one
        pass, or None where the fused kernel does not run (:func:`policies.fused.enabled`): the eager
        kernels then compute what a rule asks for, one pass each. A rule that reads the T = 1 statistics
        asks for these first; the lossless rule alone needs only :attr:`fused_at_t`."""
        return self._fused(at_t_only=False)

    @cached_property
    def fused_at_t(self) -> Any:
        """The two log-partitions at the batch's temperature T > 0 alone (half the exponentials of
        :attr:`fused`), unless :attr:`fused` was computed already."""
        return self.__dict__.get("fused") or self._fused(at_t_only=True)

    def _fused(self, at_t_only: bool) -> Any:
        from policies import fused

        target = self.target_f32[:, :-1]
        if not fused.enabled(target):
            return None
        t = self.temperature
        scale = (1.0, 1.0)  # the draft's logits as given -> at T = 1 and at T
        if self.draft_logits is not None and t > 0.0:
            scale = (t, 1.0) if self.draft_scaled else (1.0, 1.0 / t)
        return fused.row_stats(target, self.draft_logits, t, scale, at_t_only=at_t_only)

    def _fused_at(self, temperature: float) -> Any:
        """The fused statistics when they hold ``temperature`` (1, or the batch's), else None."""
        if temperature == self.temperature and temperature != 1.0 and "fused" not in self.__dict__:
            return self.fused_at_t  # the lossless rule's two log-partitions (or all, when computed already)
        stats = self.fused
        return stats if stats is not None and temperature in (1.0, self.temperature) else None

    def target_lse(self, temperature: float = 1.0) -> Tensor:
        """[B, L] log Σ_v exp(z_v / T) of the target at the draft positions, once per batch and T (the
        lossless fallback, DropMatch's rest atom and others share it): from the fused statistics where they
        run, else T = 1 reuses ``target_logp``."""
        key = ("target", _positive(temperature))
        stats = self._fused_at(temperature)
        if stats is not None:
            return stats.target_lse if temperature == self.temperature else stats.target_lse1
        if key not in self._at_t:
            target = self.target_f32[:, :-1]
            self._at_t[key] = (log_partition(target, self.target_logp) if temperature == 1.0
                               else log_partition(target / temperature, None))
        return self._at_t[key]

    def draft_at(self, temperature: float) -> Tensor:
        """[B, L, V] logits whose softmax is the draft's distribution at ``temperature`` (> 0), once per T:
        the given ones themselves when they are already scaled to it (``draft_scaled``)."""
        if self.draft_logits is None:
            raise ValueError("the draft's distribution needs draft_logits")
        key = ("draft_at", _positive(temperature))
        if key not in self._at_t:
            if self.draft_scaled and temperature == (self.temperature or 1.0):
                self._at_t[key] = self._draft_given  # as given (draft_f32 would be a full pass)
            else:
                draft = self.draft_f32
                assert draft is not None
                self._at_t[key] = draft if temperature == 1.0 else draft / temperature
        return self._at_t[key]

    def draft_lse(self, temperature: float = 1.0) -> Tensor:
        """[B, L] the log-partition of :meth:`draft_at` ``temperature``; ``draft_logits`` must be given."""
        key = ("draft", _positive(temperature))
        stats = self._fused_at(temperature)
        if stats is not None and stats.draft_lse is not None:
            return stats.draft_lse if temperature == self.temperature else stats.draft_lse1
        if key not in self._at_t:
            logits = self.draft_at(temperature)
            self._at_t[key] = log_partition(logits, self.draft_logp if logits is self.draft_f32 else None)
        return self._at_t[key]

    def draft_logp_at(self, index: Tensor) -> Tensor:
        """[B, L, k] the draft's log-probabilities at T = 1 at token ids ``index`` ([B, L, k]): gathered from
        the logits as given, so nothing of vocabulary size is made beyond the log-partition."""
        if self.draft_logits is None:
            raise ValueError("the draft's distribution needs draft_logits")
        t = self.temperature
        picked = as_float(self.draft_logits.gather(-1, index))
        if self.draft_scaled and t > 0.0 and t != 1.0:
            picked = picked * t
        return picked - self.draft_lse(1.0).unsqueeze(-1)

    @property
    def batch_size(self) -> int:
        return self.draft_token_ids.shape[0]

    @property
    def draft_len(self) -> int:
        return self.draft_token_ids.shape[1]

    @property
    def vocab_size(self) -> int:
        return self.target_logits.shape[2]


@dataclass(frozen=True)
class Decision:
    accepted: Tensor  # [B, L] bool: position i is acceptable on its own
    score: Tensor | None = None  # [B, L] float: the rule's statistic (KL, JS margin, entropy, ...)


@dataclass(frozen=True)
class Verification:
    output_token_ids: Tensor  # [B, L+1] long: accepted draft tokens, then one emitted token, -1 padded
    num_accepted: Tensor  # [B] long: length of the leading accepted run
    decision: Decision


class MissingInputError(ValueError):
    """A rule was asked to decide without an input it needs (hidden states, draft logits...)."""


def require(batch: VerifyBatch, attr: str, rule: str, why: str) -> Tensor:
    value = getattr(batch, attr)
    if value is None:
        raise MissingInputError(f"policy {rule!r} needs VerifyBatch.{attr} ({why}), but it is None")
    return value


# --------------------------------------------------------------------------------------------
# Knobs: validation interval + search range, as dataclass field metadata.


@dataclass(frozen=True)
class SearchRange:
    """Where a search driver should look. Either numeric (low, high, log, integer) or choices."""

    low: float | None = None
    high: float | None = None
    log: bool = False
    integer: bool = False
    choices: tuple[Any, ...] | None = None


@dataclass(frozen=True)
class Valid:
    """What validation accepts (the mathematically valid set, wider than the search range)."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    choices: tuple[Any, ...] | None = None

    def check(self, name: str, value: Any) -> None:
        if self.choices is not None:
            if value not in self.choices:
                raise ValueError(f"{name}={value!r} is not one of {list(self.choices)}")
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{name} must be a number, got {type(value).__name__} {value!r}")
        if math.isnan(value):
            raise ValueError(f"{name} must be a number, got nan")
        lo_ok = self.low is None or (value > self.low if self.low_open else value >= self.low)
        hi_ok = self.high is None or (value < self.high if self.high_open else value <= self.high)
        if not (lo_ok and hi_ok):
            lo = "(-inf" if self.low is None else ("(" if self.low_open else "[") + f"{self.low:g}"
            hi = "inf)" if self.high is None else f"{self.high:g}" + (")" if self.high_open else "]")
            raise ValueError(f"{name}={value!r} is out of range: must be in {lo}, {hi}")


def knob(
    default: Any,
    *,
    valid: Valid,
    search: SearchRange | None = None,
    doc: str = "",
) -> Any:
    """A config field with its valid set and (optional) search range recorded as metadata."""
    return field(default=default, metadata={"valid": valid, "search": search, "doc": doc})


class PolicyConfig:
    """Mixin for frozen config dataclasses: validates every knob in ``__post_init__``."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
            if kind == "int":
                if isinstance(value, float) and value.is_integer():
                    value = int(value)  # 5.0 from a JSON/CLI source means 5
                if isinstance(value, bool) or not isinstance(value, int):
                    raise ValueError(f"{f.name} must be an integer, got {value!r}")
            elif kind == "float" and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            object.__setattr__(self, f.name, value)
            valid = f.metadata.get("valid")
            if valid is not None:
                valid.check(f.name, value)
        self.validate()

    def validate(self) -> None:
        """Cross-field checks; override where knobs constrain each other."""

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # type: ignore[arg-type]

    @classmethod
    def search_space(cls) -> dict[str, SearchRange]:
        return {
            f.name: f.metadata["search"]
            for f in dataclasses.fields(cls)  # type: ignore[arg-type]
            if f.metadata.get("search") is not None
        }


# --------------------------------------------------------------------------------------------
# The policy object.


class Policy(Protocol):
    name: str
    config: Any

    def decide(self, batch: VerifyBatch) -> Decision: ...


DecideFn = Callable[[VerifyBatch, Any], Decision]


@dataclass(frozen=True)
class Rule:
    """A registered rule bound to a validated config. Implements :class:`Policy`."""

    name: str
    config: Any
    fn: DecideFn = field(repr=False, compare=False)

    def decide(self, batch: VerifyBatch) -> Decision:
        decision = self.fn(batch, self.config)
        b, n = batch.draft_token_ids.shape
        if decision.accepted.shape != (b, n) or decision.accepted.dtype != torch.bool:
            raise AssertionError(
                f"policy {self.name!r} returned accepted {tuple(decision.accepted.shape)} "
                f"{decision.accepted.dtype}, expected ({b}, {n}) bool"
            )
        return decision

    def describe(self) -> dict[str, Any]:
        return {"policy": self.name, "params": self.config.to_dict()}


