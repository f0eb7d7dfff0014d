"""The vLLM plugin's step decision without vLLM: a rule that cannot decide a step (an input missing, or
it raised) leaves that step to the lossless rule, per request, counted — never an exception.

vLLM passes ``draft_probs=None`` for the whole step when it lost a request's cached draft
probabilities ("Missing cached draft probabilities for request ...; falling back to legacy speculative
rejection behavior"); these tests drive :func:`workers.vllm.step.decide_step` with exactly that.
Runs in the main environment (no vLLM import)."""

from __future__ import annotations

import json

import pytest
import torch

from policies import make_policy
from policies.ragged import verify_flat
from workers.vllm.step import LEDGER, decide_step, keyed_seed

V, D = 24, 8


def step_inputs(num: list[int], seed: int = 0, vocab: int = V):
    g = torch.Generator().manual_seed(seed)
    n = sum(num)
    target = torch.randn(n, vocab, generator=g) * 3
    draft = target + torch.randn(n, vocab, generator=g)
    ids = torch.randint(0, vocab, (n,), generator=g)
    ids[::2] = target[::2].argmax(-1)  # some drafts are the target's argmax: accepted runs exist
    return dict(draft_token_ids=ids.to(torch.int32), num_draft_tokens=num, max_spec_len=max(num),
                target_logits=target, bonus_token_ids=torch.randint(0, vocab, (len(num), 1), generator=g)), draft, g


def lossless(inputs, temperature: float, seed: int):
    """policies' lossless over the same rows, no draft distribution (q one-hot at the draft)."""
    num = torch.tensor(inputs["num_draft_tokens"])
    return verify_flat(make_policy("lossless"), draft_token_ids=inputs["draft_token_ids"].long(), num_draft_tokens=num,
                       target_logits=inputs["target_logits"], bonus_token_ids=inputs["bonus_token_ids"][:, 0],
                       temperature=temperature, generator=torch.Generator().manual_seed(seed)).output_token_ids


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("rule", [("kl_judge", {"threshold": 0.5}), ("dropmatch", {"criterion": "js"}),
                                  ("draft_entropy", {"threshold": 1.0}),
                                  ("any_of", {"members": (("top_k", {"k": 2}), ("kl_judge", {"threshold": 1.0}))})])
def test_missing_draft_distribution_falls_back_to_lossless(rule, temperature):
    inputs, _, g = step_inputs([4, 0, 3, 4])
    hidden = torch.randn(sum(inputs["num_draft_tokens"]), D, generator=g)
    head = (torch.randn(V, D, generator=g), None)
    out = decide_step(make_policy(rule[0], **rule[1]), **inputs, temperatures=[temperature] * 4, draft_logits=None,
                      target_hidden=hidden, lm_head=lambda: head, seed=3, step=7)
    assert torch.equal(out.output_token_ids.long(), lossless(inputs, temperature, 3 * 1_000_003 + 7))
    assert out.output_token_ids.dtype == torch.int32 and out.output_token_ids.shape == (4, 5)
    assert out.fallback == ["missing draft distribution"] * 4  # per request (the empty one is not counted)


def test_missing_hidden_states_fall_back_for_dropmatch_only_where_needed():
    inputs, draft, _ = step_inputs([3, 3])
    out = decide_step(make_policy("dropmatch", criterion="naive"), **inputs, temperatures=[0.0, 0.0],
                      draft_logits=draft, target_hidden=None, lm_head=None)
    assert out.fallback == ["missing target hidden states"] * 2
    assert torch.equal(out.output_token_ids.long(), lossless(inputs, 0.0, 0))
    ok = decide_step(make_policy("top_k", k=4), **inputs, temperatures=[0.0, 0.0], draft_logits=None)
    assert ok.fallback == [None, None], "a rule that needs neither input decides on its own"


