"""The models' heads across vLLM's processes: a narrower draft's logits padded to the target's width (and
the target's masked past it), the target's LM head gathered whole under tensor parallelism (once, at the
first step, by every rank; never inside a rule) and rank 0's output tokens broadcast to every rank.
:mod:`workers.vllm.plugin` wires them into vLLM."""

from __future__ import annotations

from typing import Any

import torch

from workers.vllm.settings import PAD_ATTR
from workers.vllm.step import _warn_once


def padded_draft_width(spec_config: Any) -> int:
    """The draft's logits width when spectune's engine asked vLLM to pad it: ``draft_model`` speculation, a
    draft narrower than the target, and the target's config naming exactly that width (:data:`PAD_ATTR`,
    set by :func:`workers.vllm.common.engine_kwargs`). 0 otherwise: vLLM's own rules apply."""
    target = getattr(spec_config, "target_model_config", None)
    draft = getattr(spec_config, "draft_model_config", None)
    if getattr(spec_config, "method", None) != "draft_model" or target is None or draft is None:
        return 0
    want = getattr(target.hf_config, PAD_ATTR, None)
    width, vocab = draft.get_vocab_size(), target.get_vocab_size()
    return int(width) if isinstance(want, int) and want == width < vocab else 0


def mask_from(model_config: Any) -> int:
    """Where the target's logits are masked to -inf (a padded draft's width; :data:`PAD_ATTR`), else 0."""
    want = getattr(getattr(model_config, "hf_config", None), PAD_ATTR, None)
    return int(want) if isinstance(want, int) and 0 < want < model_config.get_vocab_size() else 0


def pad_logits(logits: torch.Tensor | None, vocab: int) -> torch.Tensor | None:
    """A narrower draft's logits [rows, w] as [rows, vocab], -inf past w: softmax gives those ids exactly 0,
    argmax and sampling never pick them. None (a TP rank that gathered no logits) stays None."""
    if logits is None or logits.shape[-1] >= vocab:
        return logits
    return torch.nn.functional.pad(logits, (0, vocab - logits.shape[-1]), value=float("-inf"))


class _PaddedLogits:
    """The draft model's ``compute_logits``, padded to the target's width (:func:`pad_logits`)."""

    def __init__(self, compute: Any, vocab: int) -> None:
        self.compute, self.vocab = compute, vocab

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor | None:
        return pad_logits(self.compute(*args, **kwargs), self.vocab)


