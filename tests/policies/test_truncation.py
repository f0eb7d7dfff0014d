"""Top-k / top-p truncation (policies.truncation): the set each keeps, vLLM's order, the checks on its settings, and
every rule on truncated distributions: no NaN, every token it emits past the accepted prefix inside the target's
truncated set, and lossless sampling exactly the truncated target distribution (a chi-square test at a fixed seed)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from scipy import stats

from policies import POLICIES, get_spec, make_policy, verify
from policies.truncation import check_truncation, truncate
from tests.policies.batches import make_batch


def kept(logits: torch.Tensor) -> list[int]:
    return torch.isfinite(logits).nonzero().flatten().tolist()


def test_top_k_keeps_the_k_largest_and_every_tie_at_the_boundary():
    logits = torch.tensor([1.0, 5.0, 3.0, 3.0, 0.0])
    assert kept(truncate(logits, 1.0, top_k=2)) == [1, 2, 3], "a tie with the 2nd largest stays"
    assert kept(truncate(logits, 1.0, top_k=1)) == [1]
    assert truncate(logits, 1.0, top_k=2)[1] == 5.0, "kept logits are unchanged (T is applied by whoever samples)"
    assert truncate(logits, 0.0, top_k=1) is logits, "greedy decoding: nothing to truncate"
    assert truncate(logits, 1.0) is logits


def test_top_p_keeps_the_smallest_prefix_reaching_the_mass_at_the_temperature():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = p.log()
    assert kept(truncate(logits, 1.0, top_p=0.5)) == [0], "0.5 reached by the first token"
    assert kept(truncate(logits, 1.0, top_p=0.51)) == [0, 1]
    assert kept(truncate(logits, 1.0, top_p=0.9)) == [0, 1, 2]
    assert kept(truncate(logits, 1.0, top_p=1e-9)) == [0], "the first token always stays"
    # at T 0.5 the distribution is sharper: 0.5^2 / sum = 0.69 reaches 0.6 alone
    assert kept(truncate(logits, 0.5, top_p=0.6)) == [0]
    # vLLM's order: top-k first, then top-p over the top-k distribution (0.5 / 0.8 = 0.625 >= 0.6)
    assert kept(truncate(logits, 1.0, top_k=2, top_p=0.6)) == [0]
    assert kept(truncate(logits, 1.0, top_p=0.6)) == [0, 1]
    ties = torch.zeros(6)
    assert kept(truncate(ties, 1.0, top_p=0.4)) == [0, 1, 2], "equal probabilities: lower ids first"


def test_rows_truncate_independently():
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(5, 3, 50, generator=g)
    together = truncate(rows, 0.7, top_k=20, top_p=0.8)
    alone = torch.stack([torch.stack([truncate(rows[i, j], 0.7, top_k=20, top_p=0.8) for j in range(3)])
                         for i in range(5)])
    assert torch.equal(together, alone)


def _top_p_over_the_whole_vocabulary(logits: torch.Tensor, temperature: float, top_k: int, top_p: float):
    """The definition, written plainly: top-k's cut, then one stable sort of the whole vocabulary for top-p."""
    out = logits.float().clone()
    kth = out.topk(top_k, dim=-1).values[..., -1:]
    out.masked_fill_(out < kth, -math.inf)
    probs = torch.softmax(out / temperature, dim=-1)
    order = torch.sort(probs, dim=-1, descending=True, stable=True)
    before = order.values.cumsum(dim=-1) - order.values
    drop_sorted = before >= top_p
    drop_sorted[..., 0] = False
    return out.masked_fill_(torch.zeros_like(drop_sorted).scatter_(-1, order.indices, drop_sorted), -math.inf)


@pytest.mark.parametrize("top_k", [1, 3, 20, 200])
def test_top_p_after_top_k_sorts_the_top_k_set_alone_and_keeps_the_same_set(top_k):
    """Sorting only the top-k ids gives the whole-vocabulary sort's set bit for bit, on wide rows (the real
    vocabulary's width), with ties at the top-k boundary and inside the set, at several temperatures and masses."""
    g = torch.Generator().manual_seed(top_k)
    rows = torch.randn(6, 4, 151_936, generator=g) * 3
    rows[0, 0, :64] = rows[0, 0].max()  # 64 ties at the top: wider than k
    rows[1, 1] = torch.round(rows[1, 1])  # many ties everywhere, the boundary among them
    rows[2, 2, 1000:] = -math.inf  # a padded head
    for t, p in ((0.7, 0.8), (1.0, 0.95), (0.3, 0.5), (1.5, 0.999)):
        fast = truncate(rows, t, top_k=top_k, top_p=p)
        assert torch.equal(fast, _top_p_over_the_whole_vocabulary(rows, t, top_k, p)), (t, p)
        assert torch.isfinite(fast).sum(dim=-1).min() >= 1


