"""The fastest lossless decoding: target-only (L = 0) counts, so a pair whose verify pass or draft step is dear
states every speed against target-only, and ``vs_lossless`` says ``draft_len: 0``."""

from __future__ import annotations

from workers.evaluation import Record
from workers.metrics.cost import CostModel
from workers.metrics.lossless import baseline_name, best_lossless


def _rec(item: str, draft_len: int, tokens: int, target_forwards: int, draft_forwards: int) -> Record:
    return Record(item_id=item, index=0, benchmark="gsm8k", spec_key="k", policy="lossless", params="{}",
                  draft_len=draft_len, outputs=["x"], score=1.0, extracted="1", reason="", tokens=tokens,
                  num_drafts=target_forwards, num_draft_tokens=draft_forwards, num_accepted_tokens=0,
                  accepted_per_position=[0] * max(draft_len, 1), target_forwards=target_forwards,
                  draft_forwards=draft_forwards, prefill_time_s=0.0, draft_time_s=0.0, verify_time_s=0.0,
                  policy_time_s=0.0, wall_time_s=0.0, finish_reasons=["length"])


def _runs(items=("a", "b")):
    # 100 tokens: target-only in 100 steps; lossless L 5 in 30 rounds (3.33 tokens a round) and 150 draft steps
    target_only = {k: _rec(k, 0, 100, 100, 0) for k in items}
    lossless5 = {k: _rec(k, 5, 100, 30, 150) for k in items}
    candidate = {k: _rec(k, 5, 100, 25, 125) for k in items}
    return target_only, lossless5, candidate


def test_target_only_is_the_fastest_lossless_where_verifying_is_dear():
    target_only, lossless5, candidate = _runs()
    dear = CostModel(0.45, lambda _: 3.15)  # the AVX2-only VM in fp32: v(5) = 3.15, c = 0.35..0.45
    best = best_lossless(candidate, {0: target_only, 5: lossless5}, dear.cost_ratio, dear.verify)
    # lossless L 5 costs 30 * 3.15 + 150 * 0.45 = 162 steps for 100 tokens: slower than 100 target steps
    assert best["draft_len"] == 0 and baseline_name(best["draft_len"]) == "L 0, target-only"
    assert abs(best["tokens_per_cost"] - 1.0) < 1e-12
    assert abs(best["speedup"] - 100 / (25 * 3.15 + 125 * 0.45)) < 1e-12


def test_speculative_decoding_is_the_fastest_lossless_where_its_premise_holds():
    target_only, lossless5, candidate = _runs()
    cheap = CostModel(0.1, lambda _: 1.05)
    best = best_lossless(candidate, {0: target_only, 5: lossless5}, cheap.cost_ratio, cheap.verify)
    assert best["draft_len"] == 5 and baseline_name(5) == "L 5"
    assert set(best["per_draft_len"]) == {0, 5}


def test_a_record_whose_replay_failed_and_decoded_in_full_counts_as_decoded_in_full():
    from workers.metrics.lossless import replay_counts

    recs = {k: _rec(k, 5, 100, 30, 150) for k in "abcd"}
    recs["a"].replay = ""  # never replayed
    recs["b"].replay = "full (replay failed: RuntimeError)"
    recs["c"].replay = "exact"
    recs["d"].replay = "exact;diverged@7"
    assert replay_counts(recs) == {"replayed_exact": 1, "replayed_decoded": 1, "decoded_in_full": 2}