def _lm_head(model: Any, vocab: int, mask: int = 0, gather: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The target's LM head as [V, d] (+ bias). Under tensor parallelism each rank holds a vocabulary
    shard: the full head is all-gathered once, at the first step by :func:`gather_head_under_tp` (the only
    caller with ``gather``: every rank calls it there, so every rank joins the collective), and kept on the
    model (V x d per rank, ~0.5 GB for a 1.5B bf16 target). Inside a rule a shard is never gathered (one
    rank could be there alone): it raises, and DropMatch falls back to the lossless rule, counted. ``mask``:
    a padded draft's width; the bias is then -inf past it, as the target's logits are (:func:`mask_from`)."""
    cached = getattr(model, "_spectune_lm_head", None)
    if cached is not None:
        return cached
    failed = getattr(model, "_spectune_lm_head_error", None)
    if failed is not None:
        raise RuntimeError(f"spectune vLLM plugin: the LM head could not be gathered at the first step ({failed})")
    head = getattr(model, "lm_head", None)
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise RuntimeError("spectune vLLM plugin: the target model has no plain lm_head.weight tensor "
                           "(quantized head?); DropMatch cannot build its dropout heads")
    bias = getattr(head, "bias", None)
    bias = bias if isinstance(bias, torch.Tensor) else None
    if weight.shape[0] < vocab:  # a tensor-parallel shard of the (padded) vocabulary
        if not gather:
            raise RuntimeError("spectune vLLM plugin: the LM head is a tensor-parallel shard and was not gathered "
                               "at the first step; DropMatch cannot build its dropout heads")
        from vllm.distributed import tensor_model_parallel_all_gather

        weight = tensor_model_parallel_all_gather(weight.contiguous(), dim=0)
        bias = None if bias is None else tensor_model_parallel_all_gather(bias.contiguous(), dim=0)
        if weight.shape[0] < vocab:
            raise RuntimeError(f"spectune vLLM plugin: the gathered lm_head has {weight.shape[0]} of {vocab} rows")
    bias = None if bias is None else bias[:vocab]
    if 0 < mask < vocab:
        bias = (torch.zeros(vocab, dtype=weight.dtype, device=weight.device) if bias is None else bias.clone())
        bias[mask:] = float("-inf")
    result = (weight[:vocab], bias)
    model._spectune_lm_head = result
    return result


def _tp_group() -> Any:
    """vLLM's tensor-parallel group when it has more than one rank, else None (TP 1, or no vLLM group)."""
    try:
        from vllm.distributed.parallel_state import get_tp_group

        group = get_tp_group()
    except Exception:  # noqa: BLE001 - not initialised (tests, a process without a model): no TP
        return None
    return group if int(getattr(group, "world_size", 1) or 1) > 1 else None


TP_AGREEMENT = {"broadcasts": 0}  # this process's rank-0 broadcasts (WorkerExtension.spectune_env reports it)


def agree_across_ranks(output: torch.Tensor, group: Any) -> torch.Tensor:
    """Under TP (``group`` not None): every rank takes rank 0's output token ids [B, L + 1] int32 (one small
    broadcast per step). Each rank decides on its own (its own rule-file read, its own failures and
    fallbacks); without this a rank that fell back alone would emit other tokens than rank 0 and the
    ranks' KV caches and drafts would part. Every rank calls it once per verify step, whatever it decided,
    so the collective always matches."""
    if group is None:
        return output
    output = output.contiguous()
    agreed = group.broadcast(output, src=0)
    TP_AGREEMENT["broadcasts"] += 1
    return output if agreed is None else agreed


def needs_head(policies: list[Any]) -> bool:
    """Whether any of a step's rules (the rule file's, the requests' own) builds dropout heads from the LM head."""
    from workers.vllm.step import needs_hidden

    return any(p is not None and needs_hidden(p) for p in policies)


def gather_head_under_tp(model: Any, vocab: int, mask: int, group: Any) -> None:
    """Under TP, the target's full LM head (:func:`_lm_head`) gathered on every rank at the first step whose rules
    need it (:func:`needs_head`: DropMatch; every rank decides alike, from rank 0's rule and the same requests), for
    DropMatch's dropout heads: V x d x dtype bytes more per rank (bf16: 0.47 GB for Qwen2.5-1.5B, 1.09 GB
    for 7B, 2.5 GB for 72B; counted by :mod:`workers.vllm.memory`). A head that is not a plain tensor
    (quantized) is skipped on every rank alike (the same model everywhere); DropMatch then falls back.
    Never raises (it runs outside any rule's guard, and a raise here would stop the engine): a gather that
    fails (a short head, out of memory) is recorded on the model, and DropMatch then falls back to the
    lossless rule, counted, at every step on every rank, with no further collective."""
    if group is None or model is None or getattr(model, "_spectune_lm_head", None) is not None \
            or getattr(model, "_spectune_lm_head_error", None) is not None:
        return
    weight = getattr(getattr(model, "lm_head", None), "weight", None)
    if not isinstance(weight, torch.Tensor):
        return
    try:
        # every rank first tries to allocate what the gather will hold (the caching allocator keeps it for the
        # gather), then all agree: one rank short of memory must not leave the others alone in the collective
        ok = 1
        try:
            probe = torch.empty(weight.numel() * max(1, int(getattr(group, "world_size", 1))) * weight.element_size(),
                                dtype=torch.uint8, device=weight.device)
            del probe
        except RuntimeError:  # torch.cuda.OutOfMemoryError is one
            ok = 0
        short = group.all_reduce(torch.tensor([1 - ok], dtype=torch.int32, device=weight.device))
        if int(short.reshape(-1)[0]) > 0:  # once per engine: the only device read of this path
            raise RuntimeError(f"{int(short.reshape(-1)[0])} rank(s) could not allocate the gathered head")
        _lm_head(model, vocab, mask, gather=True)
    except Exception as err:  # noqa: BLE001 - never a dead engine; every rule that needs the head falls back
        model._spectune_lm_head_error = f"{type(err).__name__}: {err}"
        _warn_once("the LM head could not be gathered under tensor parallelism", model._spectune_lm_head_error,
                   fallback=True)
