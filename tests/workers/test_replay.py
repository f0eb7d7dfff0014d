"""Replay at T = 0 is exact: for every registered rule, on the tiny pair, the replayed output tokens,
acceptance counts and modelled cost equal a full speculative decode's, item by item and L by L; so at T > 0
under the coupled sampler on the int8 path; T > 0 under the standard sampler is refused (decoded in full by the
callers); a decision depends on its position alone (the masks are keyed by
the seed and the absolute position)."""

from __future__ import annotations

import pytest
import torch

from policies import POLICIES, get_spec, make_policy
from policies.coupling import CoupledDraw
from workers.cpu_engine import SpecDecoder
from workers.metrics.cost import modelled_cost
from workers.models.pair import load_pair
from workers.replay import REPLAY_VERSION, NotReplayable, decisions, draw_for, forced_pass, replay

PROMPTS = ["Hello world, this is a test", "Q: 12 + 30 = ?\nA:", "def add(a, b):\n    return", "The quick brown fox",
           "x", "Natalia sold clips to 48 of her friends in April, and then half as many in May."]
LENIENT = {"kl_judge": {"threshold": 3.0, "confidence": 1.0}, "top_k": {"k": 8}, "typical": {"epsilon": 0.05},
           "target_entropy": {"threshold": 3.0}, "draft_entropy": {"threshold": 3.0},
           "relaxed_topk": {"n": 4, "delta": 0.5}, "dropmatch": {"k": 4, "p_drop": 0.5, "criterion": "naive"},
           "fly": {"window": 1, "entropy_threshold": 0.0, "top_k": 8}}
FIELDS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_position", "target_forwards",
          "draft_forwards", "num_generated")


@pytest.fixture(scope="module")
def engine() -> SpecDecoder:
    # a proposal vocabulary of half the base ids: greedy drafting as on the real pair (workers.models.proposal)
    return SpecDecoder(load_pair("tiny-random", dtype=torch.float32), proposal_size=128)


def _cases():
    for name in sorted(POLICIES):
        yield name, dict(get_spec(name).example)
        if name in LENIENT:
            yield name, LENIENT[name]


@pytest.mark.parametrize("name,params", list(_cases()), ids=lambda v: v if isinstance(v, str) else ",".join(
    f"{k}={x}" for k, x in v.items()) if isinstance(v, dict) else str(v))
def test_replay_equals_full_speculative_decoding_for_every_rule(engine, name, params):
    policy = make_policy(name, **params)
    outcomes = []
    for i, text in enumerate(PROMPTS):
        ids = engine.pair.tokenizer.encode(text)
        stop = ["e"] if i == 3 else None  # one prompt ends on a stop string
        ref = engine.autoregressive(ids, max_new_tokens=40, stop=stop)
        forced = forced_pass(engine, ids, ref.token_ids, ref.finish_reason, extend=5 if i % 2 else 0)
        acc = decisions(engine, forced, policy, seed=3)
        for draft_len in (1, 3, 5):
            got = replay(engine, ids, ref, policy, draft_len, 40, seed=3, stop=stop, forced=forced, accepted=acc)
            full = engine.generate(ids, policy, draft_len=draft_len, max_new_tokens=40, seed=3, stop=stop)
            where = f"{name} {params} prompt {i} L={draft_len} ({got.reason})"
            assert got.generation.token_ids == full.token_ids, where
            assert got.generation.finish_reason == full.finish_reason, where
            for f in FIELDS:
                assert getattr(got.generation.stats, f) == getattr(full.stats, f), (where, f)
            assert modelled_cost(got.generation.stats, 0.4) == modelled_cost(full.stats, 0.4), where
            outcomes.append(got.reason)
    assert "near-tie" not in outcomes, "fp32 on the tiny pair: the pass agrees with incremental decoding"


def test_lossless_replays_without_decoding_what_never_leaves_the_prefix(engine):
    reasons = []
    for text in PROMPTS:
        ids = engine.pair.tokenizer.encode(text)
        ref = engine.autoregressive(ids, max_new_tokens=40)
        for draft_len in (1, 3, 5):
            reasons.append(replay(engine, ids, ref, "lossless", draft_len, 40).reason)
    # the pass continues past EOS / a stop string with the target's own tokens (extend = L): lossless never
    # leaves that prefix, so nothing is decoded at all
    assert set(reasons) == {"exact"}, reasons


