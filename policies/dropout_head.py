"""The MC-dropout LM head behind DropMatch: K dropout masks on the target's final hidden state,
pushed through the target's LM head in one batched matmul.

Head i's logits are W·(h ⊙ m_i)/(1 − p_drop) + b with m_i ~ Bernoulli(1 − p_drop)^d. Two modes:

- ``exact``: all V logits per head: a [K·B·L, d] x [d, V] matmul (≈ K·L·V·d MACs).
- ``candidate``: only over a candidate set per position — the target's top-M tokens plus the
  draft token — i.e. a [K, d] x [d, M+1] matmul per position. The remaining vocabulary is one
  extra "rest" atom whose logit is the undropped target's log-mass outside the candidates
  (dropout leaves logits unbiased, so this is the expected rest logit to first order). All
  divergences and votes then run over these M+2 atoms. Agreement with ``exact`` is measured by
  ``python -m jobs.bench.rules``.

Random draws are made head by head (mask, then the sampling uniform) so that the first k heads
of a K-head draw are the k-head draw: raising K only adds heads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from policies.core import as_float
from policies.distributions import top_ids
from policies.randomness import sample_rows, uniform


@dataclass(frozen=True)
class DropoutHeads:
    logits: Tensor  # [K, B, L, A] float32 head logits at T = 1 over A atoms
    sample_logits: Tensor | None  # [K, B, L, A] logits for sampling at temperature T; None at T = 0
    atom_ids: Tensor | None  # [B, L, A] long token id of each atom (-1: rest); None means atom = token
    uniforms: Tensor | None  # [K, B, L] one U(0, 1) per head and position, for sampling at T > 0


def draw_head_randomness(
    k: int, batch_size: int, draft_len: int, hidden_size: int, p_drop: float, sampling: bool,
    generator: torch.Generator | None, device: torch.device, streams: Any = None,
) -> tuple[Tensor | None, Tensor | None]:
    """Keep-masks [K, B, L, d] bool (None when p_drop = 0) and uniforms [K, B, L] (None at T = 0).

    From ``generator``: head by head (mask, then uniform). From the rows' own ``streams``
    (policies.randomness.RowStreams): two draws, all K masks (16-bit numbers: a mask only compares them
    with p_drop) then all K uniforms, each head numbered on its own. Either way the first k heads of a
    K-head draw are the k-head draw, and with streams a position's numbers do not depend on the draft
    length either (a request padded in a ragged batch draws what it draws alone)."""
    if streams is not None:
        keep = None
        if p_drop > 0.0:
            draw = uniform((batch_size, k, draft_len, hidden_size), generator, device, streams, bits=16, heads=True)
            keep = (draw >= p_drop).transpose(0, 1)
        u = None
        if sampling:
            u = uniform((batch_size, k, draft_len), generator, device, streams, heads=True).transpose(0, 1)
        return keep, u
    masks, uniforms = [], []
    for _ in range(k):
        if p_drop > 0.0:
            masks.append(torch.rand((batch_size, draft_len, hidden_size), generator=generator, device=device) >= p_drop)
        if sampling:
            uniforms.append(torch.rand((batch_size, draft_len), generator=generator, device=device))
    return (torch.stack(masks) if masks else None), (torch.stack(uniforms) if uniforms else None)


def _dropped_hidden(hidden: Tensor, keep: Tensor, p_drop: float, dtype: torch.dtype) -> Tensor:
    """[B, L, d] x [K, B, L, d] -> [K, B, L, d] in the LM head's dtype."""
    scale = torch.tensor(1.0 / (1.0 - p_drop), dtype=dtype)
    return hidden.to(dtype).unsqueeze(0) * keep.to(dtype) * scale


def _rest_logit(target_lse: Tensor, cand_target: Tensor, temperature: float) -> Tensor:
    """log Σ_{v ∉ candidates} exp(z_v / T): [B, L], from the full log-partition ``target_lse`` at T (the
    batch's, shared with the lossless fallback). -inf when candidates hold all the mass."""
    lse_cand = torch.logsumexp(cand_target / temperature, dim=-1)
    return target_lse + torch.log1p(-(lse_cand - target_lse).exp().clamp(max=1.0))


