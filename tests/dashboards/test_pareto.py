"""Pareto front: known fronts from hand-made sweeps, a brute-force cross-check, and the plot."""

from __future__ import annotations

import random

import polars as pl

from dashboards.pareto import pareto_front, plot_pareto
from tests.dashboards.trialdata import NAN, assert_png, frame, sweep, trial


def test_front_is_the_known_non_dominated_completed_trials():
    front = pareto_front(sweep())
    # trial 5 (pruned, fastest) would dominate nothing it should: pruned trials are never ranked.
    assert front["trial"].to_list() == [0, 1, 4]
    assert front["speedup_vs_ar_modelled"].is_sorted()


def test_same_speedup_keeps_only_the_most_accurate_and_exact_ties_both():
    trials = frame(trial(0, "a", 2.0, 0.60), trial(1, "a", 2.0, 0.50), trial(2, "b", 2.0, 0.60),
                   trial(3, "b", 1.0, 0.60))
    # 1 is beaten on accuracy at equal speed; 3 is beaten on speed at equal accuracy; 0 and 2 tie.
    assert pareto_front(trials)["trial"].to_list() == [0, 2]


def test_front_matches_brute_force_definition():
    rng = random.Random(7)
    rows = [trial(i, rng.choice("abc"), round(rng.uniform(1, 3), 1), round(rng.uniform(0.4, 0.6), 2))
            for i in range(60)]
    pts = {r["trial"]: (r["speedup_vs_ar_modelled"], r["accuracy"]) for r in rows}
    expected = [i for i, (x, y) in pts.items()
                if not any(x2 >= x and y2 >= y and (x2 > x or y2 > y) for x2, y2 in pts.values())]
    assert sorted(pareto_front(frame(*rows))["trial"].to_list()) == sorted(expected)


def test_other_axes_and_nan_values_are_excluded():
    trials = frame(trial(0, "a", 2.0, 0.6), trial(1, "a", NAN, 0.7), trial(2, "a", 1.5, NAN))
    assert pareto_front(trials)["trial"].to_list() == [0]
    by_measured = pareto_front(sweep(), x="speedup_vs_ar_measured")
    assert by_measured["trial"].to_list() == [0, 1, 4]


def test_degenerate_frames():
    assert pareto_front(pl.DataFrame()).height == 0
    assert pareto_front(frame(trial(0, "a", 1.2, 0.6, state="PRUNED"))).height == 0
    assert pareto_front(frame(trial(3, "a", 1.2, 0.6)))["trial"].to_list() == [3]


def test_plot_pareto_writes_png(tmp_path):
    path = plot_pareto(sweep(), tmp_path / "sub" / "pareto.png", reference_accuracy=0.62,
                       budgets=[0.01, 0.02, 0.05], title="test sweep")
    assert path == tmp_path / "sub" / "pareto.png"
    assert_png(path)


def test_plot_pareto_without_completed_trials(tmp_path):
    assert_png(plot_pareto(pl.DataFrame(), tmp_path / "empty.png", reference_accuracy=0.6, budgets=[0.01]))
    pruned = frame(trial(0, "dropmatch", 2.0, 0.5, state="PRUNED"))
    assert_png(plot_pareto(pruned, tmp_path / "pruned.png", reference_accuracy=None, budgets=[0.01]))
