"""A speed ratio in a log or report line is a number with an x, or words where there is none: never
``nanx`` (a measured speed where nothing was timed) or ``n/ax``."""

from __future__ import annotations

import math
from types import SimpleNamespace

from workers.metrics.speed import measured_text, ratio_text


def test_a_ratio_is_a_number_or_words():
    assert ratio_text(1.2345) == "1.23x" and ratio_text(1.2345, 3) == "1.234x"
    assert ratio_text(math.nan) == ratio_text(None) == ratio_text(math.inf) == "not timed"
    assert ratio_text(math.nan, missing="n/a") == "n/a"
    assert measured_text(1.5) == "measured 1.50x" and measured_text(1.5, 3) == "measured 1.500x"
    assert measured_text(math.nan) == measured_text(None) == "not timed"


def test_an_untimed_trial_line_says_not_timed(capsys):
    from sweep.search import trial_line

    metrics = SimpleNamespace(accuracy=0.5, accuracy_drop=0.0, speedup_vs_ar_modelled=1.25,
                              speedup_vs_ar_measured=math.nan, cost_ratio_in_situ=math.nan,
                              speedup_vs_ar_modelled_in_situ=math.nan, mean_acceptance_length=2.0)
    outcome = SimpleNamespace(number=3, state="COMPLETE", metrics=metrics, items_per_s=1.0,
                              spec=SimpleNamespace(label=lambda: "top_k k=4 L=2"))
    trial_line(outcome, {"best_lossless_draft_len": 2}, 1, 3, 60.0, "search best")
    line = capsys.readouterr().err
    assert "over target-only 1.25x (not timed) MAL" in line and "nan" not in line.lower()
    assert "n/a modelled" in line, "no speedup over the best lossless recorded: n/a, not nanx"
    metrics.speedup_vs_ar_measured, metrics.cost_ratio_in_situ, metrics.speedup_vs_ar_modelled_in_situ = 1.1, 0.4, 1.3
    trial_line(outcome, {"speedup_vs_best_lossless_modelled": 1.05}, 1, 3, 60.0, "search best")
    line = capsys.readouterr().err
    assert "1.05x modelled" in line and "(measured 1.10x, modelled with the c seen in this trial 0.40: 1.30x)" in line


def test_an_untimed_evaluation_report_says_not_timed():
    from jobs.evaluate import report

    nan = math.nan
    metrics = SimpleNamespace(accuracy_ci=(0.4, 0.6), accuracy_drop_ci=(-0.1, 0.1), items=4, failures=0, accuracy=0.5,
                              reference_accuracy=0.5, accuracy_drop=0.0, mean_acceptance_length=2.0,
                              draft_acceptance_rate=0.5, tokens_per_s=nan, speedup_vs_ar_measured=nan,
                              speedup_vs_ar_modelled=1.25, cost_ratio=0.4, cost_ratio_in_situ=nan,
                              speedup_vs_ar_modelled_in_situ=nan, speedup_vs_lossless_measured=nan,
                              speedup_vs_lossless_modelled=nan, output_divergence_vs_ar=0.0)
    args = SimpleNamespace(benchmark="gsm8k", pair="tiny-random", policy="top_k", param=[], draft_len=2,
                           temperature=0.0, cost_ratio=0.4)
    text = report(args, metrics, None, SimpleNamespace(dtype="fp32"))
    assert "speedup vs target-only  not timed   modelled 1.250x" in text
    assert "speedup vs lossless     not timed   modelled n/a" in text and "n/ax" not in text and "nanx" not in text
