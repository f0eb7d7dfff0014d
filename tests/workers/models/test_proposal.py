"""The proposal vocabulary: which ids a greedy draft step scores, and that its argmax is the full head's argmax
over them (bit for bit on the int8 path)."""

from __future__ import annotations

import pytest
import torch

from workers.models.fast import Q4Linear, QLinear
from workers.models.proposal import ProposalHead, proposal_ids


class _Tok:
    """Like Qwen's: 100 tokens, the last three added (specials), the head padded to 128 rows; id 1 a special
    among the first ids too."""

    added_tokens_decoder = {1: "<s>", 97: "<|endoftext|>", 98: "<|im_start|>", 99: "<|im_end|>"}
    all_special_ids = [1, 97, 99]

    def __len__(self) -> int:
        return 100


def test_the_first_ids_and_every_added_or_special_token_below_the_head_width():
    ids = proposal_ids(_Tok(), head_width=128, size=40)
    assert ids.tolist() == list(range(40)) + [97, 98, 99]  # padding rows 100-127 are no tokens
    assert proposal_ids(_Tok(), head_width=128, size=100) is None  # the whole vocabulary
    assert proposal_ids(_Tok(), head_width=100, size=95) is None  # hardly smaller than the head
    assert proposal_ids(object(), head_width=128, size=40) is None  # no length said
    assert proposal_ids(_Tok(), head_width=128, size=0) is None


def _argmax_among(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return ids[logits.index_select(-1, ids).argmax(dim=-1)]


def test_a_float_head_proposes_the_full_logits_argmax_among_its_ids():
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(16, 128, bias=True)
    with torch.no_grad():
        head.weight.copy_(torch.randn(128, 16, generator=g))
        head.bias.copy_(torch.randn(128, generator=g))
    ids = proposal_ids(_Tok(), 128, 40)
    proposal = ProposalHead(head, ids)
    hidden = torch.randn(7, 16, generator=g)
    with torch.no_grad():
        full = head(hidden)
    torch.testing.assert_close(proposal.logits(hidden), full[:, ids])
    assert proposal.argmax(hidden).tolist() == _argmax_among(full, ids).tolist()


@pytest.mark.parametrize("linear", [QLinear, Q4Linear], ids=["int8", "int4"])
def test_a_fast_heads_row_is_bit_identical_to_the_full_heads_row(linear):
    g = torch.Generator().manual_seed(1)
    head = linear.quantized(torch.randn(128, 32, generator=g))
    ids = proposal_ids(_Tok(), 128, 40)
    proposal = ProposalHead(head, ids)
    hidden = torch.randn(5, 32, generator=g)
    full = head(hidden)
    assert torch.equal(proposal.logits(hidden), full[:, ids])
    for i in range(5):  # one row at a time (a draft step) as in a block (a replay's pass)
        assert torch.equal(proposal.logits(hidden[i:i + 1]), full[i:i + 1, ids])
    assert proposal.argmax(hidden).tolist() == _argmax_among(full, ids).tolist()
