"""The batched CPU engine (``workers.cpu_batch``): every row's record is the one batch 1 makes, token for token, for
every rule, at T = 0 and T > 0, with replay, whatever else is in the batch and whenever the row joined."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from policies import POLICIES, get_spec
from workers.benchmarks import get_benchmark
from workers.cpu_batch import Batcher
from workers.cpu_engine import SpecDecoder
from workers.evaluation import TARGET_ONLY, DecodeSpec, evaluate_item, reference_payload
from workers.models.pair import load_pair

ITEMS = 11  # more than the batch: rows finish and later items join a running batch


@functools.cache
def _engine_for(dtype: str) -> SpecDecoder:
    return SpecDecoder(load_pair("tiny-random", dtype=dtype))


@pytest.fixture(scope="module", autouse=True)
def _engines():
    yield
    _engine_for.cache_clear()


@pytest.fixture(scope="module", params=["int8", "int4+int8"])
def engine(request) -> SpecDecoder:
    """One engine per dtype for the module: a test that picks its dtype (indirect) gets the same one, which pytest's
    own fixture cache would build again for every such test."""
    return _engine_for(request.param)


@pytest.fixture(scope="module")
def bench():
    return get_benchmark("gsm8k")


@pytest.fixture(scope="module")
def items(bench):
    return bench.items(limit=ITEMS)


def same(a, b) -> list[str]:
    """The fields of two records that differ (times aside)."""
    fields = ("output_token_ids", "outputs", "finish_reasons", "score", "replay", "tokens", "num_drafts",
              "num_draft_tokens", "num_accepted_tokens", "accepted_per_position", "target_forwards", "error")
    return [f for f in fields if getattr(a, f) != getattr(b, f)]


def spec_for(name: str, temperature: float = 0.0, draft_len: int = 3) -> DecodeSpec:
    if name == TARGET_ONLY:
        return DecodeSpec.make(TARGET_ONLY, temperature=temperature, seed=5, max_new_tokens=24)
    params = dict(get_spec(name).example or {})
    return DecodeSpec.make(name, params, draft_len, temperature=temperature, seed=5, max_new_tokens=24)


def check(engine, bench, items, spec, references=None, size=8):
    refs = references or {}
    alone = [evaluate_item(engine, bench, item, spec, refs.get(item.id)) for item in items]
    batched = engine.evaluate_items(bench, items, spec, refs, batch_size=size)
    assert [r.item_id for r in batched] == [i.id for i in items]
    for a, b in zip(alone, batched, strict=True):
        assert not same(a, b), f"{spec.label()} item {a.item_id}: {same(a, b)} differ from batch 1"
    return alone, batched


# Every rule on int4+int8 (the CPU default); int8 differs only in the draft's linears (int8, not 4-bit), which the
# rules never see (both give fp32 logits; the target, its LM head included, is int8 in both): there, one lossless and
# one lossy rule run the int8 draft's batched path. Target-only never runs the draft, so it runs once.
RULE_CASES = [("int4+int8", name) for name in [TARGET_ONLY, *sorted(POLICIES)]] + [("int8", "lossless"),
                                                                                  ("int8", "kl_judge")]


@pytest.mark.parametrize(("engine", "name"), RULE_CASES, indirect=["engine"])
def test_every_rule_at_t0_is_row_for_row_batch_1(engine, bench, items, name):
    alone, _ = check(engine, bench, items, spec_for(name))
    assert all(r.error is None for r in alone)
    assert engine.batcher(8).shared, "the fast path shares each weight read across the rows"


@pytest.mark.parametrize("name", [TARGET_ONLY, "lossless", "kl_judge", "dropmatch"])
def test_sampling_rows_keep_their_own_seeded_streams(engine, bench, items, name):
    alone, _ = check(engine, bench, items, spec_for(name, temperature=0.8, draft_len=2))
    greedy = [evaluate_item(engine, bench, items[0], spec_for(name, draft_len=2))]
    assert alone[0].output_token_ids != greedy[0].output_token_ids or name == TARGET_ONLY


@pytest.mark.parametrize("name", [TARGET_ONLY, "kl_judge"])
def test_truncated_sampling_rows_equal_batch_1(engine, bench, items, name):
    """top-k 20 / top-p 0.8 at T 0.7 (Qwen2.5's recommended sampling): each row truncates its own distributions."""
    spec = dataclasses.replace(spec_for(name, temperature=0.7, draft_len=2), top_k=20, top_p=0.8)
    alone, _ = check(engine, bench, items, spec)
    assert all(r.error is None for r in alone)


@pytest.mark.parametrize("name", [TARGET_ONLY, "lossless", "kl_judge"])
def test_coupled_sampling_rows_equal_batch_1_and_lossless_rows_equal_target_only(engine, bench, items, name):
    """The coupled sampler's noise is keyed by each row's seed and position, so a batched row is its batch-1 twin;
    lossless rows output what target-only rows output."""
    spec = dataclasses.replace(spec_for(name, temperature=0.7, draft_len=3), sampler="coupled")
    alone, _ = check(engine, bench, items, spec)
    assert all(r.error is None for r in alone)
    if name == "lossless":
        ref, _ = check(engine, bench, items, dataclasses.replace(spec_for(TARGET_ONLY, temperature=0.7),
                                                                  sampler="coupled"))
        assert [r.output_token_ids for r in alone] == [r.output_token_ids for r in ref]


def test_replayed_rows_equal_replay_at_batch_1(engine, bench, items):
    refs = {r.item_id: reference_payload(r) for r in
            engine.evaluate_items(bench, items, spec_for(TARGET_ONLY), batch_size=8)}
    for name in ("lossless", "kl_judge", "typical"):
        alone, _ = check(engine, bench, items, spec_for(name, draft_len=4), refs)
        assert all(r.replay for r in alone), "each record says how replay made it"


def test_bundles_batch_like_batch_1(engine, bench, items):
    specs = [DecodeSpec.make("lossless", {}, n, max_new_tokens=24) for n in (1, 3)]
    refs = {r.item_id: reference_payload(r) for r in
            engine.evaluate_items(bench, items, spec_for(TARGET_ONLY), batch_size=4)}
    alone = engine.evaluate_bundles(bench, items, specs, refs, batch_size=1)
    batched = engine.evaluate_bundles(bench, items, specs, refs, batch_size=6)
    for a, b in zip(alone, batched, strict=True):
        for x, y in zip(a, b, strict=True):
            assert not same(x, y)


def test_coupled_bundles_replay_lossless_at_every_l_as_full_decoding_and_batch_1_do(engine, bench, items):
    """Under the coupled sampler (T 0.7, top-k 20, top-p 0.8) a bundle replays lossless at L 1 and 4 from one pass
    per item: every record is target-only's output, said "exact" (nothing decoded), with the counts a full decode
    makes; a lossy rule replays as its full decode; batched rows equal batch 1."""
    common = dict(temperature=0.7, top_k=20, top_p=0.8, sampler="coupled", seed=5, max_new_tokens=24)
    reference = engine.evaluate_items(bench, items, DecodeSpec.make(TARGET_ONLY, **common), batch_size=4)
    refs = {r.item_id: reference_payload(r) for r in reference}
    specs = [DecodeSpec.make("lossless", {}, n, **common) for n in (1, 4)] + \
        [DecodeSpec.make("kl_judge", {"threshold": 2.0}, 4, **common)]
    alone = engine.evaluate_bundles(bench, items, specs, refs, batch_size=1)
    batched = engine.evaluate_bundles(bench, items, specs, refs, batch_size=6)
    for a, b in zip(alone, batched, strict=True):
        for x, y in zip(a, b, strict=True):
            assert not same(x, y)
    full = [[evaluate_item(engine, bench, item, spec) for spec in specs] for item in items]
    for ref, got, want in zip(reference, alone, full, strict=True):
        for x, y in zip(got, want, strict=True):
            assert same(x, y) == ["replay"], (x.spec_key, x.replay)
        assert [x.replay for x in got[:2]] == ["exact", "exact"]
        assert got[0].output_token_ids == got[1].output_token_ids == ref.output_token_ids
    assert sum(r[1].num_draft_tokens - r[1].num_accepted_tokens for r in alone) > 0, "drafts were rejected"


@pytest.mark.parametrize("size", [2, 3, 5, 8])
def test_any_batch_size_and_joining_order_gives_the_same_rows(engine, bench, items, size):
    spec = spec_for("kl_judge", draft_len=4)
    want = [r.output_token_ids for r in engine.evaluate_items(bench, items, spec, batch_size=1)]
    got = [r.output_token_ids for r in engine.evaluate_items(bench, items[::-1], spec, batch_size=size)][::-1]
    assert got == want


def test_the_shared_prefix_is_copied_not_recomputed(bench, items):
    engine = SpecDecoder(load_pair("tiny-random", dtype="int8"))
    spec = DecodeSpec.make("lossless", {}, 3, max_new_tokens=8, shots=2)  # a 2-shot preamble every prompt shares
    engine.evaluate_items(bench, items[:6], spec, batch_size=4)
    stats = engine.batcher(4).stats
    assert stats.prefix_copies >= 3 and stats.prefix_tokens > 3 * 100
    check(engine, bench, items[:6], spec, size=4)


def test_a_float_model_runs_its_rows_in_turn_and_stays_exact(bench, items):
    engine = SpecDecoder(load_pair("tiny-random", dtype=torch.float32))
    assert not engine.batcher(4).shared
    check(engine, bench, items[:5], spec_for("lossless"), size=4)


def test_one_rows_bad_input_fails_that_row_alone(engine):
    batcher = Batcher(engine, 4)
    prompt = engine.pair.tokenizer.encode("Q: 2 + 2 = ?\nA:")

    def bad(row):
        row.target.reuse(prompt[:-1])
        return row.target.forward(torch.tensor([[10 ** 6]]))  # outside the embedding: that row's pass fails

    def good(row):
        return row.autoregressive(prompt, max_new_tokens=6).token_ids

    failed: list[int] = []

    def guarded(job):
        def run(row):
            try:
                return job(row)
            except IndexError:
                failed.append(1)
                return "failed"
        return run

    out = batcher.run([guarded(good), guarded(bad), guarded(good), guarded(good)])
    want = engine.autoregressive(prompt, max_new_tokens=6).token_ids
    assert out[1] == "failed" and failed == [1] and [out[0], out[2], out[3]] == [want] * 3
    assert batcher.stats.fallbacks >= 1


def test_stop_starts_no_more_items(engine, bench, items):
    done: list[str] = []
    records = engine.evaluate_items(bench, items, spec_for(TARGET_ONLY), batch_size=3,
                                    on_record=lambda r: done.append(r.item_id), stop=lambda: len(done) >= 1)
    assert 1 <= len(records) < len(items) and sorted(done) == sorted(r.item_id for r in records)


def test_bad_batch_sizes_are_refused_by_name(engine):
    for bad in (0, -2, 1.5, "8"):
        with pytest.raises(ValueError, match="batch size"):
            Batcher(engine, bad)


@pytest.mark.parametrize("size", range(1, 33))
def test_a_4bit_rows_result_does_not_depend_on_the_batch(size):
    """The 4-bit GEMM accumulates in float: its row independence is measured at every row count a batched draft
    step has (the batch sizes ``auto`` picks, up to 32), on the real draft's widths."""
    from workers.models.q4 import Q4Linear

    gen = torch.Generator().manual_seed(size)
    for out_f, in_f in ((1152, 896), (9728, 896), (896, 4864)):
        lin = Q4Linear.quantized(torch.randn(out_f, in_f, generator=gen) * 0.02)
        x = torch.randn(size, in_f, generator=gen)
        alone = torch.cat([lin.forward(x[i:i + 1]) for i in range(size)])
        assert torch.equal(lin.forward(x), alone), f"{out_f}x{in_f} at {size} rows"


def test_a_batched_record_says_its_batch_and_claims_no_time_of_its_own(engine, bench, items):
    spec = spec_for(TARGET_ONLY)
    alone = engine.evaluate_items(bench, items[:3], spec, batch_size=1)
    batched = engine.evaluate_items(bench, items[:3], spec, batch_size=3)
    assert {r.batch for r in alone} == {1} and all(r.solo and r.tokens_per_s > 0 for r in alone)
    assert {r.batch for r in batched} == {3}
    assert all(r.timed and not r.solo and r.tokens_per_s == 0 for r in batched), \
        "a batched record's seconds overlap its neighbours': not its own decode's"


def test_auto_keeps_batch_1_where_a_step_is_overhead_bound(engine):
    from workers.cpu_batch import pick_batch_size

    size, measured = pick_batch_size(engine, context=64, sizes=(1, 2, 4))
    assert size == 1 and measured["rows_per_s"]["1"] > 200, measured  # the tiny pair: a step of microseconds


def test_auto_picks_by_rows_per_second_and_keeps_its_choice(engine, tmp_path, monkeypatch):
    import dataclasses

    from workers import cpu_batch

    monkeypatch.setattr(cpu_batch, "OVERHEAD_BOUND_S", 0.0)  # judge the tiny pair as if its steps were slow
    view = dataclasses.replace(engine.pair, cache_dir=tmp_path) if dataclasses.is_dataclass(engine.pair) else None
    assert view is not None
    probe = type("Probe", (), {"pair": view})()
    size, measured = cpu_batch.pick_batch_size(probe, context=64, sizes=(1, 2, 4), keep=0.0)
    assert size == 1 and set(measured["rows_per_s"]) == {"1", "2", "4"}  # keep 0: the smallest size reaches it
    size, measured = cpu_batch.pick_batch_size(probe, context=64, sizes=(1, 2, 4), keep=1.0)
    assert size == 1 and "stored" in measured, "the first choice is kept and read back at this context"
    size, measured = cpu_batch.pick_batch_size(probe, context=128, sizes=(1, 2, 4), keep=1.0)
    assert str(size) == max(measured["rows_per_s"], key=lambda b: measured["rows_per_s"][b]) and "stored" not in measured
    stored = list(tmp_path.glob("batch-*-ctx64.json")) + list(tmp_path.glob("batch-*-ctx128.json"))
    assert len(stored) == 2


def test_a_memory_budget_caps_the_batch(engine):
    from workers import cpu_batch

    per_row = (cpu_batch._kv_bytes_per_token(engine.pair.target) + cpu_batch._kv_bytes_per_token(engine.pair.draft)) * 2 * 64
    size, measured = cpu_batch.pick_batch_size(engine, context=64, sizes=(1, 2, 4, 8), memory_gib=2.5 * per_row / 2 ** 30)
    assert set(measured["rows_per_s"]) == {"1", "2"}, "rows whose KV caches would not fit are never timed"


@pytest.mark.parametrize("text", ["0", "-2", "two", "1.5", ""])
def test_a_bad_batch_size_is_one_line(text):
    from workers.cli import parse_batch_size

    with pytest.raises(ValueError, match="--batch-size must be a positive number or auto"):
        parse_batch_size(text)
    assert parse_batch_size("auto") == "auto" and parse_batch_size("8") == 8