def dropout_heads(
    *,
    hidden: Tensor,  # [B, L, d] target final hidden states at the draft positions
    lm_head_weight: Tensor,  # [V, d]
    lm_head_bias: Tensor | None,  # [V]
    target_logits: Tensor,  # [B, L, V] the undropped logits at the same positions
    target_lse: Callable[[float], Tensor],  # T -> [B, L] log Σ exp(z / T) (VerifyBatch.target_lse)
    draft_token_ids: Tensor,  # [B, L]
    k: int,
    p_drop: float,
    mode: str,
    num_candidates: int,
    temperature: float,
    generator: torch.Generator | None,
    streams: Any = None,
) -> DropoutHeads:
    b, n, d = hidden.shape
    sampling = temperature > 0.0
    keep, uniforms = draw_head_randomness(k, b, n, d, p_drop, sampling, generator, hidden.device, streams)
    target = as_float(target_logits)
    if keep is None:
        # p_drop = 0: every head is the target's own head; no matmul needed and exact.
        logits = target.unsqueeze(0).expand(k, b, n, -1)
        return DropoutHeads(logits, logits / temperature if sampling else None, None, uniforms)

    if mode == "exact":
        dropped = _dropped_hidden(hidden, keep, p_drop, lm_head_weight.dtype)  # [K, B, L, d]
        logits = as_float(F.linear(dropped, lm_head_weight, lm_head_bias))  # [K, B, L, V]
        return DropoutHeads(logits, logits / temperature if sampling else None, None, uniforms)

    # candidate mode
    m = min(num_candidates, target.shape[-1])
    top = top_ids(target, m)  # [B, L, M] the target's top-M (the same set as topk's, cheaper on CPU)
    cand = torch.cat([top, draft_token_ids.unsqueeze(-1)], dim=-1)  # [B, L, C = M+1]
    duplicate = (top == draft_token_ids.unsqueeze(-1)).any(dim=-1)  # draft already in top-M
    slot_off = torch.zeros_like(cand, dtype=torch.bool)
    slot_off[..., -1] = duplicate
    cand_weight = lm_head_weight.index_select(0, cand.reshape(-1)).view(b, n, m + 1, d)  # [B, L, C, d]
    dropped = _dropped_hidden(hidden, keep, p_drop, lm_head_weight.dtype)  # [K, B, L, d]
    cand_logits = torch.einsum("kbld,blcd->kblc", dropped, cand_weight).float()  # [K, B, L, C]
    if lm_head_bias is not None:
        cand_logits = cand_logits + as_float(lm_head_bias)[cand]
    cand_logits = cand_logits.masked_fill(slot_off, float("-inf"))
    cand_target = target.gather(-1, cand).masked_fill(slot_off, float("-inf"))  # [B, L, C]

    def with_rest(head_logits: Tensor, temp: float) -> Tensor:
        rest = _rest_logit(target_lse(temp), cand_target, temp)  # [B, L]
        return torch.cat([head_logits, rest.expand(k, b, n).unsqueeze(-1)], dim=-1)

    atom_ids = torch.cat([cand, cand.new_full((b, n, 1), -1)], dim=-1)  # [B, L, C+1]
    logits = with_rest(cand_logits, 1.0)
    sample_logits = with_rest(cand_logits / temperature, temperature) if sampling else None
    return DropoutHeads(logits, sample_logits, atom_ids, uniforms)


def atoms_of(heads: DropoutHeads, draft_logp: Callable[[Tensor], Tensor] | Tensor) -> Tensor:
    """The draft's log-probabilities (T = 1) over the heads' atoms: [B, L, A]. ``draft_logp``: the full
    ``[B, L, V]`` log-probabilities, or a function from token ids ``[B, L, k]`` to theirs
    (:meth:`policies.core.VerifyBatch.draft_logp_at`: candidate mode then makes nothing of vocabulary size)."""
    full = draft_logp if isinstance(draft_logp, Tensor) else None
    if heads.atom_ids is None:
        if full is None:
            raise ValueError("exact mode's atoms are the whole vocabulary: pass the full draft log-probabilities")
        return full
    cand = heads.atom_ids[..., :-1]
    slot_off = torch.isneginf(heads.logits[0, ..., :-1])  # the duplicate draft slot
    picked = full.gather(-1, cand) if full is not None else draft_logp(cand)  # type: ignore[operator]
    cand_logp = picked.masked_fill(slot_off, float("-inf"))
    rest = torch.log1p(-torch.logsumexp(cand_logp, dim=-1).exp().clamp(max=1.0))
    return torch.cat([cand_logp, rest.unsqueeze(-1)], dim=-1)


def head_tokens(heads: DropoutHeads) -> Tensor:
    """Each head's token per position: argmax at T = 0, an inverse-CDF sample at T > 0. [K, B, L]."""
    if heads.sample_logits is None:
        # The rest atom is a bucket of many tokens, not a token: its lumped logit usually beats
        # any single token's, so greedy heads pick among real candidates only.
        real = heads.logits if heads.atom_ids is None else heads.logits[..., :-1]
        atom = real.argmax(dim=-1)
    else:
        assert heads.uniforms is not None
        atom = sample_rows(torch.softmax(heads.sample_logits, dim=-1), heads.uniforms)  # [K, B, L]
    if heads.atom_ids is None:
        return atom
    k = atom.shape[0]
    return heads.atom_ids.unsqueeze(0).expand(k, *heads.atom_ids.shape).gather(-1, atom.unsqueeze(-1)).squeeze(-1)
