"""The drafter's side of a verify step: the draft distribution as spectune's rules get it (the drafter's logits
divided by T exactly as vLLM divides them) and the requests whose drafts vLLM filled with placeholders
because it skipped the drafter. :mod:`workers.vllm.plugin` calls these from its patches."""

from __future__ import annotations

from typing import Any

import torch


def scaled_as_vllm(logits: torch.Tensor, temperature: torch.Tensor | None) -> torch.Tensor:
    """The draft's logits divided by each row's temperature exactly as vLLM's drafter divides them before it
    draws from ``softmax(logits / T)`` (``compute_probs_and_sample_next_token``: greedy rows by 1, the
    division in place in the logits' dtype), on a copy made before vLLM divides its own: the rules' q at T
    is then softmax of these, the distribution the drafts were drawn from (to fp32 rounding), kept in the
    draft's dtype (bf16 on a GPU: half the bytes of a float32 distribution; vLLM's own float32 ``probs``
    is dropped). Rows are request-major when a request drafts several per pass (parallel drafting)."""
    if temperature is None:
        return logits.clone()
    t = temperature.to(logits.device)
    t = torch.where(t < 1e-5, 1.0, t)  # vLLM's greedy rows (_SAMPLING_EPS): divided by 1
    if t.shape[0] != logits.shape[0]:
        t = t.repeat_interleave(logits.shape[0] // t.shape[0])
    return logits.clone().div_(t.view(-1, 1))


def note_drafter(runner: Any, fits: bool) -> None:
    """After a step's verification, vLLM decides whether to run the drafter (``_input_fits_in_drafter``):
    near ``max_model_len`` it skips it for the whole batch and fills the next step's drafts with token
    id 0 and no draft distribution. Remember which requests got such placeholders (``_spectune_skipped``;
    a later step that drafts for them forgets them; finished requests are dropped), so the rules never
    judge them (:func:`~workers.vllm.step.decide_step`'s ``skipped``)."""
    skipped = set(getattr(runner, "_spectune_skipped", None) or ())
    current = set(runner.input_batch.req_ids)
    skipped = (skipped | current) if not fits else (skipped - current)
    live = getattr(runner, "requests", None)
    runner._spectune_skipped = skipped & set(live) if isinstance(live, dict) else skipped
