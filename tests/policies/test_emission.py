"""The shared emission step, and losslessness of the lossless rule at T > 0 (statistically)."""

from __future__ import annotations

import torch

from policies import VerifyBatch, make_policy, verify
from policies.emission import leading_run

V = 6
TARGET = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.07, 0.03])
DRAFT = torch.tensor([0.05, 0.10, 0.40, 0.05, 0.30, 0.10])


def test_leading_run_stops_at_first_rejection():
    acc = torch.tensor([[True, True, False, True], [False, True, True, True], [True, True, True, True]])
    assert leading_run(acc).tolist() == [2, 0, 4]


def _first_token_distribution(n: int, seed: int, with_draft_probs: bool) -> torch.Tensor:
    """Run n independent one-token verify steps, batched; return the emitted tokens' histogram."""
    g = torch.Generator().manual_seed(seed)
    if with_draft_probs:
        draft_ids = torch.multinomial(DRAFT, n, replacement=True, generator=g).view(n, 1)
        draft_logits = DRAFT.log().expand(n, 1, V)
    else:
        draft_ids = torch.full((n, 1), 2)  # a deterministic drafter that always proposes token 2
        draft_logits = None
    batch = VerifyBatch(
        draft_token_ids=draft_ids,
        draft_logits=draft_logits,
        target_logits=TARGET.log().expand(n, 2, V),
        temperature=1.0,
        generator=g,
    )
    first = verify(make_policy("lossless"), batch).output_token_ids[:, 0]
    return torch.bincount(first, minlength=V).float() / n


def _tv(p: torch.Tensor, q: torch.Tensor) -> float:
    return 0.5 * float((p - q).abs().sum())


def test_lossless_sampling_converges_to_target_distribution():
    small = sum(_tv(_first_token_distribution(500, s, True), TARGET) for s in range(5)) / 5
    large = _tv(_first_token_distribution(400_000, 99, True), TARGET)
    # Sampling noise of TV at n=400k is ~0.002; a biased rule (e.g. accepting draft tokens
    # outright) sits at TV(draft, target) = 0.35 here.
    assert large < 0.006, f"TV distance {large:.4f} to the target at 400k samples"
    assert large < small / 3, "the distance must shrink as samples grow"


def test_lossless_without_draft_distribution_is_still_lossless():
    # q is taken as one-hot at the proposed token: accept with p_t(d), else sample p_t without d.
    large = _tv(_first_token_distribution(400_000, 5, False), TARGET)
    assert large < 0.006, f"TV distance {large:.4f}"


def test_bonus_token_samples_target_at_last_slot():
    n = 200_000
    g = torch.Generator().manual_seed(0)
    target = torch.stack([torch.tensor([0.0, 0, 1, 0, 0, 0]) + 1e-9, TARGET]).log()  # slot 0: certain token 2
    batch = VerifyBatch(torch.full((n, 1), 2), None, target.expand(n, 2, V), temperature=1.0, generator=g)
    out = verify(make_policy("lossless"), batch).output_token_ids
    assert bool((out[:, 0] == 2).all())
    hist = torch.bincount(out[:, 1], minlength=V).float() / n
    assert _tv(hist, TARGET) < 0.008


def test_greedy_recovered_token_is_target_argmax_for_lossy_rules_too():
    target = torch.full((1, 3, V), -100.0)
    target[0, 0, 4] = 100.0
    target[0, 1, 1] = 100.0
    target[0, 2, 5] = 100.0
    batch = VerifyBatch(torch.tensor([[4, 3]]), None, target, temperature=0.0)
    out = verify(make_policy("top_k", k=1), batch).output_token_ids
    assert out.tolist() == [[4, 1, -1]]
