"""FLy by hand: a rejection is deferred only where the target is unsure, the window fits in the block, the
next W drafts are each accepted natively and they are the request's own drafts."""

from __future__ import annotations

import math

import pytest
import torch

from policies import VerifyBatch, make_policy, verify
from policies.fly import topk_entropy

V = 8


def unsure_logits(argmax: list[int], unsure: set[int]) -> torch.Tensor:
    """[1, N, V]: a peaked row at every position (argmax there), except rows in ``unsure``, whose argmax
    leads the next id by 0.1 logit and a third by 0.2 (top-3 entropy about 1.1 nats)."""
    rows = torch.full((len(argmax), V), -30.0)
    for i, tok in enumerate(argmax):
        rows[i, tok] = 10.0
        if i in unsure:
            rows[i, (tok + 1) % V] = 9.9
            rows[i, (tok + 2) % V] = 9.8
    return rows.unsqueeze(0)


def batch(draft: list[int], argmax: list[int], unsure: set[int], **kw) -> VerifyBatch:
    return VerifyBatch(draft_token_ids=torch.tensor([draft]), draft_logits=None,
                       target_logits=unsure_logits(argmax, unsure), temperature=0.0, **kw)


TARGET = [1, 2, 3, 4, 5]  # four draft positions, then the bonus slot


def accepted(policy, b: VerifyBatch) -> list[bool]:
    return policy.decide(b).accepted[0].tolist()


def test_an_unsure_mismatch_followed_by_w_native_acceptances_is_deferred():
    fly = make_policy("fly", window=2, entropy_threshold=0.5, top_k=3)
    b = batch([1, 7, 3, 4], TARGET, unsure={1})  # position 1 mismatches; 2 and 3 match
    assert accepted(make_policy("lossless"), b) == [True, False, True, True]
    assert accepted(fly, b) == [True, True, True, True]
    out = verify(fly, b)
    assert out.output_token_ids[0].tolist() == [1, 7, 3, 4, 5]  # the deferred draft kept, then the bonus


def test_no_deferral_where_the_target_is_sure():
    fly = make_policy("fly", window=2, entropy_threshold=0.5, top_k=3)
    assert accepted(fly, batch([1, 7, 3, 4], TARGET, unsure=set())) == [True, False, True, True]


def test_no_deferral_when_the_window_does_not_fit_in_the_block():
    fly = make_policy("fly", window=2, entropy_threshold=0.5, top_k=3)
    # position 2 of 4: 2 + 2 < 4 is false, although the one position after it matches
    assert accepted(fly, batch([1, 2, 7, 4], TARGET, unsure={2})) == [True, True, False, True]
    # a window as long as the block: FLy is the lossless rule
    assert accepted(make_policy("fly", window=4, entropy_threshold=0.0),
                    batch([1, 7, 3, 4], TARGET, unsure={1})) == [True, False, True, True]


def test_no_deferral_when_a_later_draft_in_the_window_is_rejected():
    fly = make_policy("fly", window=2, entropy_threshold=0.5, top_k=3)
    assert accepted(fly, batch([1, 7, 3, 6], TARGET, unsure={1})) == [True, False, True, False]
    # two unsure mismatches in a row: the first's window holds the second, a native rejection
    assert accepted(fly, batch([7, 6, 3, 4], TARGET, unsure={0, 1})) == [False, True, True, True]


def test_positions_that_hold_no_draft_never_count_as_accepted():
    fly = make_policy("fly", window=2, entropy_threshold=0.5, top_k=3)
    b = batch([1, 7, 3, 4], TARGET, unsure={1}, draft_valid=torch.tensor([[True, True, True, False]]))
    assert accepted(fly, b) == [True, False, True, True]  # position 3 is padding: the window is not met


def test_a_draft_the_target_rules_out_is_never_deferred():
    fly = make_policy("fly", window=1, entropy_threshold=0.0, top_k=3)
    b = batch([1, 7, 3, 4], TARGET, unsure={1})
    logits = b.target_logits.clone()
    logits[0, 1, 7] = -math.inf
    b = VerifyBatch(draft_token_ids=b.draft_token_ids, draft_logits=None, target_logits=logits, temperature=0.0)
    assert accepted(fly, b)[1] is False


def test_topk_entropy_is_the_unnormalized_sum_over_the_top_k():
    b = batch([1, 2, 3, 4], TARGET, unsure={0})
    p = torch.softmax(b.target_logits[0, 0], dim=-1).sort(descending=True).values
    for k in (1, 3, 8):
        want = float(-(p[:k] * p[:k].log()).sum())
        assert float(topk_entropy(b, k)[0, 0]) == pytest.approx(want, rel=1e-5)
    assert float(topk_entropy(b, 3)[0, 1]) < 1e-6  # a peaked row


def test_sampling_defers_a_rejection_the_uniform_would_make():
    """T > 0: the lossless uniforms decide first; a position they reject is accepted when unsure and the window's
    own uniforms accept. q is one-hot at the draft (no draft logits), so p_t(d) is the acceptance probability."""
    lossless, fly = make_policy("lossless"), make_policy("fly", window=1, entropy_threshold=0.5, top_k=3)
    draft = [2, 2, 3, 4]  # position 0: the target's second choice, p ~ 0.33
    native_rejected = deferred = 0
    for seed in range(200):
        b = VerifyBatch(draft_token_ids=torch.tensor([draft]), draft_logits=None,
                        target_logits=unsure_logits(TARGET, unsure={0}), temperature=1.0,
                        generator=torch.Generator().manual_seed(seed))
        base = lossless.decide(b).accepted[0].tolist()
        got = fly.decide(VerifyBatch(draft_token_ids=b.draft_token_ids, draft_logits=None,
                                     target_logits=b.target_logits, temperature=1.0,
                                     generator=torch.Generator().manual_seed(seed))).accepted[0].tolist()
        assert all(g or not a for a, g in zip(base, got, strict=True))  # a superset of lossless, same uniforms
        if not base[0]:
            native_rejected += 1
            deferred += got[0]
            assert got[0] == base[1]  # deferred exactly when the next draft is accepted natively
    assert native_rejected > 50 and 0 < deferred <= native_rejected


def test_sampling_never_defers_a_token_whose_float32_probability_is_zero():
    """vLLM's V1 kernel tests p_t(d) > 0 in float32 at T: a token 120 nats below the top is not deferrable."""
    logits = unsure_logits(TARGET, unsure={0})
    logits[0, 0, 6] = logits[0, 0, 1] - 120.0
    fly = make_policy("fly", window=2, entropy_threshold=0.0, top_k=3)
    for seed in range(20):
        b = VerifyBatch(draft_token_ids=torch.tensor([[6, 2, 3, 4]]), draft_logits=None, target_logits=logits,
                        temperature=1.0, generator=torch.Generator().manual_seed(seed))
        assert fly.decide(b).accepted[0, 0].item() is False


def test_a_position_that_holds_no_draft_is_never_deferred_itself():
    fly = make_policy("fly", window=1, entropy_threshold=0.0, top_k=3)
    b = batch([7, 2, 3, 4], TARGET, unsure={0}, draft_valid=torch.tensor([[False, True, True, True]]))
    assert accepted(fly, b)[0] is False
