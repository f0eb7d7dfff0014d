"""IFEval with Google's checker imported from the cache: hand-made responses that follow or break
instructions, loose vs strict, and the nltk patches (no punkt data needed)."""

from __future__ import annotations

import pytest

from workers.benchmarks import get_benchmark, ifeval_summary
from workers.benchmarks.ifeval import CHECKER_PACKAGE, load_checker


@pytest.fixture(scope="module")
def items(bench_cache):
    return {it.id: it for it in get_benchmark("ifeval").items(cache_dir=bench_cache)}


def _score(item, text):
    return get_benchmark("ifeval").score(item, [text])


def test_checker_is_imported_from_the_cache(bench_cache):
    checker = load_checker(bench_cache)
    assert checker.__name__ == CHECKER_PACKAGE
    assert str(bench_cache / "benchmarks" / "ifeval" / "checker") in checker.__file__
    assert len(checker.INSTRUCTION_DICT) >= 25


def test_no_comma(items):
    item = items["ifeval/test/0417"]  # limerick, no commas
    assert item.reference["instruction_id_list"] == ["punctuation:no_comma"]
    good = _score(item, "A writer sat down with a pen\nTo rhyme about rhyming again")
    bad = _score(item, "A writer sat down, with a pen")
    assert (good.score, bad.score) == (1.0, 0.0)
    assert good.reason == "all instructions followed" and "punctuation:no_comma" in bad.reason


def test_end_phrase_strict_versus_loose(items):
    item = items["ifeval/test/0416"]  # must end with "Call me at 631-481-4867"
    exact = _score(item, "Dear hiring manager,\nI would love this job.\nCall me at 631-481-4867")
    trailing = _score(item, "Dear hiring manager,\nI would love this job.\nCall me at 631-481-4867\n---")
    wrong = _score(item, "Dear hiring manager,\nI would love this job. Thanks!")
    assert exact.details["prompt_strict"] and exact.details["prompt_loose"]
    # loose drops the first/last line, so a trailing rule passes loose but not strict
    assert not trailing.details["prompt_strict"] and trailing.details["prompt_loose"] and trailing.score == 0.0
    assert not wrong.details["prompt_loose"]


def test_sentence_count_uses_punkt_without_data(items):
    item = items["ifeval/test/0331"]  # at least 20 sentences
    assert _score(item, " ".join(f"Agencies help business number {i}." for i in range(25))).score == 1.0
    assert _score(item, "Agencies help. They are good.").score == 0.0


def test_capital_words_use_word_tokenize_without_data(items):
    item = items["ifeval/test/0349"]  # at least 15 all-capital words
    many = " ".join(["TRIPS AND STITCHES ARE HARD."] * 4) + " The end."
    assert _score(item, many).score == 1.0
    assert _score(item, "Trips and stitches are hard.").score == 0.0


def test_language_and_lowercase(items):
    assert _score(items["ifeval/test/0128"], "martin van buren was the eighth president.").score == 1.0
    assert _score(items["ifeval/test/0128"], "Martin Van Buren was the eighth president.").score == 0.0
    arabic = "تتطلع الشركة إلى توسيع عملياتها في أسواق جديدة وستوفر فرص عمل جديدة للناس في المنطقة."
    assert _score(items["ifeval/test/0425"], arabic).score == 1.0
    assert _score(items["ifeval/test/0425"], "The company wants to grow into new markets.").score == 0.0


def test_multi_instruction_details_and_summary(items):
    item = items["ifeval/test/0000"]  # no commas + 3 highlighted sections + 300 words
    text = "*Part one* *Part two* *Part three* " + " ".join(["word"] * 320)
    partial = "*Part one* " + " ".join(["word"] * 10)
    s_full, s_part = _score(item, text), _score(item, partial)
    assert s_full.details["instruction_strict"] == [True, True, True]
    assert s_part.details["instruction_strict"] == [True, False, False] and s_part.score == 0.0
    assert ifeval_summary([s_full, s_part]) == {"prompt_strict": 0.5, "prompt_loose": 0.5,
                                                "instruction_strict": 4 / 6, "instruction_loose": 4 / 6}


def test_empty_response_follows_nothing(items):
    s = _score(items["ifeval/test/0417"], "")
    assert s.score == 0.0 and s.details["instruction_loose"] == [False]
