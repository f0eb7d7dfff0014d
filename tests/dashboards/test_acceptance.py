"""Accepted-length histograms derived from per-position counts, and the acceptance plots."""

from __future__ import annotations

import random

import pytest

from dashboards.acceptance import (
    accepted_length_histogram,
    per_position_rates,
    plot_acceptance_histograms,
    plot_per_position,
)
from tests.dashboards.trialdata import assert_png


def test_known_example():
    # 10 rounds, L=3: 4 accepted position 0, 3 reached position 1, 1 accepted all three.
    # exactly 0: 10-4, exactly 1: 4-3, exactly 2: 3-1, exactly 3: 1.
    assert accepted_length_histogram(10, [4, 3, 1]) == [6, 1, 2, 1]


def test_histogram_recovers_simulated_rounds():
    rng = random.Random(3)
    for draft_len in (1, 4, 8):
        lengths = [rng.randint(0, draft_len) for _ in range(500)]
        # What the engine counts: a round that accepted k tokens counts once at positions 0..k-1.
        counts = [sum(k > i for k in lengths) for i in range(draft_len)]
        hist = accepted_length_histogram(len(lengths), counts)
        assert hist == [lengths.count(k) for k in range(draft_len + 1)]
        assert sum(hist) == len(lengths)


def test_edge_cases():
    assert accepted_length_histogram(0, [0, 0]) == [0, 0, 0]
    assert accepted_length_histogram(7, []) == [7]
    assert accepted_length_histogram(5, [5, 5]) == [0, 0, 5]


@pytest.mark.parametrize("num_drafts, counts", [(3, [4, 1]), (10, [2, 5]), (10, [-1]), (-1, [])])
def test_counts_that_cannot_come_from_prefix_acceptance_raise(num_drafts, counts):
    with pytest.raises(ValueError, match="accepted_per_position|non-negative"):
        accepted_length_histogram(num_drafts, counts)


def test_per_position_rates():
    assert per_position_rates(10, [4, 3, 1]) == [0.4, 0.3, 0.1]


def test_plots_write_png(tmp_path):
    series = {"kl_judge": (100, [80, 60, 40, 20, 10]), "lossless": (120, [70, 40, 20, 5, 1]),
              "top_k L=3": (50, [30, 20, 10]), "all failed": (0, [0, 0])}
    assert_png(plot_acceptance_histograms(series, tmp_path / "hist.png"))
    rates = {label: per_position_rates(n, a) for label, (n, a) in series.items()}
    assert_png(plot_per_position(rates, tmp_path / "pos.png"))


def test_plots_with_no_series(tmp_path):
    assert_png(plot_acceptance_histograms({}, tmp_path / "hist.png"))
    assert_png(plot_per_position({}, tmp_path / "pos.png"))
