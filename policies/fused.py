"""The full-vocabulary statistics a verify step needs at T > 0, in one fused pass per block.

At a temperature T > 0 the lossless rule needs the log-partitions of the target and the draft at T; the
KL judge adds both at T = 1 and Σ p·(log p − log q); DropMatch's rest atom and candidate atoms need the
same log-partitions. Computed with torch's eager kernels, each is a pass of its own over the
``[B, L, V]`` block (log-softmax, max, division...), and on CPU each pass costs about what the greedy
step's whole argmax costs. :func:`row_stats` computes all of them from two maxima and one pass of sums
that reads each logit once, compiled by ``torch.compile`` (Inductor: a C++/OpenMP loop on CPU, Triton on
a GPU), with the temperature as a tensor so that no temperature compiles a kernel of its own.

For the target's logits z and the draft's logits g (``draft_scale``: the draft's T = 1 logits are
``c1·g`` and its logits at T are ``cT·g``), with ``e = exp(z − max z)``::

    target log Z_1 = max z + log Σ e               target log Z_T = max z / T + log Σ exp((z − max z) / T)
    draft  log Z_1 = c1·max g + log Σ exp(c1·(g − max g))     (the same at T with cT)
    KL(p_1 ‖ q_1) = Σ e·((z − max z) − c1·(g − max g)) / Σ e − log Σ e + log Σ exp(c1·(g − max g))
    max p_1 = 1 / Σ e

Terms with e = 0 (a masked logit) contribute 0 to the KL, as in :func:`policies.distributions.kl_from_logprobs`;
where the target has mass and the draft none (g = −inf) the KL is +inf.

Where it runs (:func:`enabled`): ``SPECTUNE_FUSED=auto`` (default) on CPU for vocabularies of at least
:data:`MIN_VOCAB` (a real model's; the tiny test pairs take the eager kernels), ``1`` everywhere (a GPU:
not measured yet), ``0`` never. The first call compiles (seconds; Inductor caches it on disk for later
processes); a compile or run that fails is reported once and the eager kernels decide from then on,
never a failed step. The choice is by vocabulary, never by batch size, so a request's numbers do not
depend on what shares its batch.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from policies.hashing import _gumbel_by_element, _numbers_by_element

ENV = "SPECTUNE_FUSED"
MIN_VOCAB = 32_768
# Rules whose full-vocabulary work is this kernel's (lossless, kl_judge, dropmatch) declare it
# (policies.registry.Traits.cpu_block): with the kernel on they take larger blocks on CPU (policies.ragged).
# The others still make eager passes (log-softmax, rank), which prefer small blocks.


@dataclass(frozen=True)
class RowStats:
    """Per row (every leading index of a ``[..., V]`` block): float32 ``[...]``; None where not computed."""

    target_lse1: Tensor | None  # log Σ exp(z)
    target_lse: Tensor | None  # log Σ exp(z / T)
    max_prob1: Tensor | None  # max softmax(z)
    draft_lse1: Tensor | None  # log Σ exp(draft's logits at T = 1)
    draft_lse: Tensor | None  # log Σ exp(draft's logits at T)
    kl1: Tensor | None  # KL(softmax(z) ‖ softmax(draft's logits at T = 1)), >= 0


def _shifted(x: Tensor) -> tuple[Tensor, Tensor]:
    """(max x, x − max x) over the last dim, in float32 (a bf16 draft upcast inside the loop, not by a pass)."""
    x = x.float()
    m = x.amax(dim=-1, keepdim=True)
    return m.squeeze(-1), x - m


def _log_sum_exp(shifted: Tensor, scale: Tensor) -> Tensor:
    return (shifted * scale).exp().sum(dim=-1).log()


def _stats(z: Tensor, g: Tensor | None, inv_t: Tensor, c1: Tensor, ct: Tensor, at_one: bool, at_t: bool
           ) -> tuple[Tensor | None, ...]:
    """(target lse at 1, target lse at T, max p at 1, draft lse at 1, draft lse at T, KL at 1): what
    ``at_one`` and ``at_t`` ask for, None for the rest. One function, compiled once per (kernel, flags)."""
    mz, dz = _shifted(z)
    lse1 = max_p = lse = d_lse1 = d_lse = kl = e = None
    if at_one:
        e = dz.exp()
        s1 = e.sum(dim=-1)
        max_p = s1.reciprocal()
        lse1 = mz + s1.log()
    if at_t:
        lse = mz * inv_t + _log_sum_exp(dz, inv_t)
    if g is not None:
        mg, dg = _shifted(g)
        if at_t:
            d_lse = mg * ct + _log_sum_exp(dg, ct)
        if at_one:
            log_sg1 = _log_sum_exp(dg, c1)
            d_lse1 = mg * c1 + log_sg1
            cross = torch.where(e > 0, e * (dz - dg * c1), 0.0).sum(dim=-1)
            kl = (cross * max_p + max_p.log() + log_sg1).clamp_min(0.0)  # cross / Σe − log Σe + log Σ exp(c1·dg)
    return lse1, lse, max_p, d_lse1, d_lse, kl


def _target_stats(z: Tensor, inv_t: Tensor) -> tuple[Tensor | None, ...]:
    return _stats(z, None, inv_t, inv_t, inv_t, True, True)


def _pair_stats(z: Tensor, g: Tensor, inv_t: Tensor, c1: Tensor, ct: Tensor) -> tuple[Tensor | None, ...]:
    return _stats(z, g, inv_t, c1, ct, True, True)


def _pair_at_t(z: Tensor, g: Tensor, inv_t: Tensor, ct: Tensor) -> tuple[Tensor | None, ...]:
    """What the lossless rule reads at T > 0: the two log-partitions at T (two exponentials per logit)."""
    return _stats(z, g, inv_t, ct, ct, False, True)


def _pair_at_one(z: Tensor, g: Tensor, c1: Tensor) -> tuple[Tensor | None, ...]:
    """Everything at T = 1 (a greedy step's KL judge, DropMatch js): no second temperature."""
    return _stats(z, g, c1, c1, c1, True, False)


def _stream_numbers(key: Tensor, n_heads: int, per_head: int, bits: int) -> Tensor:
    return _numbers_by_element(key, n_heads, per_head, bits)


def _gumbel_noise(keys: Tensor, vocab: int) -> Tensor:
    return _gumbel_by_element(keys, vocab)


KERNELS = {"target": _target_stats, "pair": _pair_stats, "pair_at_t": _pair_at_t, "pair_at_one": _pair_at_one,
           "streams": _stream_numbers, "gumbel": _gumbel_noise}


_lock = threading.Lock()
_compiled: dict[str, Any] = {}
_failed: list[str] = []  # why the fused kernels are off in this process (first failure), empty while they work
_streams_failed: list[str] = []  # the same for the random-stream kernel alone (its numbers equal the eager hash's)
CALLS = {"fused": 0, "streams": 0}  # blocks decided / random draws made by the fused kernels (a vLLM worker reports them)
# A random draw this large makes each of the eager hash's ~30 passes a parallel region of its own (ATen's grain:
# 32,768 elements); under OpenMP contention each such region can cost a scheduler time slice (docs/measurements.md,
# "Per-request DropMatch under contention"). Smaller draws stay eager: the same numbers, no compilation.
MIN_STREAM_NUMBERS = 1 << 15


_forced: list[str] = []  # forced(): a mode that overrides the environment (benchmarks, tests)


def mode() -> str:
    """``auto``, ``0`` or ``1``: :data:`ENV`, or what :func:`forced` set. ValueError naming the variable for
    anything else (the CPU and vLLM engines and ``jobs.bench.step`` call this at start, so a typo fails there,
    not once per step later)."""
    if _forced:
        return _forced[-1]
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value not in ("auto", "0", "1"):
        raise ValueError(f"{ENV} must be auto, 0 or 1, got {value!r}")
    return value


@contextmanager
def forced(value: str) -> Iterator[None]:
    """Decide with the fused kernels on (``"1"``), off (``"0"``) or as by default (``"auto"``) inside the
    block, whatever the environment says."""
    if value not in ("auto", "0", "1"):
        raise ValueError(f"a fused mode is auto, 0 or 1, got {value!r}")
    _forced.append(value)
    try:
        yield
    finally:
        _forced.pop()


def enabled(block: Tensor) -> bool:
    """Whether :func:`row_stats` should decide ``block`` (``[..., V]`` logits). Never raises (it runs inside
    verify steps): a bad :data:`ENV` value is reported once and means off."""
    if _failed:
        return False
    try:
        want = mode()
    except ValueError as err:
        _report(str(err))
        return False
    if want == "0":
        return False
    if want == "1":
        return True
    return block.device.type == "cpu" and block.shape[-1] >= MIN_VOCAB


def _kernel(name: str) -> Any:
    fn = _compiled.get(name)
    if fn is None:
        with _lock:
            fn = _compiled.get(name)
            if fn is None:
                fn = torch.compile(KERNELS[name], dynamic=True)
                _compiled[name] = fn
    return fn



def gumbel_noise(keys: Tensor, vocab: int) -> Tensor:
    """The coupled sampler's noise (:func:`policies.hashing._gumbel_by_element`), float32 ``[M, vocab]``, in one
    compiled pass where the fused kernels run and the vocabulary holds at least :data:`MIN_STREAM_NUMBERS` ids (by
    the vocabulary alone, so every block of one pair takes one path), else eagerly (about 15 passes). The hash is integer arithmetic and exact either way; the two logarithms may differ by an ulp between
    the compiled and the eager path, so every arm of a comparison should run where the same path does (one
    machine, this module's mode)."""
    if not _streams_failed and vocab >= MIN_STREAM_NUMBERS:  # by the vocabulary alone: one path for every block
        try:
            want = mode()
        except ValueError as err:
            _report(str(err))
            want = "0"
        if want != "0" and not (want == "auto" and keys.device.type != "cpu"):
            try:
                noise = _kernel("gumbel")(keys, vocab)
                CALLS["streams"] += 1
                return noise
            except Exception as err:  # noqa: BLE001 - no compiler, an Inductor bug: the eager passes instead
                _switch_off(_streams_failed, err, "the fused random-stream kernel failed ({}); the eager hash draws "
                            "from now on in this process (the same integers; a coupled sampler's noise may differ "
                            "by an ulp from what the compiled loop gave)")
    return _gumbel_by_element(keys, vocab)


def stream_numbers(key: Tensor, n_heads: int, per_head: int, bits: int) -> Tensor | None:
    """:class:`policies.randomness.RowStreams`' numbers of one draw, float32 ``[B, n_heads, per_head]``, in one
    compiled pass (bit for bit the eager hash's: integer arithmetic), where the fused kernels run (as
    :func:`enabled`, by device: ``auto`` on CPU) and the draw has at least :data:`MIN_STREAM_NUMBERS` numbers;
    else None, and the caller hashes with eager ops. A compile or run that fails is reported once and switches
    this kernel off in this process (the numbers are the same either way; the statistics kernels stay on)."""
    if _streams_failed or key.shape[0] * n_heads * per_head < MIN_STREAM_NUMBERS:
        return None
    try:
        want = mode()
    except ValueError as err:
        _report(str(err))
        return None
    if want == "0" or (want == "auto" and key.device.type != "cpu"):
        return None
    try:
        numbers = _kernel("streams")(key, n_heads, per_head, bits)
        CALLS["streams"] += 1
        return numbers
    except Exception as err:  # noqa: BLE001 - no compiler, an Inductor bug: the eager hash draws instead
        # the same numbers either way: only this kernel goes off (the statistics kernels' figures would change)
        _switch_off(_streams_failed, err, "the fused random-stream kernel failed ({}); the eager hash draws the same "
                    "numbers from now on in this process")
        return None


def failure() -> str | None:
    """Why the fused kernels were switched off in this process, or None."""
    return _failed[0] if _failed else None


def row_stats(target: Tensor, draft: Tensor | None, temperature: float, draft_scale: tuple[float, float] = (1.0, 1.0),
              at_t_only: bool = False) -> RowStats | None:
    """The statistics of ``target`` (float32 ``[..., V]`` logits at T = 1) and ``draft`` (logits of the same
    shape, any float dtype, or None) at ``temperature`` (T = 0: at T = 1 only), fused; ``draft_scale`` =
    (c1, cT), the factors that make the draft's logits at T = 1 and at T. ``at_t_only``: the two
    log-partitions at T > 0 alone (what the lossless rule reads: half the exponentials); the other fields
    are None then. None when the fused kernel failed (reported once): the caller computes them with the
    eager kernels."""
    dev = target.device
    sampling = temperature > 0.0
    inv_t = torch.tensor(1.0 / temperature if sampling else 1.0, dtype=torch.float32, device=dev)
    try:
        if draft is None:
            stats = RowStats(*_kernel("target")(target, inv_t))
        else:
            c1 = torch.tensor(draft_scale[0], dtype=torch.float32, device=dev)
            ct = torch.tensor(draft_scale[1], dtype=torch.float32, device=dev)
            if sampling and at_t_only:
                stats = RowStats(*_kernel("pair_at_t")(target, draft, inv_t, ct))
            elif not sampling:  # T = 0: the T = 1 statistics stand for both
                lse1, _, max_p, d_lse1, _, kl = _kernel("pair_at_one")(target, draft, c1)
                stats = RowStats(lse1, lse1, max_p, d_lse1, d_lse1, kl)
            else:
                stats = RowStats(*_kernel("pair")(target, draft, inv_t, c1, ct))
        CALLS["fused"] += 1
        return stats
    except Exception as err:  # noqa: BLE001 - no compiler, an Inductor bug: the eager kernels decide instead
        _switch_off(_failed, err, "the fused statistics kernel failed ({}); the eager kernels decide from now on in "
                    f"this process (slower, the same rules). {ENV}=0 skips the attempt")
        return None


def _switch_off(flag: list[str], err: Exception, message: str) -> None:
    """A kernel's first failure: recorded in ``flag`` (which switches it off) and reported once, ``message``'s
    ``{}`` naming the error."""
    if not flag:
        flag.append(f"{type(err).__name__}: {err}"[:500])
        _report(message.format(flag[0]))


_reported: set[str] = set()


def _report(message: str) -> None:
    if message not in _reported:
        _reported.add(message)
        logging.getLogger("spectune.policies").warning("spectune: %s", message)