def test_groups_fall_back_independently_by_temperature():
    """Requests are grouped by temperature; a group's failure does not touch the others' decisions."""
    inputs, draft, _ = step_inputs([4, 4, 4])
    policy = make_policy("kl_judge", threshold=0.5)
    full = decide_step(policy, **inputs, temperatures=[0.0, 0.7, 0.0], draft_logits=draft)
    assert full.fallback == [None, None, None]
    missing = decide_step(policy, **inputs, temperatures=[0.0, 0.7, 0.0], draft_logits=None)
    assert missing.fallback == ["missing draft distribution"] * 3


def test_a_raising_rule_or_broken_logits_never_raise():
    class Boom:
        name, config = "boom", make_policy("lossless").config

        def decide(self, batch):
            raise RuntimeError("bug in a rule")

    inputs, draft, _ = step_inputs([3, 2])
    out = decide_step(Boom(), **inputs, temperatures=[0.0, 0.0], draft_logits=draft)
    assert out.fallback == ["rule error (RuntimeError)"] * 2
    assert torch.equal(out.output_token_ids.long(), lossless(inputs, 0.0, 0))
    # NaN logits at T > 0: sampling (inverse CDF on the device, no host read) gives each broken row its
    # argmax instead of raising: no raise, every request still emits a valid token
    inputs["target_logits"] = torch.full_like(inputs["target_logits"], float("nan"))
    out = decide_step(make_policy("kl_judge", threshold=0.5), **inputs, temperatures=[1.0, 1.0], draft_logits=draft)
    rows = out.output_token_ids
    assert rows.shape == (2, 4) and bool(((rows >= 0).sum(1) >= 1).all()), "every request still emits a token"
    assert bool((rows < inputs["target_logits"].shape[-1]).all())


def test_the_fallback_is_lossless_at_t_gt_0_for_any_drafter():
    """Drafts sampled from some q, q not passed: accept with p_t(d), recover from p_t without d. The
    first emitted token is distributed as p_t exactly (checked against exact draws' own spread)."""
    vocab, n = 6, 40_000
    g = torch.Generator().manual_seed(1)
    target_row, draft_row = torch.randn(vocab, generator=g) * 1.5, torch.randn(vocab, generator=g) * 1.5
    p = torch.softmax(target_row, -1)
    drafts = torch.multinomial(torch.softmax(draft_row, -1), n, replacement=True, generator=g)
    inputs = dict(draft_token_ids=drafts.to(torch.int32), num_draft_tokens=[1] * n, max_spec_len=1,
                  target_logits=target_row.expand(n, vocab).clone(), bonus_token_ids=torch.zeros(n, 1, dtype=torch.long))
    out = decide_step(make_policy("kl_judge", threshold=0.3), **inputs, temperatures=[1.0] * n, draft_logits=None,
                      seed=5)
    assert out.fallback[0] == "missing draft distribution"
    first = out.output_token_ids[:, 0].long()
    tv = 0.5 * float((torch.bincount(first, minlength=vocab) / n - p).abs().sum())
    floor = [0.5 * float((torch.bincount(torch.multinomial(p, n, replacement=True, generator=g), minlength=vocab) / n
                          - p).abs().sum()) for _ in range(10)]
    assert tv <= 2.0 * max(floor), (tv, floor)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_lossless_with_per_request_seeds_is_exact_at_t_gt_0(temperature):
    """Every request its own rule and seed: one call, each row drawing from its own counter-based stream
    (acceptance uniforms and the residual draw). Drafts sampled from q at T, q handed over: the first
    emitted token is distributed as softmax(z / T) exactly (chi-square over 40,000 requests)."""
    from scipy import stats

    vocab, n = 6, 40_000
    g = torch.Generator().manual_seed(3)
    target_row, draft_row = torch.randn(vocab, generator=g) * 1.5, torch.randn(vocab, generator=g) * 1.5
    p = torch.softmax(target_row / temperature, -1)
    drafts = torch.multinomial(torch.softmax(draft_row / temperature, -1), n, replacement=True, generator=g)
    rule = make_policy("lossless")
    inputs = dict(draft_token_ids=drafts.to(torch.int32), num_draft_tokens=[1] * n, max_spec_len=1,
                  target_logits=target_row.expand(n, vocab).clone(), bonus_token_ids=torch.zeros(n, 1, dtype=torch.long))
    out = decide_step(rule, **inputs, temperatures=[temperature] * n, draft_logits=draft_row.expand(n, vocab).clone(),
                      policies=[rule] * n, keys=["r"] * n, request_seeds=[keyed_seed(1, i, 0) for i in range(n)])
    assert out.fallback == [None] * n
    counts = torch.bincount(out.output_token_ids[:, 0].long(), minlength=vocab).double()
    expected = p.double() / p.double().sum() * n
    assert stats.chisquare(counts.numpy(), expected.numpy()).pvalue > 1e-3


