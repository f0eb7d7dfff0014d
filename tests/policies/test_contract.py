"""The contract every registered rule must meet. Parametrized over POLICIES: a new rule gets the
whole suite by registering itself."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from policies import POLICIES, MissingInputError, VerifyBatch, get_spec, make_policy, verify
from tests.policies.batches import make_batch, reseeded

RULES = sorted(POLICIES)
LOSSY = sorted(n for n, s in POLICIES.items() if s.lossy)
TEMPS = [0.0, 1.0]


def example(name: str):
    return make_policy(name, **get_spec(name).example)


@pytest.mark.parametrize("temperature", TEMPS)
@pytest.mark.parametrize("name", RULES)
def test_shapes_and_dtypes(name, temperature):
    batch = make_batch(temperature=temperature)
    b, n = batch.draft_token_ids.shape
    result = verify(example(name), batch)
    assert result.decision.accepted.shape == (b, n) and result.decision.accepted.dtype == torch.bool
    if result.decision.score is not None:
        assert result.decision.score.shape == (b, n) and result.decision.score.is_floating_point()
    out, acc = result.output_token_ids, result.num_accepted
    assert out.shape == (b, n + 1) and out.dtype == torch.long
    assert acc.shape == (b,) and acc.dtype == torch.long
    for row in range(b):
        k = int(acc[row])
        assert 0 <= k <= n
        assert out[row, :k].tolist() == batch.draft_token_ids[row, :k].tolist(), "accepted prefix is the draft's"
        assert 0 <= int(out[row, k]) < batch.vocab_size, "one emitted token after the prefix"
        assert (out[row, k + 1 :] == -1).all(), "-1 padding after the emitted token"
        assert not result.decision.accepted[row, k] if k < n else True, "the run stops at a rejection"


@pytest.mark.parametrize("temperature", TEMPS)
@pytest.mark.parametrize("name", RULES)
def test_seeded_determinism(name, temperature):
    batch = make_batch(temperature=temperature)
    first = verify(example(name), reseeded(batch, 7))
    second = verify(example(name), reseeded(batch, 7))
    assert torch.equal(first.output_token_ids, second.output_token_ids)
    assert torch.equal(first.decision.accepted, second.decision.accepted)


@pytest.mark.parametrize("temperature", TEMPS)
@pytest.mark.parametrize("name", LOSSY)
def test_relaxation_off_reproduces_lossless(name, temperature):
    spec = get_spec(name)
    if temperature > 0 and not spec.off_exact_when_sampling:
        # Declared in the registry: at T > 0 this rule's "off" setting still samples (e.g. the
        # K heads' tokens are K samples of p_t), so only greedy equality is promised.
        temperature = 0.0
    lossless = make_policy("lossless")
    off = make_policy(name, **spec.off)
    for seed in range(6):
        batch = make_batch(seed=seed, temperature=temperature, draft_noise=0.7)
        want = verify(lossless, reseeded(batch, seed))
        got = verify(off, reseeded(batch, seed))
        assert torch.equal(got.decision.accepted, want.decision.accepted), f"{name} off != lossless, seed {seed}"
        assert torch.equal(got.num_accepted, want.num_accepted)
        if temperature == 0.0:
            assert torch.equal(got.output_token_ids, want.output_token_ids)


@pytest.mark.parametrize("temperature", TEMPS)
@pytest.mark.parametrize("name", LOSSY)
def test_lossy_accepts_superset_of_lossless(name, temperature):
    spec = get_spec(name)
    params = [spec.example] + ([{**spec.leniency.fixed, spec.leniency.param: v} for v in spec.leniency.values] if spec.leniency else [])
    for seed in range(4):
        batch = make_batch(seed=seed, temperature=temperature)
        base = make_policy("lossless").decide(reseeded(batch, seed)).accepted
        for p in params:
            got = make_policy(name, **p).decide(reseeded(batch, seed)).accepted
            assert bool((got | ~base).all()), f"{name}{p} rejected a token lossless accepts (seed {seed})"


@pytest.mark.parametrize("temperature", TEMPS)
@pytest.mark.parametrize("name", LOSSY)
def test_acceptance_monotone_in_leniency(name, temperature):
    spec = get_spec(name)
    assert spec.leniency is not None, f"{name} must declare a leniency knob"
    knob = spec.leniency
    total = []
    for seed in range(4):
        batch = make_batch(seed=seed, temperature=temperature, draft_noise=2.0)
        prev = None
        for value in knob.values:
            acc = make_policy(name, **{**knob.fixed, knob.param: value}).decide(reseeded(batch, seed)).accepted
            if prev is not None:
                assert bool((acc | ~prev).all()), f"{name}: raising {knob.param} to {value!r} lost an acceptance"
            prev = acc
            total.append(int(acc.sum()))
    assert len(set(total)) > 1, f"{name}: the leniency knob {knob.param} changed nothing on these batches"


@pytest.mark.parametrize("name", RULES)
def test_missing_inputs_raise_or_are_not_needed(name):
    policy = example(name)
    for kwargs in ({"with_draft_logits": False}, {"with_hidden": False}):
        batch = make_batch(**kwargs)
        try:
            policy.decide(batch)
        except MissingInputError as err:
            assert name in str(err) or "any_of" == name


def test_dropmatch_without_hidden_states_says_so():
    with pytest.raises(MissingInputError, match="target_hidden"):
        make_policy("dropmatch").decide(make_batch(with_hidden=False))


def test_kl_judge_without_draft_logits_says_so():
    with pytest.raises(MissingInputError, match="draft_logits"):
        make_policy("kl_judge").decide(make_batch(with_draft_logits=False))


@pytest.mark.parametrize("name", RULES)
def test_bad_parameters_raise_naming_the_parameter(name):
    spec = get_spec(name)
    with pytest.raises(ValueError, match="not_a_knob"):
        make_policy(name, **spec.example, not_a_knob=1)
    for field in dataclasses.fields(spec.config_cls):
        valid = field.metadata.get("valid")
        if valid is None:
            continue
        bad_values = ["nonsense"] if valid.choices is None else ["nonsense", 3]
        if valid.low is not None:
            bad_values.append(valid.low - 1)
        if valid.high is not None:
            bad_values.append(valid.high + 1)
        if valid.choices is None:
            bad_values.append(math.nan)
        for bad in bad_values:
            with pytest.raises(ValueError, match=field.name):
                make_policy(name, **{**spec.example, field.name: bad})


@pytest.mark.parametrize("name", RULES)
def test_search_range_inside_valid_set(name):
    spec = get_spec(name)
    space = spec.config_cls.search_space()
    for pname, rng in space.items():
        ends = list(rng.choices) if rng.choices else [rng.low, rng.high]
        for value in ends:
            make_policy(name, **{**spec.example, pname: value})  # must validate


def test_unknown_policy_lists_valid_names():
    with pytest.raises(ValueError) as err:
        make_policy("kl_jduge")
    for name in RULES:
        assert name in str(err.value)


def test_every_lossy_rule_has_a_search_space():
    for name in LOSSY:
        if name == "any_of":
            continue  # a union of rules; its members carry the knobs
        assert get_spec(name).config_cls.search_space(), name


def _reads_draft(name: str) -> bool:
    from policies.registry import needs_draft_logits

    return needs_draft_logits(example(name))


def test_the_rules_said_to_read_the_draft_distribution_at_t0():
    assert {n for n in RULES if _reads_draft(n)} == {"kl_judge", "draft_entropy", "dropmatch", "any_of"}


@pytest.mark.parametrize("name", [n for n in RULES if not _reads_draft(n)])
def test_a_rule_said_not_to_read_the_draft_distribution_decides_alike_without_it(name):
    """The CPU engine drafts greedily over a proposal vocabulary and hands the draft's logits only to the rules
    ``needs_draft_logits`` says read them: the others must decide the same with and without them at T = 0."""
    from dataclasses import replace

    policy = example(name)
    for seed in (11, 12, 13):
        batch = make_batch(seed=seed, temperature=0.0)
        with_q = policy.decide(reseeded(batch, 5)).accepted
        without = policy.decide(reseeded(replace(batch, draft_logits=None), 5)).accepted
        assert torch.equal(with_q, without), name


# -- declared traits (policies.registry.Traits): what code outside policies/ reads instead of a rule's name ----------

def _traits(name: str):
    from policies import traits

    return traits(example(name))


@pytest.mark.parametrize("temperature", TEMPS)
@pytest.mark.parametrize("name", RULES)
def test_a_rule_gets_hidden_states_exactly_when_it_declares_it_needs_them(name, temperature):
    """Callers (the vLLM plugin) hand the target's hidden states and LM head only to a rule that declares
    ``needs_hidden``: it must refuse to decide without them, and every other rule decide alike without them."""
    batch = make_batch(seed=3, temperature=temperature)
    bare = dataclasses.replace(batch, target_hidden=None, lm_head_weight=None, lm_head_bias=None)
    if _traits(name).needs_hidden:
        with pytest.raises(MissingInputError, match="target_hidden|lm_head_weight"):
            example(name).decide(reseeded(bare, 5))
    else:
        with_hidden = verify(example(name), reseeded(batch, 5))
        without = verify(example(name), reseeded(bare, 5))
        assert torch.equal(with_hidden.output_token_ids, without.output_token_ids), name


@pytest.mark.parametrize("name", RULES)
def test_a_rule_draws_at_t0_exactly_when_it_declares_it(name):
    """At T = 0 a rule that does not declare ``draws_when_greedy`` decides alike from any generator state (the
    vLLM step then decides a group of requests with their own seeds in one call); one that declares it does not."""
    differs = False
    for seed in (21, 22, 23):
        batch = make_batch(seed=seed, temperature=0.0)
        outputs = [verify(example(name), reseeded(batch, g)).decision.accepted for g in (1, 2, 3)]
        differs |= any(not torch.equal(outputs[0], o) for o in outputs[1:])
    assert differs is _traits(name).draws_when_greedy, name


@pytest.mark.parametrize("temperature", TEMPS)
@pytest.mark.parametrize("name", RULES)
def test_a_rule_that_replays_exactly_decides_a_row_alike_whatever_rows_share_its_batch(name, temperature):
    """``replays_exactly``: a position's decision does not depend on the rows decided beside it (replay's pass
    decides hundreds of rows where a live round decides a few). With each row's draws from its own stream, the
    batch decided whole and row by row must agree, twice over."""
    from policies.randomness import RowStreams

    if not _traits(name).replays_exactly:
        pytest.skip("declares an inexact replay")
    batch = make_batch(seed=5, batch_size=4, temperature=temperature)
    keys = torch.tensor([11, 12, 13, 14])

    def rows(lo: int, hi: int) -> VerifyBatch:
        def cut(x):
            return None if x is None else x[lo:hi].clone()

        return dataclasses.replace(batch, draft_token_ids=cut(batch.draft_token_ids), draft_logits=cut(batch.draft_logits),
                                   target_logits=cut(batch.target_logits), target_hidden=cut(batch.target_hidden),
                                   generator=None, streams=RowStreams(keys[lo:hi]))

    whole = [verify(example(name), rows(0, 4)).output_token_ids for _ in range(2)]
    alone = torch.cat([verify(example(name), rows(i, i + 1)).output_token_ids for i in range(4)])
    assert torch.equal(whole[0], whole[1]) and torch.equal(whole[0], alone), name


def test_a_union_derives_its_traits_from_its_members():
    from policies import traits

    heads = ("dropmatch", {"mode": "exact", "p_drop": 0.3, "k": 4})
    union = traits(make_policy("any_of", members=(("kl_judge", {}), heads)))
    assert union.needs_hidden and union.draws_when_greedy and not union.replays_exactly
    plain = traits(make_policy("any_of", members=(("kl_judge", {}), ("top_k", {"k": 2}))))
    assert not (plain.needs_hidden or plain.draws_when_greedy) and plain.replays_exactly
    assert traits(make_policy("dropmatch", mode="exact", p_drop=0.0)).replays_exactly  # no dropout: one GEMM row alike
    assert traits(make_policy("dropmatch", mode="candidate")).replays_exactly


@pytest.mark.parametrize("name", RULES)
def test_a_rule_said_to_decide_on_the_distributions_never_looks_at_the_token(name):
    """``decides_on_distributions`` (what lets a certificate made under the coupled sampler cover the standard one):
    with the draft's token the target's own draw at some positions (the same in every variant) and one it does not
    draw at the others (lossless rejects there), what the rule accepts must not move when the latter are swapped for
    other such tokens, at every leniency; a rule that does not declare it must move for some."""
    from policies import traits
    from policies.coupling import gumbel, perturbed_argmax
    from policies.truncation import truncate

    spec = get_spec(name)
    configs = [dict(spec.example)] + ([{**spec.leniency.fixed, spec.leniency.param: v} for v in spec.leniency.values]
                                      if spec.leniency else [])
    moved = False
    for seed in range(6):
        batch = make_batch(seed=seed, temperature=1.0, draft_noise=2.0)
        if seed % 2:  # a truncated target (top-8): a token outside its set is one some rules look at
            batch = dataclasses.replace(batch, target_logits=truncate(batch.target_logits, 1.0, top_k=8))
        b, n = batch.draft_token_ids.shape
        noise = gumbel(seed, torch.arange(n + 1).expand(b, n + 1) + 100 * torch.arange(b).unsqueeze(1), batch.vocab_size)
        picked = perturbed_argmax(batch.target_f32[:, :n], 1.0, noise[:, :n])  # the target's draws
        order = batch.draft_f32.argsort(dim=-1, descending=True)  # candidates: the draft's likeliest tokens first
        swaps = []
        for shift in (0, 1, 2):  # the shift-th likeliest draft token that is not the target's draw
            ids = torch.stack([order[..., j] for j in range(4)], dim=-1)  # [B, L, 4]
            usable = ids != picked.unsqueeze(-1)
            other = torch.gather(ids, -1, usable.float().cumsum(-1).sub(1 + shift).abs().argmin(-1, keepdim=True))
            keep = torch.rand(b, n, generator=torch.Generator().manual_seed(seed)) < 0.5  # the same in every variant
            swaps.append(torch.where(keep, picked, other.squeeze(-1)))
        for config in configs:
            rule = make_policy(name, **config)
            decided = [rule.decide(reseeded(dataclasses.replace(batch, draft_token_ids=d, coupling=noise), 3)).accepted
                       for d in swaps]
            moved |= any(not torch.equal(decided[0], x) for x in decided[1:])
            # and never vetoes what lossless accepts (the draft's token where the target draws it): the argument
            # needs "lossless, or a relaxation of (p, q)", so a rule without lossless's acceptances is no such rule
            assert all(bool(x[keep].all()) for x in decided), (name, config)
    assert moved is not traits(make_policy(name, **spec.example)).decides_on_distributions, name
