"""Distribution helpers shared by the rules. All in float32, all batched over leading dims.

Divergences and entropies use plain softmax of the logits (T = 1); sampling uses T.
"""

from __future__ import annotations

import torch
from torch import Tensor

from policies.core import as_float
from policies.randomness import sample_rows


def log_probs(logits: Tensor) -> Tensor:
    return torch.log_softmax(as_float(logits), dim=-1)


def entropy_from_logprobs(logp: Tensor, probs: Tensor | None = None) -> Tensor:
    """H(p) in nats over the last dim; 0·log 0 = 0. ``probs`` = exp(logp) if already at hand."""
    p = logp.exp() if probs is None else probs
    # 0 * -inf (a masked logit) would be nan: such terms are 0. Always, not after a check of the result:
    # that check is a host read (a GPU waits for it) in every verify step.
    return -torch.linalg.vecdot(p, logp.nan_to_num(neginf=0.0))


def kl_from_logprobs(logp: Tensor, logq: Tensor, probs: Tensor | None = None) -> Tensor:
    """KL(p ‖ q) in nats over the last dim; terms with p = 0 contribute 0."""
    p = logp.exp() if probs is None else probs
    # Where p = 0 — a masked logit, or one so far below the rest that p underflows — the term is 0 whatever
    # the difference is (-inf, nan, or +inf where q = 0 too: 0 * inf would be nan). Where p > 0 and q = 0 it
    # is +inf: KL is infinite, as it should be. In place on the one temporary, and always, not after a
    # check of the result (a host read that a GPU waits for in every verify step).
    diff = (logp - logq).masked_fill_(p == 0, 0.0)
    return torch.linalg.vecdot(p, diff).clamp_min(0.0)


def js_from_probs(p: Tensor, q: Tensor) -> Tensor:
    """Jensen-Shannon divergence in nats over the last dim (broadcasting), in [0, ln 2]."""
    m = 0.5 * (p + q)
    logm = m.clamp_min(1e-38).log()

    def half(a: Tensor) -> Tensor:
        return torch.where(a > 0, a * (a.clamp_min(1e-38).log() - logm), torch.zeros_like(a)).sum(-1)

    return (0.5 * half(p) + 0.5 * half(q)).clamp_min(0.0)


def sampling_probs(logits: Tensor, temperature: float) -> Tensor:
    """softmax(logits / T) in float32; T must be > 0."""
    return torch.softmax(as_float(logits) / temperature, dim=-1)


def gather_last(x: Tensor, index: Tensor) -> Tensor:
    """x[..., index] for an index with x's leading shape: [..., V] x [...] -> [...]."""
    return x.gather(-1, index.unsqueeze(-1)).squeeze(-1)


SEGMENT = 64  # top_ids: entries per segment


def top_ids(x: Tensor, k: int) -> Tensor:
    """The ids of the ``k`` largest entries along the last dim of ``x`` ``[..., V]``, largest first: the same
    set as ``x.topk(k).indices`` (which of equal entries is taken, and their order, may differ), without a
    selection over the whole vocabulary (``torch.topk`` on CPU costs several times a maximum's pass).

    The row is cut into segments of 64 consecutive ids; the k segments with the largest maxima hold every
    one of the k largest entries (an entry of any other segment has k segment maxima at least as large above
    it: k entries), so the selection runs over their ``64·k`` entries (and the ``V mod 64`` ids past the
    last full segment) after one vectorised pass of maxima. NaN entries count as largest, as in
    ``torch.topk``."""
    v = x.shape[-1]
    segments = v // SEGMENT
    if k > segments // 4 or x.stride(-1) != 1:
        return x.topk(k, dim=-1).indices  # small vocabularies: nothing to save
    main = segments * SEGMENT
    blocks = x[..., :main].unflatten(-1, (segments, SEGMENT))  # [..., S, 64] (a view, no copy)
    best = blocks.amax(dim=-1).topk(k, dim=-1).indices  # [..., k] the segments with the largest maxima
    pool = blocks.gather(-2, best.unsqueeze(-1).expand(*best.shape, SEGMENT)).flatten(-2)  # [..., 64·k]
    ids = (best.unsqueeze(-1) * SEGMENT + torch.arange(SEGMENT, device=x.device)).flatten(-2)
    if main < v:
        tail = torch.arange(main, v, device=x.device).expand(*ids.shape[:-1], v - main)
        ids = torch.cat([ids, tail], dim=-1)
        pool = torch.cat([pool, x[..., main:]], dim=-1)
    return ids.gather(-1, pool.topk(k, dim=-1).indices)


def sample_from_probs(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """One categorical draw per row of a [N, V] probability matrix (rows need not be normalized): inverse
    CDF at one uniform per row (``torch.multinomial`` would wait on the host twice per call on a GPU)."""
    return sample_rows(probs, torch.rand(probs.shape[:-1], generator=generator, device=probs.device))