def test_the_ledger_counts_per_request_and_in_total():
    LEDGER.take()
    before = json.loads(json.dumps(LEDGER.totals))
    LEDGER.record(["a-1", "b-2", "c-3"], [3, 0, 2], ["missing draft distribution", "x", None], ["d1", "d1", "d2"])
    taken = LEDGER.take()
    assert taken["requests"] == {
        "a-1": {"steps": 1, "lossless_fallback_steps": 1, "reasons": {"missing draft distribution": 1},
                "rules": {"d1": 1}},
        "c-3": {"steps": 1, "lossless_fallback_steps": 0, "reasons": {}, "rules": {"d2": 1}}}  # b drafted nothing
    assert taken["totals"]["lossless_fallback_steps"] == before["lossless_fallback_steps"] + 1
    assert taken["totals"]["request_steps"] == before["request_steps"] + 2
    assert LEDGER.take()["requests"] == {}


# -- per-request rules ------------------------------------------------------------------------------

def test_requests_are_grouped_by_their_own_rule():
    """Each request decided by its own rule equals that rule deciding it alone; the rest use the default."""
    inputs, draft, _ = step_inputs([4, 4, 4, 4], seed=3)
    lenient, strict = make_policy("top_k", k=8), make_policy("lossless")
    got = decide_step(strict, **inputs, temperatures=[0.0] * 4, draft_logits=draft,
                      policies=[lenient, None, lenient, None], keys=["k8", None, "k8", None],
                      request_seeds=[0, None, 0, None])
    alone = decide_step(lenient, **inputs, temperatures=[0.0] * 4, draft_logits=draft)
    default = decide_step(strict, **inputs, temperatures=[0.0] * 4, draft_logits=draft)
    for i in range(4):
        want = alone if i in (0, 2) else default
        assert torch.equal(got.output_token_ids[i], want.output_token_ids[i]), i


def one_request(inputs, draft, i):
    num = inputs["num_draft_tokens"]
    lo = sum(num[:i])
    rows = slice(lo, lo + num[i])
    return dict(draft_token_ids=inputs["draft_token_ids"][rows], num_draft_tokens=[num[i]], max_spec_len=num[i],
                target_logits=inputs["target_logits"][rows], bonus_token_ids=inputs["bonus_token_ids"][i:i + 1]), \
        draft[rows]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_keyed_draws_do_not_depend_on_the_rest_of_the_batch(temperature):
    """Random draws keyed by (rule seed, request seed, position): a request decides the same alone or
    in any batch (DropMatch's dropout masks at T = 0, sampling at T > 0)."""
    inputs, draft, g = step_inputs([4, 3, 4], seed=5)
    hidden = torch.randn(sum(inputs["num_draft_tokens"]), D, generator=g)
    head = (torch.randn(V, D, generator=g), None)
    policy = make_policy("dropmatch", criterion="naive", k=3, p_drop=0.5, mode="exact")
    seeds = [keyed_seed(7, s, pos) for s, pos in ((0, 10), (1, 10), (0, 11))]
    batch = decide_step(policy, **inputs, temperatures=[temperature] * 3, draft_logits=draft, target_hidden=hidden,
                        lm_head=lambda: head, policies=[policy] * 3, keys=["r"] * 3, request_seeds=seeds)
    for i in range(3):
        single, q = one_request(inputs, draft, i)
        lo = sum(inputs["num_draft_tokens"][:i])
        h = hidden[lo:lo + inputs["num_draft_tokens"][i]]
        alone = decide_step(policy, **single, temperatures=[temperature], draft_logits=q, target_hidden=h,
                            lm_head=lambda: head, policies=[policy], keys=["r"], request_seeds=[seeds[i]])
        width = alone.output_token_ids.shape[1]
        assert torch.equal(batch.output_token_ids[i, :width], alone.output_token_ids[0]), i
    assert keyed_seed(7, 0, 10) != keyed_seed(7, 0, 11) != keyed_seed(8, 0, 11)