def test_lenient_rules_diverge_and_are_decoded_from_the_round_that_left_the_prefix(engine):
    policy = make_policy("kl_judge", threshold=3.0, confidence=1.0)
    reasons = []
    for text in PROMPTS:
        ids = engine.pair.tokenizer.encode(text)
        ref = engine.autoregressive(ids, max_new_tokens=40)
        got = replay(engine, ids, ref, policy, 4, 40)
        reasons.append(got.reason)
        if got.reason == "diverged":
            assert got.decoded_from <= got.diverged_at < len(ref.token_ids)
            assert got.generation.token_ids[: got.diverged_at] == ref.token_ids[: got.diverged_at]
            assert got.generation.token_ids != ref.token_ids
    assert "diverged" in reasons, reasons


def test_sampling_is_not_replayed_under_the_standard_sampler(engine):
    ids = engine.pair.tokenizer.encode(PROMPTS[0])
    ref = engine.autoregressive(ids, max_new_tokens=8)
    with pytest.raises(NotReplayable, match="needs the coupled sampler"):
        replay(engine, ids, ref, "lossless", 3, 8, temperature=0.7)


def test_a_reference_made_with_another_budget_is_not_replayed_from(engine):
    ids = engine.pair.tokenizer.encode(PROMPTS[0])
    ref = engine.autoregressive(ids, max_new_tokens=8)
    assert ref.finish_reason == "length"
    for budget in (6, 12):  # fewer tokens than it holds; more than a budget-bound run would have stopped at
        with pytest.raises(NotReplayable, match="made with other settings"):
            replay(engine, ids, ref, "lossless", 3, budget)
    assert replay(engine, ids, ref, "lossless", 3, 8).generation.token_ids == ref.token_ids


def test_a_decision_depends_on_its_position_not_on_the_block(engine):
    """DropMatch's masks at T = 0 are keyed by (seed, absolute position): the same draft slot gets the same
    decision in a one-slot block as in the pass's one block of every position."""
    from policies import VerifyBatch
    from policies.randomness import PositionStreams

    policy = make_policy("dropmatch", k=3, p_drop=0.5, criterion="naive")
    ids = engine.pair.tokenizer.encode(PROMPTS[1])
    ref = engine.autoregressive(ids, max_new_tokens=12)
    forced = forced_pass(engine, ids, ref.token_ids, ref.finish_reason)
    acc, drafts = decisions(engine, forced, policy, seed=5)
    for t in range(forced.positions):
        one = VerifyBatch(draft_token_ids=drafts[t: t + 1].view(1, 1), draft_logits=forced.draft_logits[t: t + 1][None],
                          target_logits=forced.target_logits[[t, t]][None], target_hidden=forced.target_hidden[[t, t]][None],
                          lm_head_weight=engine.lm_head_weight, lm_head_bias=engine.lm_head_bias, temperature=0.0,
                          streams=PositionStreams(5, torch.tensor([[forced.prompt_len + t]])))
        assert bool(policy.decide(one).accepted[0, 0]) == bool(acc[t]), t


def test_a_reference_replay_cannot_use_is_decoded_in_full_and_said_so(engine):
    """An engine never fails an item because its reference is unusable for replay: it decodes in full."""
    from workers.benchmarks import get_benchmark
    from workers.evaluation import TARGET_ONLY, DecodeSpec, evaluate_item, reference_payload

    bench = get_benchmark("gsm8k")
    item = bench.items(limit=1)[0]
    ref = evaluate_item(engine, bench, item, DecodeSpec.make(TARGET_ONLY, max_new_tokens=8))
    spec = DecodeSpec.make("kl_judge", {"threshold": 0.5}, 3, max_new_tokens=8)
    broken = {**reference_payload(ref), "finish": []}  # a record written without its finish reasons
    got = evaluate_item(engine, bench, item, spec, broken)
    want = evaluate_item(engine, bench, item, spec)
    assert not got.failed and got.replay == "full (replay failed: IndexError)" and got.timed
    assert got.output_token_ids == want.output_token_ids
    assert got.replay_version == want.replay_version == 0, "decoded in full: no replay semantics to name"
    replayed = evaluate_item(engine, bench, item, spec, reference_payload(ref))
    assert replayed.replay and not replayed.timed and replayed.replay_version == REPLAY_VERSION
    assert replayed.output_token_ids == want.output_token_ids
    ok = evaluate_item(engine, bench, item, spec, reference_payload(ref))
    assert ok.replay and not ok.timed and ok.output_token_ids == want.output_token_ids


