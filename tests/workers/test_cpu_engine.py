"""The CPU speculative decoding engine on the tiny random pair: exactness, caches, stopping."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from policies import POLICIES, get_spec, make_policy
from workers.cpu_engine import SpecDecoder
from workers.metrics.cost import modelled_cost
from workers.models.pair import load_pair
from workers.models.tiny import tiny_random_pair

PROMPTS = [
    "Hello world, this is a test",
    "Q: 12 + 30 = ?\nA:",
    "def add(a, b):\n    return",
    "The quick brown fox",
    "x",
    "Natalia sold clips to 48 of her friends in April, and then half as many in May.",
]


@pytest.fixture(scope="module")
def engine() -> SpecDecoder:
    return SpecDecoder(load_pair("tiny-random", dtype=torch.float32))


def encode(engine: SpecDecoder, text: str) -> list[int]:
    return engine.pair.tokenizer.encode(text)


@pytest.mark.parametrize("draft_len", [1, 2, 3, 5, 8])
def test_lossless_greedy_equals_target_only_greedy(engine, draft_len):
    rejected_somewhere = False
    for text in PROMPTS:
        ids = encode(engine, text)
        ref = engine.autoregressive(ids, max_new_tokens=48)
        got = engine.generate(ids, "lossless", draft_len=draft_len, max_new_tokens=48)
        assert got.token_ids == ref.token_ids, f"prompt {text!r}, L={draft_len}"
        assert got.finish_reason == ref.finish_reason
        rejected_somewhere |= got.stats.num_accepted_tokens < got.stats.num_draft_tokens
    assert rejected_somewhere, "the tiny draft must disagree sometimes, or this test proves little"


@pytest.mark.parametrize("name", sorted(n for n, s in POLICIES.items() if s.lossy))
def test_every_rule_with_relaxation_off_gives_lossless_output(engine, name):
    off = make_policy(name, **get_spec(name).off)
    for text in PROMPTS[:4]:
        ids = encode(engine, text)
        want = engine.generate(ids, "lossless", draft_len=4, max_new_tokens=32)
        got = engine.generate(ids, off, draft_len=4, max_new_tokens=32)
        assert got.token_ids == want.token_ids, f"{name} off, prompt {text!r}"
        assert got.stats.num_accepted_tokens == want.stats.num_accepted_tokens


def test_lossy_rules_run_end_to_end_and_accept_at_least_as_much(engine):
    ids = encode(engine, PROMPTS[1])
    base = engine.generate(ids, "lossless", draft_len=5, max_new_tokens=32).stats
    for name in sorted(POLICIES):
        stats = engine.generate(ids, make_policy(name, **get_spec(name).example), draft_len=5, max_new_tokens=32).stats
        assert stats.num_generated == 32
        assert stats.draft_acceptance_rate >= 0.0
    lenient = engine.generate(ids, make_policy("top_k", k=64), draft_len=5, max_new_tokens=32).stats
    assert lenient.mean_acceptance_length > base.mean_acceptance_length


def test_cached_logits_equal_a_no_cache_recomputation(engine):
    ids = encode(engine, PROMPTS[5])
    gen = engine.generate(ids, "lossless", draft_len=4, max_new_tokens=40, trace=True)
    sequence = torch.tensor([ids + gen.token_ids])
    with torch.inference_mode():
        full = engine.pair.target(sequence).logits[0].float()  # [N, V]
    starts = [start for start, _ in gen.trace] + [len(ids) + len(gen.token_ids) - 1]
    checked = 0
    for (start, logits), nxt in zip(gen.trace, starts[1:], strict=True):
        valid = min(nxt - start, logits.shape[0])  # rows whose inputs were all committed
        torch.testing.assert_close(logits[:valid], full[start : start + valid], rtol=1e-4, atol=1e-4)
        checked += valid
    assert checked >= len(gen.token_ids) - 1


@pytest.mark.parametrize("max_new", [1, 2, 3, 7, 16])
def test_max_new_tokens_is_never_overshot(engine, max_new):
    ids = encode(engine, PROMPTS[0])
    for policy in ("lossless", make_policy("top_k", k=64)):
        gen = engine.generate(ids, policy, draft_len=5, max_new_tokens=max_new)
        assert len(gen.token_ids) == max_new and gen.finish_reason == "length"
    assert len(engine.autoregressive(ids, max_new_tokens=max_new).token_ids) == max_new


def test_eos_ends_generation_without_emitting_it(engine):
    ids = encode(engine, PROMPTS[2])
    ref = engine.autoregressive(ids, max_new_tokens=30).token_ids
    eos = ref[9]
    first = ref.index(eos)
    pair = dataclasses.replace(engine.pair, eos_token_ids=(eos,))
    eng = SpecDecoder(pair)
    for gen in (eng.autoregressive(ids, max_new_tokens=30), eng.generate(ids, "lossless", draft_len=5, max_new_tokens=30)):
        assert gen.finish_reason == "eos"
        assert gen.token_ids == ref[:first]


def test_stop_string_ends_generation_and_is_cut_from_text(engine):
    ids = encode(engine, "Q: 12 + 30 = ?\nA:")
    ref = engine.autoregressive(ids, max_new_tokens=40)
    stop = engine.pair.tokenizer.decode(ref.token_ids[10:12])
    for gen in (engine.autoregressive(ids, max_new_tokens=40, stop=[stop]),
                engine.generate(ids, "lossless", draft_len=5, max_new_tokens=40, stop=[stop])):
        assert gen.finish_reason == "stop"
        assert stop not in gen.text
        assert ref.text.startswith(gen.text)
        assert len(gen.token_ids) <= 12


def test_seeded_sampling_is_reproducible(engine):
    ids = encode(engine, PROMPTS[3])
    policy = make_policy("dropmatch", criterion="naive")
    a = engine.generate(ids, policy, draft_len=4, max_new_tokens=30, temperature=1.0, seed=11)
    b = engine.generate(ids, policy, draft_len=4, max_new_tokens=30, temperature=1.0, seed=11)
    c = engine.generate(ids, policy, draft_len=4, max_new_tokens=30, temperature=1.0, seed=12)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids, "two seeds gave the same 30 sampled tokens: the seed is ignored"
    r1 = engine.autoregressive(ids, max_new_tokens=30, temperature=0.8, seed=5)
    r2 = engine.autoregressive(ids, max_new_tokens=30, temperature=0.8, seed=5)
    assert r1.token_ids == r2.token_ids


@pytest.mark.parametrize("cut", [dict(top_k=1), dict(top_p=1e-9)])
def test_sampling_truncated_to_one_token_is_greedy_decoding_on_both_models(engine, cut):
    """top-k 1 (or a nucleus of the first token) at T 0.7 leaves one token per distribution: target-only sampling is
    greedy target-only, and lossless speculative sampling too (the draft's proposals greedy, the target's checks
    and bonus draws greedy), so the truncation reaches the target's and the draft's distributions both."""
    for text in PROMPTS[:3]:
        ids = encode(engine, text)
        greedy = engine.autoregressive(ids, max_new_tokens=24)
        assert engine.autoregressive(ids, max_new_tokens=24, temperature=0.7, seed=3, **cut).token_ids == \
            greedy.token_ids
        got = engine.generate(ids, "lossless", draft_len=3, max_new_tokens=24, temperature=0.7, seed=3, **cut)
        assert got.token_ids == greedy.token_ids
        assert got.stats.num_accepted_tokens == engine.generate(ids, "lossless", draft_len=3,
                                                                max_new_tokens=24).stats.num_accepted_tokens
    wide = engine.autoregressive(encode(engine, PROMPTS[3]), max_new_tokens=24, temperature=0.7, seed=3, top_k=40)
    assert wide.token_ids != engine.autoregressive(encode(engine, PROMPTS[3]), max_new_tokens=24).token_ids, \
        "top-k 40 at T 0.7 still samples"


def test_stats_are_consistent(engine):
    ids = encode(engine, PROMPTS[1])
    gen = engine.generate(ids, make_policy("kl_judge", threshold=0.3), draft_len=5, max_new_tokens=40)
    s = gen.stats
    assert s.num_generated == len(gen.token_ids) == 40
    assert s.num_drafts == s.target_forwards
    assert sum(s.accepted_per_position) == s.num_accepted_tokens <= s.num_draft_tokens
    assert all(a >= b for a, b in zip(s.accepted_per_position, s.accepted_per_position[1:], strict=False)), "a prefix property"
    assert s.draft_forwards == s.num_draft_tokens, "one draft forward per proposed token"
    assert s.mean_acceptance_length == pytest.approx(40 / s.num_drafts)
    assert 0 <= s.other_time_s < s.wall_time_s
    ar = engine.autoregressive(ids, max_new_tokens=40).stats
    assert ar.target_forwards == 40 and ar.draft_forwards == 0 and ar.num_generated / modelled_cost(ar, 0.4) == pytest.approx(1.0)


def test_bad_inputs_get_clear_errors(engine):
    with pytest.raises(ValueError, match="draft_len"):
        engine.generate([1, 2], "lossless", draft_len=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate([1, 2], "lossless", max_new_tokens=0)
    with pytest.raises(ValueError, match="empty"):
        engine.generate([], "lossless")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.autoregressive([1, 10**6])
    with pytest.raises(ValueError, match="unknown policy"):
        engine.generate([1, 2], "nope")
    with pytest.raises(ValueError, match="temperature"):
        engine.generate([1, 2], "lossless", temperature=-1.0)
    with pytest.raises(ValueError, match="top_p must be in"):
        engine.generate([1, 2], "lossless", temperature=0.7, top_p=0.0)
    with pytest.raises(ValueError, match="top_k must be an integer"):
        engine.autoregressive([1, 2], temperature=0.7, top_k=-2)


def test_a_bad_fused_mode_is_refused_at_start_naming_the_variable(engine, monkeypatch):
    monkeypatch.setenv("SPECTUNE_FUSED", "fast")
    with pytest.raises(ValueError, match="SPECTUNE_FUSED must be auto, 0 or 1, got 'fast'"):
        SpecDecoder(engine.pair)


def test_prefix_cache_reuses_shared_prefix_and_changes_no_output(engine):
    plain = SpecDecoder(engine.pair, prefix_cache=False)
    shared = encode(engine, "A long shared preamble that every request repeats word for word. ")
    first, second = shared + encode(engine, PROMPTS[0]), shared + encode(engine, PROMPTS[1])
    engine.generate(first, "lossless", draft_len=3, max_new_tokens=12)
    got = engine.generate(second, "lossless", draft_len=3, max_new_tokens=12)
    ref = plain.generate(second, "lossless", draft_len=3, max_new_tokens=12)
    common = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    assert got.stats.cached_prompt_tokens == common >= len(shared) - 1
    assert ref.stats.cached_prompt_tokens == 0
    assert got.token_ids == ref.token_ids
    again = engine.autoregressive(second, max_new_tokens=12)  # the same prompt: all but the last token cached
    assert again.stats.cached_prompt_tokens == len(second) - 1
    assert again.token_ids == plain.autoregressive(second, max_new_tokens=12).token_ids


def test_a_failed_generation_leaves_the_engine_serving(engine):
    ids = encode(engine, PROMPTS[2])
    ref = engine.generate(ids, "lossless", draft_len=3, max_new_tokens=10)

    class Exploding:  # a Policy whose decision fails after prefill and a draft round
        name = "exploding"
        config = None

        def decide(self, batch):
            raise RuntimeError("policy failed mid-generation")

    with pytest.raises(RuntimeError, match="mid-generation"):
        engine.generate(ids, Exploding(), draft_len=3, max_new_tokens=10)
    assert engine.target.ids == [] and engine.draft.ids == []
    assert engine.generate(ids, "lossless", draft_len=3, max_new_tokens=10).token_ids == ref.token_ids


@pytest.mark.parametrize("spec", [True, False])
def test_on_tokens_streams_every_emitted_token_and_can_abort(engine, spec):
    ids = encode(engine, PROMPTS[1])
    run = (lambda **kw: engine.generate(ids, "lossless", draft_len=3, **kw)) if spec else \
        (lambda **kw: engine.autoregressive(ids, **kw))
    chunks: list[list[int]] = []
    full = run(max_new_tokens=20, on_tokens=chunks.append)
    assert [t for c in chunks for t in c] == full.token_ids and all(chunks)
    seen: list[int] = []

    def stop_after_four(new: list[int]) -> bool:
        seen.extend(new)
        return len(seen) < 4

    cut = run(max_new_tokens=20, on_tokens=stop_after_four)
    assert cut.finish_reason == "abort" and 4 <= len(cut.token_ids) < 20
    assert cut.token_ids == full.token_ids[: len(cut.token_ids)]


@pytest.fixture(scope="module")
def padded_engines() -> tuple[SpecDecoder, SpecDecoder]:
    """The tiny pair with a draft 288 logits wide against a 320-wide target (as Qwen2.5 0.5B -> 7B),
    and the same pair with the full-width draft: the draft's first 288 rows are the same weights."""
    return (SpecDecoder(tiny_random_pair(torch.float32, draft_vocab=288)),
            SpecDecoder(tiny_random_pair(torch.float32)))