def test_an_invalid_request_rule_falls_back_to_lossless():
    from workers.vllm.rules import REQUEST_RULES

    bad = REQUEST_RULES.get({"policy": "kl_judge", "params": {"threshold": -1}})
    assert bad.digest == "invalid"
    inputs, draft, _ = step_inputs([3, 3])
    out = decide_step(make_policy("lossless"), **inputs, temperatures=[0.0, 0.0], draft_logits=draft,
                      policies=[bad.policy, None], keys=[bad.digest, None], request_seeds=[0, None])
    assert out.fallback == ["invalid per-request rule", None]
    good = REQUEST_RULES.get({"policy": "top_k", "params": {"k": 4}, "seed": 2})
    assert good.policy.name == "top_k" and good.spec == {"policy": "top_k", "params": {"k": 4}, "seed": 2}
    assert REQUEST_RULES.get({"policy": "top_k", "params": {"k": 4}, "seed": 2}) is good, "built once"


def test_unseeded_requests_draw_from_streams_of_their_own():
    """``seed or 0`` gave the children of an unseeded ``n > 1`` request (vLLM names them "<index>_<parent>")
    the same numbers; now each child has its own stream, while a plain unseeded request keeps stream 0 at
    T = 0 (a rule with its own seed decides the same in every batch) and a set seed (0 included) is kept.
    Unseeded at T > 0, each request draws from a stream of its own (a hash of its id)."""
    from types import SimpleNamespace

    from workers.vllm.plugin import STEP, _read_request_rules, request_seed

    rule = {"policy": "top_k", "params": {"k": 4}, "seed": 2}

    def state(seed):
        return SimpleNamespace(sampling_params=SimpleNamespace(seed=seed, extra_args={"spectune_rule": rule}),
                               num_computed_tokens=5)

    runner = SimpleNamespace(requests={"0_parent": state(None), "1_parent": state(None), "17": state(None),
                                       "s": state(7)})
    _read_request_rules(runner, ["0_parent", "1_parent", "17", "s"])
    try:
        a, b, plain, seeded = STEP.request_seeds
        assert a != b, "two children of one request must not share a stream"
        assert plain == 0 and request_seed("23", None) == 0, "a plain request: the same stream in every call"
        assert seeded == 7 and request_seed("x", 0) == 0, "a set seed is kept"
        assert keyed_seed(2, a, 5) != keyed_seed(2, b, 5)
    finally:
        STEP.rules = STEP.request_seeds = STEP.positions = None
    # unseeded at T > 0 (a server's requests reach vLLM with no seed): each request a stream of its own
    runner = SimpleNamespace(requests={rid: SimpleNamespace(
        sampling_params=SimpleNamespace(seed=None, temperature=0.8, extra_args={"spectune_rule": rule}),
        num_computed_tokens=5) for rid in ("cmpl-a", "cmpl-b")})
    _read_request_rules(runner, ["cmpl-a", "cmpl-b"])
    try:
        a, b = STEP.request_seeds
        assert a != b and a == request_seed("cmpl-a", None, 0.8) and 0 <= a < 2 ** 63
        assert request_seed("cmpl-a", 3, 0.8) == 3 and request_seed("cmpl-a", None, 0.0) == 0
        assert request_seed("cmpl-a", None, 1e-6) == 0, "below vLLM's _SAMPLING_EPS a request decodes greedily"
    finally:
        STEP.rules = STEP.request_seeds = STEP.positions = None