@pytest.mark.parametrize("top_k, top_p, message", [(-1, 1.0, "top_k must be an integer >= 0"),
                                                   (2.5, 1.0, "top_k must be an integer >= 0"),
                                                   (True, 1.0, "top_k must be an integer >= 0"),
                                                   (0, 0.0, "top_p must be in (0, 1]"),
                                                   (0, 1.5, "top_p must be in (0, 1]"),
                                                   (0, math.nan, "top_p must be in (0, 1]")])
def test_bad_settings_are_named(top_k, top_p, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        check_truncation(top_k, top_p)


def truncated_batch(seed: int = 0, top_k: int = 8, top_p: float = 0.8):
    batch = make_batch(seed=seed, temperature=1.0, vocab=64)
    target = truncate(batch.target_logits, 1.0, top_k, top_p)
    draft = truncate(batch.draft_logits, 1.0, top_k, top_p)
    g = torch.Generator().manual_seed(seed + 1)
    b, n, v = draft.shape
    ids = torch.multinomial(torch.softmax(draft, -1).reshape(-1, v), 1, generator=g).view(b, n)
    return dataclasses.replace(batch, target_logits=target, draft_logits=draft, draft_token_ids=ids)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_rule_on_truncated_distributions_emits_inside_the_targets_set(name):
    for seed in range(4):
        batch = truncated_batch(seed)
        result = verify(make_policy(name, **get_spec(name).example), batch)
        if result.decision.score is not None:
            assert not torch.isnan(result.decision.score).any(), name
        for row in range(batch.draft_token_ids.shape[0]):
            k = int(result.num_accepted[row])
            token = int(result.output_token_ids[row, k])
            assert math.isfinite(float(batch.target_logits[row, k, token])), \
                f"{name}: emitted {token} at {k}, outside the target's truncated set"


def test_lossless_samples_exactly_the_truncated_target():
    batch = make_batch(seed=3, batch_size=1, draft_len=1, vocab=16, temperature=1.0)
    target = truncate(batch.target_logits, 0.7, top_k=6, top_p=0.9)
    draft = truncate(batch.draft_logits, 0.7, top_k=6, top_p=0.9)
    rows = 40_000
    g = torch.Generator().manual_seed(11)
    q = torch.softmax(draft[0, 0] / 0.7, -1)
    ids = torch.multinomial(q, rows, replacement=True, generator=g).view(rows, 1)
    big = dataclasses.replace(batch, draft_token_ids=ids, draft_logits=draft.expand(rows, 1, -1),
                              target_logits=target.expand(rows, 2, -1), target_hidden=None, lm_head_weight=None,
                              lm_head_bias=None, temperature=0.7, generator=torch.Generator().manual_seed(5))
    first = verify(make_policy("lossless"), big).output_token_ids[:, 0]
    p = torch.softmax(target[0, 0] / 0.7, -1)
    support = kept(target[0, 0])
    counts = torch.bincount(first, minlength=16)
    assert set(first.unique().tolist()) <= set(support), "nothing outside the truncated set"
    expected = (p[support] * rows).tolist()
    assert stats.chisquare(counts[support].tolist(), expected).pvalue > 1e-3


def test_rank_rules_never_accept_a_token_the_truncated_target_excludes():
    """top_k and relaxed_topk read ranks and probabilities: a draft token at a -inf target logit (outside a
    top-p set smaller than k) is rank V, probability 0, and neither accepts it, however lenient."""
    import math as _math

    from policies import VerifyBatch, make_policy

    target = torch.full((1, 2, 10), -_math.inf)
    target[0, :, 0], target[0, :, 1] = 5.0, 4.0  # the truncated target keeps ids 0 and 1
    draft = torch.zeros(1, 1, 10)
    batch = VerifyBatch(draft_token_ids=torch.tensor([[7]]), draft_logits=draft, target_logits=target,
                        temperature=0.7, generator=torch.Generator().manual_seed(0))
    for name, params in (("top_k", {"k": 64}), ("relaxed_topk", {"n": 16, "delta": 1.0})):
        assert not bool(make_policy(name, **params).decide(batch).accepted.any()), name
    inside = VerifyBatch(draft_token_ids=torch.tensor([[1]]), draft_logits=draft, target_logits=target,
                         temperature=0.7, generator=torch.Generator().manual_seed(0))
    assert bool(make_policy("top_k", k=2).decide(inside).accepted.all())