def test_a_narrower_draft_is_padded_and_lossless_equals_target_only(padded_engines):
    padded, _ = padded_engines
    for text in PROMPTS:
        ids = encode(padded, text)
        ref = padded.autoregressive(ids, max_new_tokens=40)
        got = padded.generate(ids, "lossless", draft_len=5, max_new_tokens=40, trace=True)
        assert got.token_ids == ref.token_ids, text
    logits = padded.draft.head(torch.zeros(1, 1, padded.pair.draft.config.hidden_size))
    assert logits.shape[-1] == 320 and torch.isneginf(logits[..., 288:]).all() and torch.isfinite(logits[..., :288]).all()
    assert torch.isneginf(got.trace[0][1][:, 288:]).all(), "the target's logits past the draft's width are masked"


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_every_rule_runs_on_a_narrower_draft_and_accepts_as_on_the_full_width_one(padded_engines, temperature):
    padded, full = padded_engines
    ids = encode(padded, PROMPTS[1])
    for name in sorted(POLICIES):
        rule = make_policy(name, **get_spec(name).example)
        a = padded.generate(ids, rule, draft_len=5, max_new_tokens=32, temperature=temperature, seed=3)
        b = full.generate(ids, rule, draft_len=5, max_new_tokens=32, temperature=temperature, seed=3)
        assert a.finish_reason in ("length", "eos") and max(a.token_ids) < 288, name
        # Mass on ids 288..319 is what the mask removes: a KL of infinity there would reject every draft.
        assert a.stats.num_accepted_tokens > 0, name
        if temperature == 0.0:
            assert a.token_ids == b.token_ids, f"{name}: the full-width pair never puts its argmax past 288"


