"""The draft's proposal vocabulary: greedy drafting over the tokenizer's most frequent ids.

A greedy draft step needs only the argmax of its logits, and the draft's LM head over the whole vocabulary
(151,936 x 896 for Qwen2.5's 0.5B: 27% of the draft's weights) is a fixed cost of every step that a cheap
step notices. BPE ids are ordered by merge rank, so the first ids are the frequent ones: on GSM8K's reference
answers 0.7% of the target's tokens lie at or past id 65,536 (2.7% past 32,768). Greedy drafting here scores
the first :data:`SIZE` ids and the tokenizer's added and special tokens (EOS and the chat markers among them),
and proposes the best of those (FR-Spec's frequency-ranked drafting, arXiv 2502.14856). A draft token
outside the set is never proposed; what that costs in acceptance is what the engine's speed figures measure.

Nothing about losslessness changes (the target still decides every token). Rules that read the draft's whole
distribution (the KL judge, draft entropy, DropMatch's js) get it from the full head, computed once per round
over the proposed rows (``workers.cpu_engine``); a row of the int8 path's head is bit-identical whichever rows
stand beside it, so the proposal set's argmax equals the full logits' argmax over the set.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

SIZE = 65536  # the first ids every greedy draft step scores


def proposal_ids(tokenizer: Any, head_width: int, size: int = SIZE) -> Tensor | None:
    """The ids a greedy draft step scores ([P] long, ascending): the first ``size`` and the tokenizer's added and
    special tokens (EOS, the chat markers) below ``head_width``; None where that would be (nearly) the whole
    head, or the tokenizer does not say how many tokens it has."""
    try:
        count = len(tokenizer)
    except TypeError:
        return None
    if size <= 0 or size >= min(count, head_width):
        return None
    extra = set(getattr(tokenizer, "added_tokens_decoder", None) or ()) | set(getattr(tokenizer, "all_special_ids", ()))
    ids = sorted(set(range(size)) | {int(i) for i in extra if size <= int(i) < head_width})
    return torch.tensor(ids, dtype=torch.long) if len(ids) < 0.9 * head_width else None


class ProposalHead:
    """``head`` (the draft's LM head: an ``nn.Linear`` or the fast path's ``QLinear`` or ``Q4Linear``) over ``ids`` only."""

    def __init__(self, head: Any, ids: Tensor) -> None:
        self.ids = ids
        if hasattr(head, "select"):  # the fast path's int8 or 4-bit head: its own rows, the same numbers
            self._linear: Any = head.select(ids)
        else:
            weight = head.weight.detach().index_select(0, ids).contiguous()
            bias = None if getattr(head, "bias", None) is None else head.bias.detach().index_select(0, ids)
            self._linear = lambda hidden: F.linear(hidden, weight, bias)

    def logits(self, hidden: Tensor) -> Tensor:
        """[..., P]: the head's logits at ``ids``, from final hidden states [..., d]."""
        return self._linear(hidden)

    def argmax(self, hidden: Tensor) -> Tensor:
        """[...] long: the id of the largest logit among ``ids`` (the first such id on a tie, as ``argmax`` of the
        full logits picks among them)."""
        return self.ids[self.logits(hidden).argmax(dim=-1)]


def for_pair(pair: Any, size: int = SIZE) -> ProposalHead | None:
    """The proposal head a pair's draft drafts greedily with (None: the whole head), as the CPU engine and the
    cost calibration both build it."""
    from workers.models.fast import head_width

    ids = proposal_ids(pair.tokenizer, head_width(pair.draft), size)
    return None if ids is None else ProposalHead(pair.draft.get_output_embeddings(), ids)


def head_kind(pair: Any, size: int = SIZE) -> str:
    """"full", or "proposal-N": the draft head a greedy step of ``pair`` uses (``CostProfile.draft_head``)."""
    from workers.models.fast import head_width

    ids = proposal_ids(pair.tokenizer, head_width(pair.draft), size)
    return "full" if ids is None else f"proposal-{len(ids)}"
