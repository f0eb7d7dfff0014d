"""The frontier's arithmetic (workers.metrics.frontier) and the stated speed figure (workers.metrics.speed.stated_figure), on
hand-made records whose answers are known."""

from __future__ import annotations

import math

import polars as pl
import pytest

from dashboards.frontier import render
from workers.evaluation import Record
from workers.metrics.frontier import ceiling_rows, lossless_rows, lost_items, pareto, summary, trial_rows
from workers.metrics.speed import stated_figure


def rec(item: str, tokens: int, target_forwards: int, draft_forwards: int, accepted: int, drafted: int,
        score: float = 1.0, draft_len: int = 4, replay: str = "") -> Record:
    return Record(item_id=item, index=0, benchmark="b", spec_key="k", policy="lossless", params="{}",
                  draft_len=draft_len, outputs=["x"], score=score, extracted=None, reason="", tokens=tokens,
                  num_drafts=target_forwards, num_draft_tokens=drafted, num_accepted_tokens=accepted,
                  accepted_per_position=[0] * draft_len, target_forwards=target_forwards, draft_forwards=draft_forwards,
                  prefill_time_s=0.0, draft_time_s=0.0, verify_time_s=0.0, policy_time_s=0.0, wall_time_s=1.0,
                  finish_reasons=["eos"], replay=replay)


def test_lossless_rows_and_the_ceiling_are_tokens_per_modelled_cost():
    # L 2: 10 tokens in 5 rounds (10 draft forwards); L 4: 12 tokens in 4 rounds (16 draft forwards)
    lossless = {2: {"a": rec("a", 10, 5, 10, 5, 10, draft_len=2)}, 4: {"a": rec("a", 12, 4, 16, 8, 16)}}
    rows = lossless_rows(lossless, 0.5, lambda n: 1.0)
    assert rows[0]["acceptance_length"] == 2.0 and rows[0]["accepted_share"] == 0.5
    assert rows[0]["tokens_per_cost"] == pytest.approx(10 / (5 + 0.5 * 10))
    assert rows[1]["tokens_per_cost"] == pytest.approx(12 / (4 + 0.5 * 16))
    ceil = ceiling_rows([2, 4], 0.5, lambda n: 1.0, best=1.0)
    assert [c["tokens_per_cost"] for c in ceil] == [pytest.approx(3 / 2), pytest.approx(5 / 3)]
    data = summary(lossless=lossless, cost_ratio=0.5, verify_factor=lambda n: 1.0, frame=None, chosen={})
    assert data["best_lossless"]["draft_len"] == 2 and data["ceiling_best"] == pytest.approx((5 / 3) / 1.0)
    assert "No acceptance rule at any L can exceed **1.67x**" in render(data)


def test_lossless_rows_use_only_items_every_length_holds():
    lossless = {2: {"a": rec("a", 10, 5, 10, 5, 10, draft_len=2), "b": rec("b", 99, 1, 1, 1, 1, draft_len=2)},
                4: {"a": rec("a", 12, 4, 16, 8, 16), "b": rec("b", 5, 5, 5, 0, 5, score=math.nan)}}
    assert [r["items"] for r in lossless_rows(lossless, 0.5, lambda n: 1.0)] == [1, 1]


def frame(rows):
    base = {"params": "{}", "mean_acceptance_length": 3.0, "speedup_vs_ar_modelled": 1.5}
    return pl.DataFrame([{**base, **r} for r in rows])


def test_trials_lost_and_won_and_the_pareto_front():
    f = frame([
        {"trial": 0, "family": "a", "draft_len": 4, "state": "COMPLETE", "items": 40, "accuracy_drop": 0.05,
         "discordance": 0.15, "speedup_vs_best_lossless_modelled": 1.3},
        {"trial": 1, "family": "b", "draft_len": 4, "state": "COMPLETE", "items": 40, "accuracy_drop": 0.0,
         "discordance": 0.0, "speedup_vs_best_lossless_modelled": 1.0},
        {"trial": 2, "family": "c", "draft_len": 4, "state": "COMPLETE", "items": 40, "accuracy_drop": 0.05,
         "discordance": 0.05, "speedup_vs_best_lossless_modelled": 1.1},
        {"trial": 3, "family": "d", "draft_len": 4, "state": "PRUNED", "items": 8, "accuracy_drop": 0.5,
         "discordance": 0.5, "speedup_vs_best_lossless_modelled": 2.0},
    ])
    rows = trial_rows(f)
    assert [r["trial"] for r in rows] == [3, 0, 2, 1], "fastest first"
    t0 = next(r for r in rows if r["trial"] == 0)
    assert (t0["lost"], t0["won"]) == (4, 2)
    assert sorted(pareto(rows)) == [0, 1], "trial 2 is beaten by 0 (faster, same drop); pruned ones never count"


def test_lost_items_are_right_for_target_only_and_wrong_for_the_candidate():
    ref = {"a": rec("a", 9, 9, 0, 0, 0), "b": rec("b", 9, 9, 0, 0, 0, score=0.0), "c": rec("c", 9, 9, 0, 0, 0)}
    mine = {"a": rec("a", 9, 3, 9, 6, 9, score=0.0, replay="diverged@17"), "b": rec("b", 9, 3, 9, 6, 9, score=1.0),
            "c": rec("c", 9, 3, 9, 6, 9)}
    assert lost_items(ref, {"x": mine}) == {"x": [{"item": "a", "how": "diverged@17", "tokens": 9,
                                                   "reference_tokens": 9}]}


def test_the_stated_figure_is_measured_when_the_model_is_off_by_more_than_15_percent():
    ok = stated_figure({"modelled": 1.25, "modelled_timed": 1.2, "measured": 1.1})
    assert ok["model_agrees"] and ok["stated"] == 1.25 and ok["stated_from"] == "modelled"
    off = stated_figure({"modelled": 1.25, "modelled_timed": 1.4, "measured": 1.1})
    assert off["model_agrees"] is False and off["stated"] == 1.1 and off["model_error"] == pytest.approx(1.4 / 1.1 - 1)
    untimed = stated_figure({"modelled": 1.25, "measured": math.nan})
    assert untimed["model_agrees"] is None and untimed["stated"] == 1.25
