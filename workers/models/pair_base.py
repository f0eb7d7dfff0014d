"""What a model pair is, and the checks that finish building one: :class:`ModelPair` and :func:`finish_pair`.

Both builders of pairs use it: ``workers.models.pair`` (the real pair, local directories; it also names and
dispatches every pair, ``tiny-random`` included) and ``workers.models.tiny`` (the seeded ``tiny-random`` pair).
It lives apart from both so that neither imports the other back: ``pair`` calls ``tiny`` to build the tiny pair,
and ``tiny`` needs only what is here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

TINY_PAIR = "tiny-random"


@dataclass
class ModelPair:
    """A draft and a target causal LM over one vocabulary, ready for inference."""

    name: str
    draft: torch.nn.Module  # transformers causal LM, eval mode, requires_grad off
    target: torch.nn.Module
    tokenizer: Any  # HF tokenizer: encode / decode / apply_chat_template / eos_token_id
    dtype: torch.dtype  # torch.int8: the fast CPU path (workers.models.fast), both models; INT4_DRAFT: 4-bit draft
    vocab_size: int  # the target's logits width (may exceed len(tokenizer), as for Qwen)
    eos_token_ids: tuple[int, ...]  # any of these ends a generation
    cache_dir: Path | None  # pair-level metadata (e.g. measured cost ratio); None for tiny-random
    draft_width: int = 0  # the draft's logits width when narrower than vocab_size (0: the same)

    @property
    def padded(self) -> bool:
        """True when the draft's logits are narrower than the target's and engines must pad them."""
        return 0 < self.draft_width < self.vocab_size


def finish_pair(name: str, draft: Any, target: Any, tokenizer: Any, dtype: torch.dtype,
                pair_cache: Path | None, sources: tuple[Any, Any]) -> ModelPair:
    """The pair of two built models: the draft no wider than the target and able to read every token, both in eval
    mode with gradients off, the vocabulary width and end-of-generation ids taken from them."""
    from workers.models.fast import head_width

    widths = [head_width(m) for m in (draft, target)]
    rows = int(draft.get_input_embeddings().weight.shape[0])
    if widths[0] > widths[1]:
        raise ValueError(f"draft {sources[0]} scores {widths[0]} ids but target {sources[1]} only {widths[1]}: the "
                         "draft could propose ids the target cannot score; use a draft no wider than the target")
    if len(tokenizer) > min(widths[0], rows):
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens but draft {sources[0]} scores only {widths[0]} ids "
                         f"and embeds {rows}: it could neither propose nor read every token the target emits")
    for model in (draft, target):
        model.eval()
        model.requires_grad_(False)
    return ModelPair(name=name, draft=draft, target=target, tokenizer=tokenizer, dtype=dtype,
                     vocab_size=widths[1], eos_token_ids=eos_token_ids(tokenizer, target),
                     cache_dir=pair_cache, draft_width=widths[0] if widths[0] < widths[1] else 0)


def eos_token_ids(tokenizer: Any, model: Any) -> tuple[int, ...]:
    """Every id that should end a generation, primary first.

    Collected from the generation config, the model config and the tokenizer; ChatML models
    (Qwen) also stop on ``<|im_end|>`` and ``<|endoftext|>``, which their configs list only in part.
    """
    ids: list[int] = []

    def add(value: Any) -> None:
        for v in value if isinstance(value, list | tuple) else [value]:
            if isinstance(v, int) and v >= 0 and v not in ids:
                ids.append(v)

    gen = getattr(model, "generation_config", None)
    add(getattr(gen, "eos_token_id", None))
    add(getattr(model.config, "eos_token_id", None))
    add(tokenizer.eos_token_id)
    vocab = tokenizer.get_vocab()
    for token in ("<|im_end|>", "<|endoftext|>"):
        if token in vocab:
            add(vocab[token])
    return tuple(ids)