def test_a_reference_that_ended_on_an_eos_the_pass_does_not_pick_is_decoded_from_the_round_that_reaches_it():
    """A near-tie at the very end: the reference stopped on EOS, the pass's argmax there is another token.
    Any round that reaches that row is decoded live (never simulated on the pass's guess)."""
    from workers.replay import Forced, simulate

    logits = torch.full((3, 10), -5.0)
    for row, tok in enumerate((5, 6, 7)):  # rows 0, 1 give y = [5, 6]; row 2: the pass says 7, not EOS (9)
        logits[row, tok] = 5.0
    forced = Forced(4, [5, 6], "eos", logits, torch.zeros(3, 4), logits.clone(), logits.argmax(-1), agrees=2, near_ties=0,
                    tail_ok=False)
    sim = simulate(torch.tensor([True, True, True]), torch.tensor([5, 6, 9]), forced, 3, 16)
    assert (sim.resume_at, sim.reason) == (0, "past the pass")
    eos = logits.clone()
    eos[2] = -5.0
    eos[2, 9] = 5.0  # consistent: the pass picks the EOS the reference stopped on
    ok = Forced(4, [5, 6], "eos", eos, torch.zeros(3, 4), eos.clone(), eos.argmax(-1), agrees=2, near_ties=0)
    done = simulate(torch.tensor([True, True, False]), torch.tensor([5, 6, 9]), ok, 1, 16)
    assert done.resume_at is None and done.stats.num_drafts == 2 and done.stats.num_generated == 2


def test_a_look_ahead_rule_decodes_from_the_round_whose_window_could_defer(engine):
    """FLy's window reads rows a live verify pass conditions on the draft's token: where a rejection could be
    deferred within the round, replay decodes from that round's start and says so; at L <= W it never could."""
    policy = make_policy("fly", window=1, entropy_threshold=0.0, top_k=8)
    reasons = {1: [], 4: []}
    for text in PROMPTS:
        ids = engine.pair.tokenizer.encode(text)
        ref = engine.autoregressive(ids, max_new_tokens=40)
        for draft_len in reasons:
            reasons[draft_len].append(replay(engine, ids, ref, policy, draft_len, 40).reason)
    assert "look-ahead" in reasons[4], reasons
    assert "look-ahead" not in reasons[1], reasons


@pytest.fixture(scope="module", params=["int8", "int4+int8"])
def int8_engine(request) -> SpecDecoder:
    return SpecDecoder(load_pair("tiny-random", dtype=request.param), proposal_size=128)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_on_the_int8_path_at_one_thread_replay_is_full_decoding_for_every_rule(int8_engine, name):
    """What confirmation relies on (``workers.replay.exact_for``): on the row-exact fast path (int8, and its 4-bit
    draft), at the sweep actors' one thread, the pass holds the numbers incremental decoding computes: no near-tie,
    and every rule's replayed run is its full decode, token for token and count for count."""
    from workers.replay import exact_for

    assert exact_for("int8") and exact_for("int4+int8") and not exact_for("bf16") and not exact_for("fp32")
    assert not exact_for("nonsense") and not exact_for("int4+int8", threads=2)
    engine = int8_engine
    policy = make_policy(name, **LENIENT.get(name, dict(get_spec(name).example)))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for i, text in enumerate(PROMPTS[:4]):
            ids = engine.pair.tokenizer.encode(text)
            ref = engine.autoregressive(ids, max_new_tokens=32)
            forced = forced_pass(engine, ids, ref.token_ids, ref.finish_reason, extend=4)
            assert forced.agrees >= len(ref.token_ids) and forced.tail_ok, (name, i)
            acc = decisions(engine, forced, policy, seed=1)
            for draft_len in (1, 4):
                got = replay(engine, ids, ref, policy, draft_len, 32, seed=1, forced=forced, accepted=acc)
                full = engine.generate(ids, policy, draft_len=draft_len, max_new_tokens=32, seed=1)
                where = f"{name} prompt {i} L={draft_len} ({got.reason})"
                assert got.reason != "near-tie", where
                assert got.generation.token_ids == full.token_ids, where
                for f in FIELDS:
                    assert getattr(got.generation.stats, f) == getattr(full.stats, f), (where, f)
    finally:
        torch.set_num_threads(threads)


