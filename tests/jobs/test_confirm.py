"""The confirmation phase's bookkeeping on hand-made records: pairing with failures, the ordered
prefix the prune test looks at, ratio-of-sums speed, and the fixed sequence run lazily."""

from __future__ import annotations

import math

import pytest

from jobs.confirm import Confirmation, ordered_prefix, paired, speed_figures
from tests.workers.test_metrics import rec
from workers.certify.decide import Candidate


def test_a_failed_item_counts_as_a_failure_in_the_arm_that_failed():
    ref = {"a": rec("a", 1.0), "b": rec("b", 1.0), "c": rec("c", math.nan, error="boom")}
    trial = {"a": rec("a", 1.0), "b": rec("b", math.nan, error="boom"), "c": rec("c", 1.0)}
    assert paired(ref, trial) == ([1.0, 1.0, 0.0], [1.0, 0.0, 1.0])


def test_looks_use_the_completed_prefix_of_the_fixed_order_not_completion_order():
    ref = {k: rec(k, 1.0) for k in "abcd"}
    done = {"a": rec("a", 1.0), "c": rec("c", 0.0), "d": rec("d", 0.0)}  # b still running
    assert ordered_prefix("abcd", ref, done) == ([1.0], [1.0]), "c and d wait until b is in"


def test_speed_is_a_ratio_of_sums_not_a_mean_of_ratios():
    # item a: 10 tokens in 1 s vs reference 10 in 2 s (2x); item b: 100 tokens in 10 s vs 100 in 10 s (1x)
    ref = {"a": rec("a", 1.0, tokens=10, verify_s=2.0), "b": rec("b", 1.0, tokens=100, verify_s=10.0)}
    trial = {"a": rec("a", 1.0, tokens=10, verify_s=1.0, draft_len=2), "b": rec("b", 1.0, tokens=100, verify_s=10.0,
                                                                                   draft_len=2)}
    s = speed_figures(trial, ref, cost_ratio=0.5, verify_factor=lambda _: 1.0)
    assert s["measured_per_answer"] == pytest.approx(12 / 11), "the mean of per-item ratios would say 1.5x"
    assert s["measured_per_token"] == pytest.approx((110 / 11) / (110 / 12))
    assert s["measured_per_answer_lo"] <= s["measured_per_answer"] <= s["measured_per_answer_hi"]
    assert s["speed_items"] == 2


def test_fixed_sequence_evaluates_lazily_and_reuses_a_candidate_across_budgets():
    ref = {f"i{k}": rec(f"i{k}", 1.0) for k in range(200)}
    # safe: identical to the reference; risky: loses 30% of the items
    outcomes = {"safe": {k: rec(k, 1.0) for k in ref},
                "risky": {k: rec(k, 0.0 if int(k[1:]) % 10 < 3 else 1.0) for k in ref}}
    calls = []

    def evaluate(c: Candidate, stop):
        calls.append(c.key)
        done = {}
        for k, r in outcomes[c.key].items():
            done[k] = r
            if stop(done):
                break
        return done

    conf = Confirmation(evaluate, ref, alpha=0.05, limit=3, order=list(ref))
    cands = [Candidate("safe", speed=1.2, search_drop=0.0, search_upper=0.02),
             Candidate("risky", speed=2.0, search_drop=0.01, search_upper=0.04)]
    cert = conf.certify(cands, 0.05)
    assert cert.certified and cert.chosen.key == "safe", "risky fails its confirmation, safe stands"
    assert [k for k, _, _ in cert.steps] == ["safe", "risky"] and [p for _, _, p in cert.steps] == [True, False]
    assert len(conf.records["risky"]) < 200, "a hopeless candidate stops early (anytime-valid futility)"
    conf.certify(cands, 0.2)
    assert calls == ["safe", "risky"], "each candidate is evaluated once across budgets"
