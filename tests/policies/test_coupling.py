"""The coupled sampler (policies.coupling): the noise is keyed by seed and position alone, a Gumbel-max draw is a
sample of softmax(z / T), lossless under the coupling emits the target's own Gumbel-max tokens, and its
acceptance lies in [(1 - TV) / (1 + TV), 1 - TV]."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from policies import POLICIES, VerifyBatch, get_spec, make_policy, verify
from policies.coupling import CoupledNoise, check_sampler, gumbel, perturbed_argmax
from tests.policies.batches import make_batch, reseeded


def test_noise_depends_on_seed_and_position_alone():
    block = gumbel(7, torch.tensor([[10, 11, 12], [40, 41, 42]]), 50)
    assert block.shape == (2, 3, 50)
    assert torch.equal(gumbel(7, torch.tensor([[41]]), 50)[0, 0], block[1, 1]), "any block, any row"
    assert not torch.equal(gumbel(8, torch.tensor([[41]]), 50)[0, 0], block[1, 1]), "the seed moves it"
    noise = CoupledNoise(7, 50)
    assert torch.equal(noise.at([11, 12]), block[0, 1:])
    assert torch.equal(noise.at([12, 13])[0], block[0, 2]), "a held position is read back"


def test_the_noise_is_gumbel():
    g = gumbel(0, torch.arange(64).unsqueeze(0), 4096).flatten().double()
    assert abs(g.mean().item() - 0.5772156649) < 0.01 and abs(g.var().item() - math.pi ** 2 / 6) < 0.02
    assert torch.isfinite(g).all()


def test_a_gumbel_max_draw_is_a_sample_of_the_tempered_distribution():
    """Chi-square over 4,000 positions: the Gumbel-max token's frequencies against softmax(z / T)."""
    torch.manual_seed(0)
    logits, t, n = torch.randn(12) * 1.5, 0.7, 4000
    picks = perturbed_argmax(logits.expand(n, 12), t, gumbel(3, torch.arange(n).unsqueeze(0), 12)[0])
    observed = torch.bincount(picks, minlength=12).double()
    expected = torch.softmax(logits.double() / t, dim=-1) * n
    keep = expected >= 5
    chi2 = (((observed - expected) ** 2 / expected)[keep]).sum().item()
    assert chi2 < 31.3, chi2  # chi-square 0.999 quantile at 11 degrees of freedom


def test_coupled_lossless_emits_the_targets_gumbel_max_tokens():
    vb = coupled(0)
    out = verify(make_policy("lossless"), vb)
    own = perturbed_argmax(vb.target_f32, vb.temperature, vb.coupling)  # [B, L+1]: target-only's tokens there
    assert 0 < int(out.num_accepted.sum()) < 4 * 16, "some accepted, some rejected"
    for r in range(16):
        n = int(out.num_accepted[r])
        assert out.output_token_ids[r, : n + 1].tolist() == own[r, : n + 1].tolist()
        assert n == 4 or int(vb.draft_token_ids[r, n]) != int(own[r, n])


def coupled(seed: int, temperature: float = 0.8) -> VerifyBatch:
    """The contract suite's batch with the coupling's noise, its draft tokens the draft's own Gumbel-max
    tokens under that noise (as the engine proposes them)."""
    vb = make_batch(seed=seed, batch_size=16, draft_len=4, temperature=temperature, draft_noise=0.8)
    b, n = vb.draft_token_ids.shape
    noise = gumbel(seed, torch.arange(n + 1).expand(b, n + 1) + 100 * torch.arange(b).unsqueeze(1), vb.vocab_size)
    ids = perturbed_argmax(vb.draft_logits, temperature, noise[:, :-1])
    return dataclasses.replace(vb, draft_token_ids=ids, coupling=noise)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_rule_under_the_coupling_keeps_what_lossless_keeps_and_emits_the_targets_token(name):
    """A lossy rule accepts a superset of coupled lossless, and where its run stops it emits the target's own
    Gumbel-max token (the rule is the only source of a difference from target-only)."""
    for seed in range(3):
        vb = coupled(seed)
        lossless = verify(make_policy("lossless"), reseeded(vb, seed)).num_accepted
        out = verify(make_policy(name, **get_spec(name).example), reseeded(vb, seed))
        own = perturbed_argmax(vb.target_f32, vb.temperature, vb.coupling)
        assert (out.num_accepted >= lossless).all(), name
        rows = torch.arange(len(own))
        assert torch.equal(out.output_token_ids[rows, out.num_accepted], own[rows, out.num_accepted]), name


def test_coupled_acceptance_lies_between_its_bounds_and_below_the_standard_samplers():
    """One position, many seeds: P(accept) under the coupling is in [(1 - TV) / (1 + TV), 1 - TV] and the
    standard sampler's is 1 - TV."""
    torch.manual_seed(2)
    v, t, n = 30, 1.0, 6000
    target, draft = torch.randn(v) * 2, torch.randn(v) * 2
    p, q = torch.softmax(target / t, -1), torch.softmax(draft / t, -1)
    tv = 0.5 * (p - q).abs().sum().item()
    noise = gumbel(5, torch.arange(n).unsqueeze(0), v)[0]  # [n, V]: n independent draws
    coupled = (perturbed_argmax(draft.expand(n, v), t, noise) == perturbed_argmax(target.expand(n, v), t, noise))
    rate, se = coupled.double().mean().item(), 0.5 / math.sqrt(n)
    assert (1 - tv) / (1 + tv) - 4 * se <= rate <= 1 - tv + 4 * se, (rate, tv)
    assert rate < 1 - tv, "the coupling accepts less than the standard sampler"


def test_bad_coupling_and_sampler_names_are_refused():
    with pytest.raises(ValueError, match="coupling must be"):
        VerifyBatch(draft_token_ids=torch.zeros(1, 2, dtype=torch.long), draft_logits=None,
                    target_logits=torch.zeros(1, 3, 10), temperature=0.5, coupling=torch.zeros(1, 2, 10))
    assert check_sampler("coupled") == "coupled"
    with pytest.raises(ValueError, match="sampler must be one of standard, coupled"):
        check_sampler("gumbel")


def test_item_seeds_keep_items_and_turns_apart():
    from policies.coupling import item_seed

    seeds = {item_seed(s, i, t) for s in (0, 1) for i in ("gsm8k/test/0", "gsm8k/test/1") for t in (0, 1)}
    assert len(seeds) == 8 and all(0 <= x < 1 << 62 for x in seeds)
    assert item_seed(0, "a", 1) != item_seed(1, "a", 0) and item_seed(3, "a") == item_seed(3, "a", 0)


def test_each_position_is_drawn_alone_and_held_until_released():
    noise = CoupledNoise(4, 64)
    block = noise.at([5, 6, 7])
    assert torch.equal(block[1], gumbel(4, torch.tensor([[6]]), 64)[0, 0])
    noise.release(6)
    assert sorted(noise._held) == [6, 7] and torch.equal(noise.at([7])[0], block[2])
