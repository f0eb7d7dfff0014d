"""The shared emission step: from per-position decisions to the tokens a verify step emits.

Keep the leading run of accepted draft tokens (n of them), then emit one more token: the
recovered token at position n if n < L, or the bonus token at position L if all L were accepted.
T = 0: argmax of the target logits there. T > 0: a rejected position samples
norm(max(0, p_t - q)) (p_t if that is all zero; q one-hot at the draft token when the drafter has
no distribution), the bonus slot samples p_t; under the coupled sampler (``policies.coupling``) the emitted token
is the target's Gumbel-max token there, whatever was rejected. Only the one emitted row per sequence is
normalized, never the whole [B, L+1, V] block.
"""

from __future__ import annotations

import torch
from torch import Tensor

from policies.core import Decision, Policy, Verification, VerifyBatch
from policies.coupling import perturbed_argmax
from policies.distributions import sample_from_probs
from policies.randomness import sample_rows


def leading_run(accepted: Tensor) -> Tensor:
    """[B, L] bool -> [B] long: how many positions are accepted before the first rejection."""
    return accepted.to(torch.int32).cumprod(dim=1).sum(dim=1).to(torch.long)


def _row_at(x: Tensor, position: Tensor) -> Tensor:
    """x[b, position[b]] for each b: [B, N, V] x [B] -> [B, V] (gather: fast on CPU, unlike indexing)."""
    index = position.view(-1, 1, 1).expand(-1, 1, x.shape[-1])
    return x.gather(1, index).squeeze(1)


def emit_tokens(batch: VerifyBatch, num_accepted: Tensor, num_draft: Tensor | None = None,
                no_draft: Tensor | None = None) -> Tensor:
    """The token emitted after the accepted run, per sequence: [B] long. ``num_draft`` [B] gives
    ragged batches their own draft counts (a run that reaches it is not a rejection). ``no_draft`` [B]
    bool: the run stopped at a position that held no draft (a placeholder): the emitted token there is
    the target's own, p_t, not the residual of a draft that was never proposed."""
    b, n_draft = batch.draft_token_ids.shape
    target_rows = _row_at(batch.target_f32, num_accepted)  # [B, V]
    if batch.temperature == 0.0:
        return target_rows.argmax(dim=-1)
    if batch.coupling is not None:  # the coupled sampler: the target's own Gumbel-max token, accepted or not
        return perturbed_argmax(target_rows, batch.temperature, _row_at(batch.coupling, num_accepted))
    probs = torch.softmax(target_rows / batch.temperature, dim=-1)  # [B, V]
    rejected = num_accepted < (n_draft if num_draft is None else num_draft)  # [B]; False: bonus slot
    # every row, rejected or not (no host read of ``rejected``): [B, V] rows, small beside [B, L, V]
    pos = num_accepted.clamp(max=n_draft - 1)
    if batch.draft_logits is None:  # (not draft_f32: that would make the T = 1 view, a full pass)
        residual = probs.scatter(-1, batch.draft_token_ids.gather(1, pos.unsqueeze(1)), 0.0)
    else:
        draft_rows = _row_at(batch.draft_at(batch.temperature), pos)  # [B, V] at T
        draft_probs = torch.softmax(draft_rows, dim=-1)
        residual = (probs - draft_probs).clamp_min(0.0)
    usable = rejected & (residual.sum(dim=-1) > 0)
    if no_draft is not None:
        usable = usable & ~no_draft
    probs = torch.where(usable.unsqueeze(-1), residual, probs)
    if batch.streams is not None:  # each row from its own stream: inverse CDF, no generator, no multinomial
        return sample_rows(probs, batch.streams.uniform((probs.shape[0],)).to(probs.device))
    return sample_from_probs(probs, batch.generator)


def verify(policy: Policy, batch: VerifyBatch) -> Verification:
    """Decide, keep the leading accepted run, emit one more token. Output is -1 padded."""
    decision: Decision = policy.decide(batch)
    num_accepted = leading_run(decision.accepted)  # [B]
    emitted = emit_tokens(batch, num_accepted)  # [B]
    b, n_draft = batch.draft_token_ids.shape
    positions = torch.arange(n_draft + 1, device=num_accepted.device).unsqueeze(0)  # [1, L+1]
    padded_draft = torch.cat([batch.draft_token_ids, batch.draft_token_ids.new_full((b, 1), -1)], dim=1)
    out = torch.where(positions < num_accepted.unsqueeze(1), padded_draft, torch.full_like(padded_draft, -1))
    out[torch.arange(b), num_accepted] = emitted
    return Verification(output_token_ids=out, num_accepted=num_accepted, decision=decision)
