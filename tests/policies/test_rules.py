"""Hand-computed cases per rule: logits built so the answer is known."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from policies import VerifyBatch, make_policy, verify
from tests.policies.batches import make_batch, peaked

V = 8


def greedy_batch(draft, target, draft_logits=None, **kw) -> VerifyBatch:
    return VerifyBatch(
        draft_token_ids=torch.tensor(draft),
        draft_logits=draft_logits,
        target_logits=peaked(target, V),
        temperature=0.0,
        generator=torch.Generator().manual_seed(0),
        **kw,
    )


@pytest.mark.parametrize(
    "draft, target, want",
    [
        ([[1, 2, 3]], [[1, 2, 3, 4]], [[1, 2, 3, 4]]),  # all accepted + bonus
        ([[1, 5, 3]], [[1, 2, 3, 4]], [[1, 2, -1, -1]]),  # reject at 1, recover target's token
        ([[7, 2, 3]], [[1, 2, 3, 4]], [[1, -1, -1, -1]]),  # reject at 0
        ([[1, 2, 3], [1, 1, 1]], [[1, 2, 3, 4], [1, 1, 5, 6]], [[1, 2, 3, 4], [1, 1, 5, -1]]),  # batched
    ],
)
def test_lossless_greedy(draft, target, want):
    result = verify(make_policy("lossless"), greedy_batch(draft, target))
    assert result.output_token_ids.tolist() == want


def _logits(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows).log().unsqueeze(0)  # probabilities -> logits, [1, N, V]


def test_top_k_accepts_second_choice_not_third():
    probs = [[0.5, 0.3, 0.2, 0, 0, 0, 0, 0]] * 3 + [[1 / V] * V]
    target = _logits(probs)  # [1, 4, V]
    batch = VerifyBatch(torch.tensor([[1, 2, 0]]), None, target, temperature=0.0)
    assert make_policy("top_k", k=2).decide(batch).accepted.tolist() == [[True, False, True]]
    assert make_policy("top_k", k=3).decide(batch).accepted.tolist() == [[True, True, True]]
    assert make_policy("top_k", k=2).decide(batch).score.tolist() == [[1.0, 2.0, 0.0]]


def test_relaxed_topk_needs_both_rank_and_gap():
    probs = [[0.5, 0.3, 0.2, 0, 0, 0, 0, 0]] * 2 + [[1 / V] * V]
    batch = VerifyBatch(torch.tensor([[1, 2]]), None, _logits(probs), temperature=0.0)
    # gap to top1: token 1 -> 0.2, token 2 -> 0.3
    assert make_policy("relaxed_topk", n=3, delta=0.25).decide(batch).accepted.tolist() == [[True, False]]
    assert make_policy("relaxed_topk", n=2, delta=0.5).decide(batch).accepted.tolist() == [[True, False]]
    assert make_policy("relaxed_topk", n=3, delta=0.5).decide(batch).accepted.tolist() == [[True, True]]


def test_target_entropy_accepts_anything_where_target_is_uniform():
    probs = [[1 / V] * V, [0.93] + [0.01] * 7, [1 / V] * V]
    batch = VerifyBatch(torch.tensor([[5, 5]]), None, _logits(probs), temperature=0.0)
    decision = make_policy("target_entropy", threshold=math.log(V) - 1e-4).decide(batch)
    assert decision.accepted.tolist() == [[True, False]]
    assert decision.score[0, 0].item() == pytest.approx(math.log(V), abs=1e-5)


def test_draft_entropy_accepts_where_draft_is_sure():
    target = peaked([[0, 0, 0]], V)
    draft = _logits([[0.99] + [0.01 / 7] * 7, [1 / V] * V])
    batch = VerifyBatch(torch.tensor([[3, 3]]), draft, target, temperature=0.0)
    assert make_policy("draft_entropy", threshold=0.2).decide(batch).accepted.tolist() == [[True, False]]


def test_typical_threshold_is_min_of_epsilon_and_entropy_term():
    # uniform target: H = ln 8, delta*exp(-H) = delta/8. p(d) = 1/8.
    batch = VerifyBatch(torch.tensor([[2]]), None, _logits([[1 / V] * V] * 2), temperature=0.0)
    assert make_policy("typical", epsilon=0.2, delta=0.9).decide(batch).accepted.tolist() == [[True]]  # 1/8 > 0.9/8
    assert make_policy("typical", epsilon=0.2, delta=1.1).decide(batch).accepted.tolist() == [[False]]  # 1/8 < min(.2, 1.1/8)
    assert make_policy("typical", epsilon=0.1, delta=5.0).decide(batch).accepted.tolist() == [[True]]  # 1/8 > 0.1


def test_kl_judge_threshold_and_confidence_gate():
    target = _logits([[0.6, 0.4, 0, 0, 0, 0, 0, 0], [0.97, 0.03, 0, 0, 0, 0, 0, 0], [1 / V] * V])
    draft = _logits([[0.4, 0.6, 0, 0, 0, 0, 0, 0], [0.4, 0.6, 0, 0, 0, 0, 0, 0]])
    batch = VerifyBatch(torch.tensor([[1, 1]]), draft, target, temperature=0.0)
    kl0 = 0.6 * math.log(0.6 / 0.4) + 0.4 * math.log(0.4 / 0.6)
    decision = make_policy("kl_judge", threshold=0.1, confidence=0.9).decide(batch)
    assert decision.score[0, 0].item() == pytest.approx(kl0, rel=1e-4)
    # position 0: KL ~0.081 <= 0.1 and not confident -> accept; position 1: confident -> lossless only
    assert decision.accepted.tolist() == [[True, False]]
    assert make_policy("kl_judge", threshold=10.0, confidence=1.0).decide(batch).accepted.tolist() == [[True, True]]
    assert make_policy("kl_judge", threshold=0.05, confidence=1.0).decide(batch).accepted.tolist() == [[False, False]]


def _dropmatch_batch(draft_ids, hidden_rows, weight):
    hidden = torch.tensor(hidden_rows).unsqueeze(0)  # [1, L+1, d]
    target = hidden @ weight.T
    return VerifyBatch(
        draft_token_ids=torch.tensor([draft_ids]),
        draft_logits=target[:, :-1].clone(),
        target_logits=target,
        target_hidden=hidden,
        lm_head_weight=weight,
        temperature=0.0,
        generator=torch.Generator().manual_seed(0),
    )


def test_dropmatch_naive_accepts_a_token_some_dropout_head_prefers():
    # Hidden (1, 1): token 0 reads dim 0 strongly, token 1 reads dim 1 a bit less. Dropping dim 0
    # makes token 1 the argmax, so with enough heads some head votes 1; token 2 never wins.
    weight = torch.tensor([[3.0, 0.0], [0.0, 2.0], [-5.0, -5.0]])
    batch = _dropmatch_batch([1, 2], [[1.0, 1.0]] * 3, weight)
    decision = make_policy("dropmatch", k=16, p_drop=0.5, criterion="naive", mode="exact").decide(batch)
    assert decision.accepted.tolist() == [[True, False]]
    assert 0 < decision.score[0, 0].item() < 1 and decision.score[0, 1].item() == 0.0
    off = make_policy("dropmatch", k=16, p_drop=0.0, criterion="naive", mode="exact").decide(batch)
    assert off.accepted.tolist() == [[False, False]]


def test_dropmatch_js_accepts_draft_inside_head_spread_only():
    weight = torch.tensor([[3.0, 0.0], [0.0, 2.0], [-5.0, -5.0]])
    batch = _dropmatch_batch([1, 1], [[1.0, 1.0]] * 3, weight)
    target = batch.target_logits[:, :-1]
    near = target.clone()  # draft identical to the target: JS(q, p_bar) ~ small
    far = torch.tensor([[[-9.0, 9.0, 0.0]]]).expand(1, 2, 3)  # draft nearly one-hot on token 1
    from dataclasses import replace

    policy = make_policy("dropmatch", k=8, p_drop=0.3, criterion="js", mode="exact")
    acc_near = policy.decide(replace(batch, draft_logits=near, generator=torch.Generator().manual_seed(0)))
    acc_far = policy.decide(replace(batch, draft_logits=far.clone(), generator=torch.Generator().manual_seed(0)))
    assert acc_near.accepted.all(), "a draft equal to the target lies inside the dropout spread"
    assert not acc_far.accepted.any(), "a draft far from every head is rejected (and is not the majority)"
    assert (acc_near.score >= 0).all() and (acc_far.score < 0).all()


@pytest.mark.parametrize("criterion", ["js", "naive"])
def test_dropmatch_candidate_mode_agrees_with_exact_mode(criterion):
    agree = total = 0
    for seed in range(20):
        batch = make_batch(seed=seed, vocab=512, hidden=32, scale=4.0, draft_noise=1.0)
        exact = make_policy("dropmatch", criterion=criterion, mode="exact").decide(batch).accepted
        cand = make_policy("dropmatch", criterion=criterion, mode="candidate", num_candidates=64).decide(
            make_batch(seed=seed, vocab=512, hidden=32, scale=4.0, draft_noise=1.0)
        ).accepted
        agree += int((exact == cand).sum())
        total += exact.numel()
    assert agree / total >= 0.95, f"candidate mode agreed on only {agree}/{total} decisions"


def test_any_of_is_the_union_of_its_members():
    batch = make_batch(seed=3, draft_noise=2.0)
    a = make_policy("top_k", k=3).decide(batch).accepted
    b = make_policy("target_entropy", threshold=3.5).decide(batch).accepted
    union = make_policy("any_of", members=[("top_k", {"k": 3}), {"policy": "target_entropy", "params": {"threshold": 3.5}}])
    got = union.decide(batch)
    assert torch.equal(got.accepted, a | b)
    assert torch.equal(got.score, a.float() + b.float())


def test_any_of_rejects_bad_members():
    with pytest.raises(ValueError, match="members"):
        make_policy("any_of", members=[])
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("any_of", members=[("nope", {})])
    with pytest.raises(ValueError, match="threshold"):
        make_policy("any_of", members=[("kl_judge", {"threshold": -1})])


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_log_partitions_are_logsumexp_and_shared(temperature):
    batch = make_batch(temperature=temperature, seed=4, scale=6.0)
    want = torch.logsumexp(batch.target_f32[:, :-1] / temperature, dim=-1)
    assert torch.allclose(batch.target_lse(temperature), want, atol=1e-5)
    assert batch.target_lse(temperature) is batch.target_lse(temperature), "computed once per batch and T"
    assert torch.allclose(batch.draft_lse(temperature), torch.logsumexp(batch.draft_f32 / temperature, -1), atol=1e-5)
    with pytest.raises(ValueError, match="needs one > 0"):
        batch.target_lse(0.0)


@pytest.mark.parametrize("name", ["lossless", "kl_judge", "dropmatch", "typical", "draft_entropy"])
def test_draft_handed_scaled_by_t_decides_as_raw_logits(name):
    """The vLLM plugin hands the draft over as its logits divided by T (``draft_scaled``, as vLLM's drafter
    divides them). Every rule decides as it does from the raw logits (same generator, same draws)."""
    t = 0.7
    raw = make_batch(temperature=t, seed=9, scale=4.0, batch_size=6)
    handed = replace(raw, draft_logits=raw.draft_f32 / t, draft_scaled=True,
                     generator=torch.Generator().manual_seed(1234))
    assert torch.equal(handed.draft_at(t), raw.draft_f32 / t), "q at T: the given logits themselves"
    assert torch.allclose(handed.draft_f32, raw.draft_f32, atol=1e-5), "the T = 1 view"
    raw = replace(raw, generator=torch.Generator().manual_seed(1234))
    policy = make_policy(name)
    a, b = verify(policy, raw), verify(policy, handed)
    assert torch.equal(a.decision.accepted, b.decision.accepted)
    assert torch.equal(a.output_token_ids, b.output_token_ids)


def test_kl_terms_where_p_underflows_are_zero_not_nan():
    """A target token far below the rest (p underflows to 0, logp finite) where the draft has q = 0: 0 · inf
    must count 0, not make KL nan (a nan KL silently rejects); p > 0 where q = 0 is infinite KL."""
    from policies.distributions import kl_from_logprobs

    target = torch.tensor([[10.0, 0.0, -200.0, float("-inf")]])
    draft = torch.tensor([[10.0, 0.0, float("-inf"), float("-inf")]])
    logp, logq = torch.log_softmax(target, -1), torch.log_softmax(draft, -1)
    kl = kl_from_logprobs(logp, logq, torch.softmax(target, -1))
    assert torch.isfinite(kl).all() and float(kl[0]) < 1e-6
    assert kl_from_logprobs(torch.log_softmax(torch.tensor([[0.0, 0.0]]), -1),
                            torch.log_softmax(torch.tensor([[0.0, float("-inf")]]), -1)).isinf().all()
