"""Seeded synthetic verify batches with internally consistent logits (target = LM head(hidden))."""

from __future__ import annotations

import torch

from policies import VerifyBatch


def make_batch(
    *,
    seed: int = 0,
    batch_size: int = 3,
    draft_len: int = 5,
    vocab: int = 64,
    hidden: int = 16,
    temperature: float = 0.0,
    draft_noise: float = 1.0,
    scale: float = 1.0,
    generator_seed: int = 1234,
    with_draft_logits: bool = True,
    with_hidden: bool = True,
) -> VerifyBatch:
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, hidden, generator=g) * scale / hidden**0.5  # [V, d]
    bias = torch.randn(vocab, generator=g) * 0.1
    target_hidden = torch.randn(batch_size, draft_len + 1, hidden, generator=g) * 2.0  # [B, L+1, d]
    target_logits = target_hidden @ weight.T + bias  # [B, L+1, V]
    draft_logits = target_logits[:, :-1] + draft_noise * torch.randn(batch_size, draft_len, vocab, generator=g)
    if temperature == 0.0:
        draft_ids = draft_logits.argmax(-1)
    else:
        probs = torch.softmax(draft_logits / temperature, -1).reshape(-1, vocab)
        draft_ids = torch.multinomial(probs, 1, generator=g).view(batch_size, draft_len)
    return VerifyBatch(
        draft_token_ids=draft_ids,
        draft_logits=draft_logits if with_draft_logits else None,
        target_logits=target_logits,
        target_hidden=target_hidden if with_hidden else None,
        lm_head_weight=weight if with_hidden else None,
        lm_head_bias=bias if with_hidden else None,
        temperature=temperature,
        generator=torch.Generator().manual_seed(generator_seed),
    )


def reseeded(batch: VerifyBatch, seed: int = 1234) -> VerifyBatch:
    """The same batch with a fresh generator at a known state."""
    from dataclasses import replace

    return replace(batch, generator=torch.Generator().manual_seed(seed))


def peaked(token_ids: list[list[int]], vocab: int) -> torch.Tensor:
    """Logits whose argmax is known: 100 at the wanted id, -100 elsewhere. [B, N] -> [B, N, V]."""
    ids = torch.tensor(token_ids)
    logits = torch.full((*ids.shape, vocab), -100.0)
    logits.scatter_(-1, ids.unsqueeze(-1), 100.0)
    return logits