# -- drafts the drafter never made, and argmax drafts at T > 0 ----------------------------------------------

LENIENT = [("top_k", {"k": 4}), ("typical", {}), ("dropmatch", {"criterion": "naive", "k": 4}), ("lossless", {})]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("rule", LENIENT, ids=[r[0] for r in LENIENT])
def test_drafts_the_drafter_skipped_are_rejected_by_every_rule(rule, temperature):
    """Near max_model_len vLLM skips the drafter for the whole batch and the next step's drafts are token id
    0 with no distribution. Token 0 is the target's argmax there, so top-k, typical and DropMatch-naive
    accepted these non-drafts (the lossless one too, harmlessly at T = 0). Marked as skipped, every rule
    rejects the first one and the target's own token is emitted — from p_t at T > 0, token 0 included (no
    residual of a draft that was never made) — counted as a fallback; the other requests are untouched."""
    from workers.vllm.step import SKIPPED

    num = [3, 3, 2]
    inputs, _, g = step_inputs(num, seed=4)
    target = inputs["target_logits"]
    target[:3, 0] = 40.0  # request 0's rows: token 0 is (all but) certain under the target
    inputs["draft_token_ids"][:3] = 0
    hidden, head = torch.randn(sum(num), D, generator=g), (torch.randn(V, D, generator=g), None)
    common = dict(temperatures=[temperature] * 3, draft_logits=None, target_hidden=hidden, lm_head=lambda: head, seed=1)
    policy = make_policy(rule[0], **rule[1])
    plain = decide_step(policy, **inputs, **common)
    assert plain.output_token_ids[0, :3].tolist() == [0, 0, 0], "unmarked, token-0 drafts are accepted"
    out = decide_step(policy, **inputs, **common, skipped=[True, False, False])
    assert out.output_token_ids[0].tolist() == [0, -1, -1, -1], "rejected; the target's token (0) emitted"
    assert out.fallback == [SKIPPED, None, None]
    assert torch.equal(out.output_token_ids[1:], plain.output_token_ids[1:]) or temperature > 0
    assert inputs["draft_token_ids"][:3].tolist() == [0, 0, 0], "the caller's drafts are left as they were"


def test_argmax_drafts_at_t_gt_0_are_not_judged_with_the_handed_over_q():
    """Greedy drafting (draft_sample_method="greedy") hands the rules softmax(draft logits) for drafts that
    are its argmax: at T > 0 lossless would not be lossless with it. Flagged, T > 0 groups get no q (q
    one-hot at the draft: what was proposed) and rules that read q fall back to lossless, counted; T = 0
    groups keep the T = 1 distribution."""
    from workers.vllm.step import GREEDY_AT_T

    inputs, draft, _ = step_inputs([4, 4, 4], seed=5)
    temps = [0.8, 0.0, 0.8]
    lossless_rule = make_policy("lossless")
    got = decide_step(lossless_rule, **inputs, temperatures=temps, draft_logits=draft, greedy_drafts=True, seed=2)
    want = decide_step(lossless_rule, **inputs, temperatures=temps, draft_logits=None, seed=2)
    assert torch.equal(got.output_token_ids, want.output_token_ids) and got.fallback == [None] * 3
    kl = make_policy("kl_judge", threshold=0.5)
    out = decide_step(kl, **inputs, temperatures=temps, draft_logits=draft, greedy_drafts=True, seed=2)
    assert out.fallback == [GREEDY_AT_T, None, GREEDY_AT_T]
    t0 = decide_step(kl, **inputs, temperatures=temps, draft_logits=draft, seed=2)
    assert torch.equal(out.output_token_ids[1], t0.output_token_ids[1])