def test_greedy_drafting_over_a_proposal_vocabulary_stays_lossless_and_feeds_rules_that_read_the_draft():
    """Greedy drafts come from the first ids and the special ids only (workers.models.proposal); lossless still
    equals target-only, and a rule that reads the draft's distribution still gets it (whole, once per round)."""
    pair = load_pair("tiny-random", dtype=torch.float32)
    narrow = SpecDecoder(pair, proposal_size=32)
    assert narrow.proposal is not None and len(narrow.proposal.ids) == 32 + 3  # and the three added tokens
    allowed = set(narrow.proposal.ids.tolist())
    for text in PROMPTS:
        ids = encode(narrow, text)
        ref = narrow.autoregressive(ids, max_new_tokens=24)
        for draft_len in (1, 4):
            out = narrow.generate(ids, "lossless", draft_len=draft_len, max_new_tokens=24)
            assert out.token_ids == ref.token_ids
        lenient = narrow.generate(ids, make_policy("kl_judge", threshold=2.0, confidence=1.0), draft_len=4,
                                  max_new_tokens=24)
        assert lenient.stats.num_draft_tokens > 0
    # every greedy proposal is one of the allowed ids: trace one round's drafts
    rounds = []
    original = narrow._propose

    def spy(*args, **kwargs):
        drafts, logits = original(*args, **kwargs)
        rounds.append((drafts, logits))
        return drafts, logits

    narrow._propose = spy
    narrow.generate(encode(narrow, PROMPTS[0]), "lossless", draft_len=3, max_new_tokens=12)
    narrow.generate(encode(narrow, PROMPTS[0]), "kl_judge", draft_len=3, max_new_tokens=12)
    assert rounds and all(set(d) <= allowed for d, _ in rounds)
    assert any(q is None for _, q in rounds)  # lossless: no full draft head at all
    assert any(q is not None and q.shape[-1] == pair.vocab_size for _, q in rounds)  # the KL judge reads it


