"""Trial metrics from hand-made records: pairing, intervals, speedups, noise floor, in-situ c."""

from __future__ import annotations

import math

import pytest

from workers.evaluation import Record
from workers.metrics.trial import aggregate, bootstrap_ci, in_situ_cost_ratio, noise_floor


def rec(item: str, score: float, *, tokens=10, draft_len=0, drafts=10, draft_fw=0, draft_s=0.0, verify_s=1.0,
        ids=None, error=None) -> Record:
    return Record(item_id=item, index=0, benchmark="b", spec_key="k", policy="p", params="{}", draft_len=draft_len,
                  outputs=["x"], score=score, extracted=None, reason="", tokens=tokens, num_drafts=drafts,
                  num_draft_tokens=draft_len * drafts, num_accepted_tokens=max(0, tokens - drafts),
                  accepted_per_position=[drafts] * draft_len, target_forwards=drafts, draft_forwards=draft_fw,
                  prefill_time_s=0.0, draft_time_s=draft_s, verify_time_s=verify_s, policy_time_s=0.0,
                  wall_time_s=draft_s + verify_s, finish_reasons=["length"], output_token_ids=ids or [[1]], error=error)


def test_bootstrap_interval_brackets_the_mean_and_shrinks_with_data():
    small = bootstrap_ci([0, 1] * 5)
    large = bootstrap_ci([0, 1] * 500)
    assert small[0] < 0.5 < small[1] and large[0] < 0.5 < large[1]
    assert (large[1] - large[0]) < (small[1] - small[0]) / 5
    assert all(math.isnan(x) for x in bootstrap_ci([]))


def test_paired_accuracy_drop_and_speedups():
    ar = [rec(f"i{i}", 1.0, tokens=10, drafts=10, verify_s=2.0) for i in range(4)]
    # spec: 3 of 4 right, 10 tokens in 4 rounds (L=4, 16 draft forwards), twice as fast
    spec = [rec(f"i{i}", 1.0 if i else 0.0, tokens=10, draft_len=4, drafts=4, draft_fw=16, draft_s=0.6, verify_s=0.4)
            for i in range(4)]
    m = aggregate(spec, ar, cost_ratio=0.25)
    assert m.accuracy == pytest.approx(0.75) and m.reference_accuracy == 1.0
    assert m.accuracy_drop == pytest.approx(0.25)
    assert m.mean_acceptance_length == pytest.approx(2.5)
    assert m.speedup_vs_ar_measured == pytest.approx(2.0)
    assert m.speedup_vs_ar_modelled == pytest.approx(10 / (4 + 0.25 * 16))  # 1.25x
    # in situ: 0.6 s / 16 draft forwards over 2.0 s / 10 target steps = 0.1875
    assert m.cost_ratio_in_situ == pytest.approx(0.1875)
    assert in_situ_cost_ratio(spec, ar) == pytest.approx(0.1875)


def test_failed_items_count_as_failures_in_the_arm_that_failed():
    ar = [rec("a", 1.0), rec("b", 1.0)]
    spec = [rec("a", 1.0, draft_len=2, drafts=5, draft_fw=10), rec("b", math.nan, error="boom")]
    m = aggregate(spec, ar)
    # a rule that crashes an item the target got right loses that item; dropping it from both arms
    # would report accuracy 1.0 and no drop
    assert m.items == 2 and m.failures == 1 and m.accuracy == 0.5 and m.accuracy_drop == 0.5
    m = aggregate([rec("a", 1.0, draft_len=2, drafts=5, draft_fw=10), rec("b", 1.0, draft_len=2, drafts=5, draft_fw=10)],
                  [rec("a", 1.0), rec("b", math.nan, error="boom")])
    assert m.reference_accuracy == 0.5 and m.accuracy_drop == -0.5, "a failed reference item counts against it"


def test_noise_floor_counts_diverging_outputs():
    ar = [rec("a", 1.0, ids=[[1, 2]]), rec("b", 1.0, ids=[[3]])]
    ll = [rec("a", 1.0, ids=[[1, 2]]), rec("b", 0.0, ids=[[4]])]
    floor = noise_floor(ll, ar)
    assert floor.divergence_rate == 0.5 and floor.accuracy_diff == 0.5
