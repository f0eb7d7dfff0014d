"""Top-k and top-p (nucleus) truncation of a sampling distribution, as a deployment samples at T > 0.

``truncate(logits, temperature, top_k, top_p)`` returns the logits with every token outside the truncation set
at -inf, unscaled: ``softmax(truncated / T)`` is the distribution the deployment samples from (renormalised over the
set), and every rule that reads the logits sees exactly that distribution. The order is vLLM's: temperature, then
top-k, then top-p over the top-k distribution.

- top-k keeps every token whose logit is at least the k-th largest (ties at the boundary all kept: the set depends
  on the values alone, not on a sort's order); ``top_k = 0`` keeps all;
- top-p keeps the smallest prefix of the tokens sorted by probability (largest first) whose mass reaches ``top_p``:
  a token is kept when the mass before it is below ``top_p`` (the first token always is); tokens of equal
  probability are ordered by id (a stable sort: the same set in any batch); ``top_p = 1`` keeps all.

Greedy decoding (T = 0) takes the argmax, which every truncation keeps: the engines apply none there.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def check_truncation(top_k: object, top_p: object) -> tuple[int, float]:
    """``(top_k, top_p)`` validated: top_k an integer >= 0 (0: off), top_p a number in (0, 1] (1: off)."""
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0: no top-k), got {top_k!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, int | float) or not (0.0 < float(top_p) <= 1.0) \
            or math.isnan(float(top_p)):
        raise ValueError(f"top_p must be in (0, 1] (1: no top-p), got {top_p!r}")
    return top_k, float(top_p)


def truncates(top_k: int, top_p: float) -> bool:
    return top_k > 0 or top_p < 1.0


def truncate(logits: Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """``logits`` ``[..., V]`` with the tokens outside the top-k / top-p set at -inf (a new tensor in float32;
    ``logits`` itself where nothing truncates or T = 0)."""
    if temperature == 0.0 or not truncates(top_k, top_p):
        return logits
    out = logits.float().clone()
    v = out.shape[-1]
    if 0 < top_k < v:
        kth = out.topk(top_k, dim=-1).values[..., -1:]
        out.masked_fill_(out < kth, -math.inf)
    if top_p < 1.0:
        probs = torch.softmax(out / temperature, dim=-1)  # over the whole row: the sums every path shares
        if 0 < top_k < v:  # only the top-k set can be kept: sort its ids alone (~20 of ~150k)
            width = int((out > -math.inf).sum(dim=-1).max())  # k, or more where ties at the boundary stay
            ids = out.topk(width, dim=-1).indices.sort(dim=-1).values  # the set (and -inf fill) in id order
            out.masked_fill_(_top_p_drop(probs.gather(-1, ids), top_p, ids, v), -math.inf)
        else:
            out.masked_fill_(_top_p_drop(probs, top_p, None, v), -math.inf)
    return out


def _top_p_drop(probs: Tensor, top_p: float, ids: Tensor | None, vocab: int) -> Tensor:
    """Boolean ``[..., vocab]``: the tokens top-p drops, from ``probs`` over ``ids`` (each row's ids ascending;
    None: the whole vocabulary). A stable sort keeps equal probabilities in id order, and a row's cumulative sum runs
    in sequence in a wider accumulator, so the mass ahead of a token is the same number over a row's top-k ids as over
    the whole vocabulary (its other tokens hold probability 0 and sort after): one set either way, bit for bit."""
    order = torch.sort(probs, dim=-1, descending=True, stable=True)
    before = order.values.cumsum(dim=-1) - order.values  # the mass of the tokens ahead of each
    drop_sorted = before >= top_p
    drop_sorted[..., 0] = False
    where = order.indices if ids is None else ids.gather(-1, order.indices)
    return torch.zeros(*probs.shape[:-1], vocab, dtype=torch.bool, device=probs.device).scatter_(-1, where, drop_sorted)
