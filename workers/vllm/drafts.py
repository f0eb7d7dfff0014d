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


def first_call_of_propose(proposer: Any) -> bool:
    """Whether this ``_sample_draft_tokens`` call is the first of its ``propose``: vLLM's proposer calls it K times
    per propose (K = ``num_speculative_tokens``; once where it drafts every position in one pass) and stacks
    what the calls return, so the plugin decides once per propose what kind they all return."""
    k = 1 if getattr(proposer, "parallel_drafting", False) else max(1, int(getattr(proposer, "num_speculative_tokens",
                                                                                   1) or 1))
    i = int(getattr(proposer, "_spectune_call", 0)) % k
    proposer._spectune_call = i + 1
    return i == 0


def drafts_for_rules(proposer: Any, logits: torch.Tensor, sampling_metadata: Any, step: Any) -> tuple[Any, Any]:
    """The draft tokens, drawn as vLLM draws them, and the distribution the rules get: the drafter's logits
    divided by T as vLLM divides them (:func:`scaled_as_vllm`), or the T = 1 logits for greedy drafts."""
    from workers.vllm.step import _warn_once

    width = getattr(proposer, "_spectune_vocab", None)
    if width is None:
        width = proposer._spectune_vocab = int(proposer.vllm_config.model_config.get_vocab_size())
    if int(logits.shape[-1]) != width:
        # q must be over the target's ids: an EAGLE-3 head's reduced vocabulary is mapped onto them by its
        # compute_logits (-inf outside), a narrower draft model's padded (_PaddedLogits); anything else is a
        # drafter spectune does not know: its drafts go unjudged (failed_draft), never misread
        raise ValueError(f"the drafter's logits are {int(logits.shape[-1])} wide, the target scores {width} ids")
    probs = None
    if not (sampling_metadata.all_greedy or not getattr(proposer, "_enable_probabilistic_draft_probs", False)):
        # vLLM samples from softmax(logits / T), the division in the logits' dtype (bf16 on GPUs), in
        # place: the rules get the same division, made on a copy first; vLLM's float32 probs go
        scaled = scaled_as_vllm(logits, sampling_metadata.temperature)
        tokens, probs = proposer._sample_from_logits(logits, sampling_metadata)
    if probs is None:
        tokens = logits.argmax(dim=-1)
        scaled = logits  # greedy drafts: the T = 1 logits, as they are
        # greedy drafting (draft_sample_method "greedy") while some request samples: these argmax
        # drafts were not drawn from q, so the T > 0 requests must not be judged with it (decide_step)
        step.greedy_drafts = not sampling_metadata.all_greedy
        if step.greedy_drafts:
            _warn_once("greedy drafting with T > 0 requests", "speculative_config draft_sample_method is not "
                       "'probabilistic': T > 0 requests get no draft distribution (q one-hot at the argmax "
                       "draft); rules that read q fall back to the lossless rule", fallback=False)
    else:
        step.greedy_drafts = False
        del probs
    # a padded draft's missing ids are -inf already (_PaddedLogits), so q = 0 there exactly
    step.draft_scaled = True
    proposer._spectune_like = (int(scaled.shape[-1]), scaled.dtype)  # what a later failed call of it returns
    return tokens, scaled


def failed_draft(proposer: Any, hidden_states: torch.Tensor, logits: torch.Tensor | None, step: Any
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What a call of a propose in the rules' mode returns when drafting failed (or an earlier call of the same
    propose failed before it had any distribution): the same kind as the propose's other calls, so vLLM's stack
    of them neither mixes kinds nor meets a None where it expects a tensor (an engine death), and the proposer
    marked (``_spectune_failed``): the next verify step judges these drafts by no rule, as placeholders."""
    proposer._spectune_failed = True
    tokens = logits.argmax(dim=-1) if logits is not None else torch.zeros(
        hidden_states.shape[0], dtype=torch.long, device=hidden_states.device)
    like = getattr(proposer, "_spectune_like", None)
    first = int(getattr(proposer, "_spectune_call", 1)) == 1
    if first or like is None or proposer._spectune_mode == "failed":
        proposer._spectune_mode = "failed"  # no call of this propose returns a distribution: vLLM stacks none
        return tokens, None
    return tokens, logits if logits is not None else hidden_states.new_zeros((hidden_states.shape[0], like[0]),
                                                                             dtype=like[1])
