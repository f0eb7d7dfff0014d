"""Rules over a ragged, flat batch: vLLM's layout for a verify step.

vLLM flattens a step's draft positions over requests: request i owns rows
``[cu[i] - n_i, cu[i])`` of ``[num_tokens, V]`` tensors, with ``n_i`` draft tokens (0 for a request
that drafted nothing this step). :func:`verify_flat` lays those rows out as one padded
:class:`VerifyBatch` ``[B, L_max(+1), ...]`` with a single gather (no per-token loop), runs the rule
once, masks the padding, and returns vLLM's output layout: per request the accepted draft tokens
verbatim, then one emitted token — the recovered token at the first rejection, or the caller's
bonus token when all ``n_i`` drafts were accepted — and ``-1`` after it.

Padding rows repeat a request's own rows (or row 0), so every rule sees finite inputs; positions
``>= n_i`` are forced to "rejected" before the leading run is taken, so padding never changes a
decision. Requests are processed in chunks so the padded target block stays bounded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from policies import fused
from policies.core import Policy, VerifyBatch, as_float
from policies.emission import emit_tokens, leading_run
from policies.registry import traits

CHUNK_ELEMENTS = 1 << 26  # padded [B, L+1, V] float32 block per chunk on a GPU: at most 256 MiB
# On CPU the eager kernels' passes over the block run at cache speed only when it is small: 8 MiB blocks
# (two requests at L 5, V 152k). A rule whose full-vocabulary work is the fused statistics kernel's
# (its declared ``Traits.cpu_block``, with the kernel on) reads the block in few passes and its per-chunk work
# (DropMatch's heads, streams, emission) dominates: 32 MiB blocks (nine requests), just under the size above
# which glibc maps every temporary afresh (workers.host_memory). ``python -m jobs.bench.step --chunk-mib 8
# --chunk-mib 32`` times both. DropMatch's candidate mode ("heads") with the fused kernel: 128 MiB blocks
# (36 requests). Its per-chunk work is ~1,000 small tensor ops (heads, candidates, streams), each an OpenMP
# region whose threads spin after it: on a CPU shared with other busy processes every region can cost a time
# slice, so fewer chunks decide faster there (4.6x -> 2.7x the greedy group at B 256) and no slower on an idle
# one, its blocks being read by the fused kernel and the heads' matmuls, not by eager passes
# (docs/measurements.md).
CHUNK_ELEMENTS_CPU = 1 << 21
CHUNK_ELEMENTS_CPU_FUSED = 1 << 23
CHUNK_ELEMENTS_CPU_HEADS = 1 << 25


@dataclass(frozen=True)
class FlatVerification:
    output_token_ids: Tensor  # [B, L_max + 1] long, -1 padded
    num_accepted: Tensor  # [B] long
    accepted: Tensor  # [B, L_max] bool: the rule's per-position decision, padding False


def ragged_index(num_draft_tokens: Tensor, max_len: int) -> tuple[Tensor, Tensor]:
    """Row index [B, max_len] into the flat rows (padding repeats the request's last row, or row 0
    when it has none) and the validity mask [B, max_len]."""
    num = num_draft_tokens.to(torch.long)
    start = torch.cumsum(num, 0) - num  # [B]
    pos = torch.arange(max_len, device=num.device).unsqueeze(0)  # [1, L]
    valid = pos < num.unsqueeze(1)
    last = (start + num - 1).clamp(min=0).unsqueeze(1)
    index = torch.where(valid, start.unsqueeze(1) + pos, last)
    return index, valid


def _gather(flat: Tensor | None, index: Tensor) -> Tensor | None:
    if flat is None:
        return None
    b, n = index.shape
    return flat.index_select(0, index.reshape(-1)).view(b, n, *flat.shape[1:])


def _target_block(flat: Tensor, index: Tensor, first_row: int | None) -> Tensor:
    """The target's ``[b, L+1, V]`` block of a chunk, laid out so that its draft positions ``[:, :L]`` are
    *contiguous*: every rule's passes over them (softmax, log-softmax, argmax, top-k) would first copy a
    strided ``[:, :-1]`` view. The block is a strided view of ``b·L + 1`` rows: request i's bonus slot (never
    read for a decision; the emission replaces whatever it reads there by the bonus token) aliases request
    i+1's first row, and the last request's is the one extra row. ``first_row``: the chunk's rows are the
    ``b·L + 1`` consecutive flat rows from there (every request drafted L, and a row follows the chunk), so
    the block is a view of ``flat`` itself, no copy. Read only: nothing writes into a verify batch."""
    b, n = index.shape
    v = flat.shape[1]
    if first_row is not None and flat.is_contiguous():
        storage = flat[first_row:first_row + b * n + 1]
    else:
        storage = flat.index_select(0, torch.cat([index.reshape(-1), index[-1, -1:]]))  # [b·L + 1, V]
    storage = as_float(storage)  # upcast here (bf16 logits): after the view it would copy the aliased block
    return storage.as_strided((b, n + 1, v), (n * v, v, 1))


def verify_flat(
    policy: Policy,
    *,
    draft_token_ids: Tensor,  # [N] draft tokens, request-major
    num_draft_tokens: Tensor,  # [B] drafts per request (sum = N)
    target_logits: Tensor,  # [N, V] target logits at the draft positions (raw, T = 1)
    bonus_token_ids: Tensor,  # [B] the token emitted when every draft is accepted
    draft_logits: Tensor | None = None,  # [N, V] (log-probabilities are fine: rules normalize)
    target_hidden: Tensor | None = None,  # [N, d] target final hidden states at the draft positions
    lm_head_weight: Tensor | None = None,
    lm_head_bias: Tensor | None = None,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    chunk_elements: int | None = None,  # default: CHUNK_ELEMENTS on a GPU, CHUNK_ELEMENTS_CPU(_FUSED) on CPU
    lengths: list[int] | None = None,  # num_draft_tokens as host ints, when the caller has them
    streams: Any = None,  # policies.randomness.RowStreams, one row per request: draws from these, not generator
    draft_scaled: bool = False,  # draft_logits are already divided by the temperature (VerifyBatch)
) -> FlatVerification:
    """``lengths`` spares the two device-to-host reads (the sum check and the longest draft) that a GPU
    would wait for; vLLM hands its caller the draft counts as a host list anyway."""
    b = int(num_draft_tokens.shape[0])
    n_flat = int(draft_token_ids.shape[0])
    total = sum(lengths) if lengths is not None else int(num_draft_tokens.sum())
    if (lengths is not None and len(lengths) != b) or total != n_flat or target_logits.shape[0] != n_flat:
        raise ValueError(f"ragged batch mismatch: {n_flat} draft tokens, num_draft_tokens sums to "
                         f"{total}, target_logits has {target_logits.shape[0]} rows")
    max_len = (max(lengths, default=0) if lengths is not None else int(num_draft_tokens.max())) if b else 0
    device = draft_token_ids.device
    out = torch.full((b, max_len + 1), -1, dtype=torch.long, device=device)
    num_accepted = torch.zeros(b, dtype=torch.long, device=device)
    accepted_all = torch.zeros((b, max_len), dtype=torch.bool, device=device)
    if b == 0:
        return FlatVerification(out, num_accepted, accepted_all)
    if max_len == 0 or n_flat == 0:
        out[:, 0] = bonus_token_ids.to(torch.long)
        return FlatVerification(out, num_accepted, accepted_all)

    vocab = target_logits.shape[1]
    # vLLM's speculative placeholders (-1: a position the scheduler reserved but nothing was drafted
    # for; the vLLM plugin also marks drafts the drafter skipped so) and any other id outside the
    # vocabulary are never accepted: the rule sees a valid id in their place (no out-of-bounds gather)
    # and the request's accepted run stops there, so the position gets the target's token — sampled
    # from p_t itself at T > 0, there being no draft to take a residual of. No host read (clamp and
    # compare on the device).
    draft_ok = (draft_token_ids >= 0) & (draft_token_ids < vocab)
    safe_ids = draft_token_ids.to(torch.long).clamp(0, vocab - 1)
    per_request = (max_len + 1) * vocab
    if chunk_elements is None:
        declared = traits(policy)
        big = declared.cpu_block != "eager" and fused.enabled(target_logits)
        chunk_elements = CHUNK_ELEMENTS if device.type != "cpu" else (
            (CHUNK_ELEMENTS_CPU_HEADS if declared.cpu_block == "heads" else CHUNK_ELEMENTS_CPU_FUSED) if big
            else CHUNK_ELEMENTS_CPU)
        if declared.vocab_heads:
            # a rule holding K full-vocabulary head logits of the chunk (DropMatch's exact mode; twice at T > 0: at
            # T = 1 and at T): the chunk shrinks with K so that they stay within one block (what the GPU memory
            # plan reserves)
            chunk_elements //= declared.vocab_heads * (2 if temperature > 0 else 1)
    step = max(1, chunk_elements // per_request)
    index_all, valid_all = ragged_index(num_draft_tokens, max_len)
    # Every request drafted L_max tokens (known from the host's lengths): a chunk's draft rows are a view
    # of the flat rows, no copy (the target block still gathers: it has a bonus slot).
    full = lengths is not None and all(n == max_len for n in lengths)
    for lo in range(0, b, step):  # chunks of requests, not tokens
        hi = min(b, lo + step)
        index, valid = index_all[lo:hi], valid_all[lo:hi]
        # The bonus slot (column L_max) is never read for a decision; repeat the last row there.
        index_plus = torch.cat([index, index[:, -1:]], dim=1)
        if full and draft_logits is not None:
            chunk_draft = draft_logits[lo * max_len:hi * max_len].reshape(hi - lo, max_len, -1)
        else:
            chunk_draft = _gather(draft_logits, index)
        batch = VerifyBatch(
            draft_token_ids=safe_ids[index],
            draft_logits=chunk_draft,
            target_logits=_target_block(target_logits, index, lo * max_len if full and hi < b else None),
            target_hidden=_gather(target_hidden, index_plus),
            lm_head_weight=lm_head_weight,
            lm_head_bias=lm_head_bias,
            temperature=temperature,
            generator=generator,
            streams=None if streams is None else streams.rows(lo, hi),
            draft_scaled=draft_scaled,
            draft_valid=valid & draft_ok[index],
        )
        decision = policy.decide(batch)
        accepted = decision.accepted & valid & draft_ok[index]
        n_acc = leading_run(accepted)  # [b]
        n_draft = num_draft_tokens[lo:hi].to(torch.long)
        no_draft = (~draft_ok[index]).gather(1, n_acc.clamp(max=max_len - 1).unsqueeze(1)).squeeze(1)
        emitted = emit_tokens(batch, n_acc, num_draft=n_draft, no_draft=no_draft & (n_acc < n_draft))
        emitted = torch.where(n_acc >= n_draft, bonus_token_ids[lo:hi].to(torch.long), emitted)
        positions = torch.arange(max_len + 1, device=device).unsqueeze(0)
        padded = torch.cat([batch.draft_token_ids, batch.draft_token_ids.new_full((hi - lo, 1), -1)], dim=1)
        rows = torch.where(positions < n_acc.unsqueeze(1), padded, torch.full_like(padded, -1))
        rows[torch.arange(hi - lo, device=device), n_acc] = emitted
        out[lo:hi] = rows
        num_accepted[lo:hi] = n_acc
        accepted_all[lo:hi] = accepted
    return FlatVerification(out, num_accepted, accepted_all)