COUPLED = [dict(temperature=0.7, top_k=20, top_p=0.8), dict(temperature=1.0)]


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_under_the_coupled_sampler_replay_is_full_decoding_for_every_rule(int8_engine, name):
    """At T > 0 under the coupled sampler (truncated as Qwen2.5 recommends, and untruncated at T 1), on the int8 path
    at one thread: the pass's draws are the target-only run's tokens, lossless replays without decoding a token, and
    every rule's replayed run is its full decode, token for token and count for count (its random numbers keyed by
    position, as the noise is)."""
    engine = int8_engine
    policy = make_policy(name, **LENIENT.get(name, dict(get_spec(name).example)))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    reasons = []
    try:
        for sampling in COUPLED:
            for i, text in enumerate(PROMPTS[:4]):
                ids = engine.pair.tokenizer.encode(text)
                stop = ["e"] if i == 3 else None
                settings = dict(max_new_tokens=32, seed=11 + i, stop=stop, sampler="coupled", **sampling)
                ref = engine.autoregressive(ids, **settings)
                draw = draw_for(sampling["temperature"], sampling.get("top_k", 0), sampling.get("top_p", 1.0),
                                "coupled", 11 + i)
                forced = forced_pass(engine, ids, ref.token_ids, ref.finish_reason, extend=4, draw=draw)
                assert forced.agrees >= len(ref.token_ids) and forced.tail_ok, (name, i, sampling)
                acc = decisions(engine, forced, policy, seed=11 + i)
                for draft_len in (1, 4):
                    got = replay(engine, ids, ref, policy, draft_len, forced=forced, accepted=acc, **settings)
                    full = engine.generate(ids, policy, draft_len=draft_len, **settings)
                    where = f"{name} {sampling} prompt {i} L={draft_len} ({got.reason})"
                    assert got.reason != "near-tie", where
                    assert got.generation.token_ids == full.token_ids, where
                    for f in FIELDS:
                        assert getattr(got.generation.stats, f) == getattr(full.stats, f), (where, f)
                    if name == "lossless":
                        assert got.reason == "exact" and full.token_ids == ref.token_ids, where
                    reasons.append(got.reason)
    finally:
        torch.set_num_threads(threads)
    if name == "lossless":
        assert sum(1 for r in reasons if r == "exact") == len(reasons)


def test_a_coupled_pass_is_not_used_for_another_draw(int8_engine):
    engine = int8_engine
    ids = engine.pair.tokenizer.encode(PROMPTS[1])
    settings = dict(max_new_tokens=8, temperature=0.7, seed=2, sampler="coupled")
    ref = engine.autoregressive(ids, **settings)
    forced = forced_pass(engine, ids, ref.token_ids, ref.finish_reason, draw=draw_for(0.7, 0, 1.0, "coupled", 2))
    with pytest.raises(ValueError, match="the pass was made for"):
        replay(engine, ids, ref, "lossless", 3, forced=forced, **{**settings, "seed": 3})
    with pytest.raises(ValueError, match="coupled sampler draws at T > 0"):
        CoupledDraw(0.0, 0, 1.0, 1)


def test_a_pass_that_fails_part_way_leaves_no_cache_behind(engine):
    """The teacher-forced pass fills both models' caches: one that fails (here a token id past the vocabulary)
    drops them, so the full decode the caller falls back to never reuses half-written entries."""
    ids = engine.pair.tokenizer.encode(PROMPTS[2])
    ref = engine.autoregressive(ids, max_new_tokens=8)
    with pytest.raises((IndexError, RuntimeError)):
        forced_pass(engine, ids, [*ref.token_ids[:3], engine.pair.vocab_size + 10], "length")
    assert engine.target.length == 0 and engine.draft.length == 0
    again = engine.autoregressive(ids, max_new_tokens=8)
    assert again.token_ids == ref.token_ids


def test_a_multi_turn_item_replays_turn_by_turn_as_full_decoding_would(engine):
    """MT-bench's second turn follows the first turn's output: replayed while every turn before kept the
    reference's output, decoded in full after one that left it; the record equals full decoding's either way."""
    from workers.benchmarks import get_benchmark
    from workers.evaluation import TARGET_ONLY, DecodeSpec, evaluate_item, reference_payload

    bench = get_benchmark("mtbench")
    items = bench.items(limit=2)
    kinds = set()
    for params in ({}, {"threshold": 3.0, "confidence": 1.0}):
        spec = DecodeSpec.make("kl_judge" if params else "lossless", params, 3, max_new_tokens=12)
        for item in items:
            ref = evaluate_item(engine, bench, item, DecodeSpec.make(TARGET_ONLY, max_new_tokens=12))
            got = evaluate_item(engine, bench, item, spec, reference_payload(ref))
            want = evaluate_item(engine, bench, item, spec, ref.outputs)
            assert len(item.turns) == 2 and got.replay.count(";") == 1, got.replay
            assert got.output_token_ids == want.output_token_ids, (item.id, got.replay)
            for f in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_position", "tokens"):
                assert getattr(got, f) == getattr(want, f), (item.id, got.replay, f)
            kinds.add(got.replay)
    assert "exact;exact" in kinds and any(k.endswith(";full") for k in kinds), kinds