@pytest.mark.parametrize("draft_len", [1, 4])
def test_coupled_lossless_sampling_equals_coupled_target_only_sampling(engine, draft_len):
    """The coupled sampler (policies.coupling) at T 0.8: lossless speculative decoding outputs target-only's
    tokens for the same seed, token for token, with truncation too; a draft token is sometimes rejected (the
    equality is not a draft that always agrees); another seed samples another output."""
    rejected = False
    for text in PROMPTS:
        ids = encode(engine, text)
        for seed, cut in ((0, {}), (1, {"top_k": 20, "top_p": 0.9})):
            common = dict(max_new_tokens=24, temperature=0.8, seed=seed, sampler="coupled", **cut)
            ref = engine.autoregressive(ids, **common)
            got = engine.generate(ids, "lossless", draft_len=draft_len, **common)
            assert got.token_ids == ref.token_ids, (text, seed, cut)
            rejected |= got.stats.num_accepted_tokens < got.stats.num_draft_tokens
    assert rejected
    ids = encode(engine, PROMPTS[0])
    outputs = {tuple(engine.autoregressive(ids, max_new_tokens=16, temperature=0.8, seed=s,
                                           sampler="coupled").token_ids) for s in range(4)}
    assert len(outputs) > 1


def test_the_coupled_sampler_is_refused_by_name_and_is_greedy_decoding_at_t_0(engine):
    ids = encode(engine, PROMPTS[0])
    with pytest.raises(ValueError, match="sampler must be one of standard, coupled"):
        engine.generate(ids, "lossless", max_new_tokens=4, temperature=0.7, sampler="gumbel")
    greedy = engine.autoregressive(ids, max_new_tokens=12).token_ids
    assert engine.autoregressive(ids, max_new_tokens=12, sampler="coupled").token_ids == greedy
