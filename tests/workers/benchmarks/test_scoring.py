"""GSM8K and MMLU scorers on hand-written outputs: right, wrong, malformed and adversarial."""

from __future__ import annotations

import pytest

from workers.benchmarks import Item, Score, get_benchmark, per_topic
from workers.benchmarks.gsm8k import exemplar_solution, extract_number, gold_answer
from workers.benchmarks.mmlu import extract_letter


def _gsm(gold: str) -> Item:
    return Item("gsm8k/test/9999", 0, ("q",), gold, {})


def _mmlu(gold: str, topic: str = "anatomy") -> Item:
    return Item("mmlu/test/99999", 0, ("q",), gold, {"topic": topic, "row": 99999})


@pytest.mark.parametrize(("text", "expected", "rule"), [
    ("She makes 9 * 2 = $18 every day. The answer is 18.", "18", "stated answer"),
    ("The answer is $1,234.50.", "1234.50", "stated answer"),
    ("First 3 + 4 = 7, so \\boxed{14}. Later I check 15.", "14", "boxed"),
    ("Answer: -3", "-3", "stated answer"),
    ("The answer is: **42**", "42", "stated answer"),
    ("#### 1,000", "1000", "stated answer"),
    ("He has 5 apples, then 12, and finally 20 apples.", "20", "last number"),
    ("Pages 10-12 were read", "12", "last number"),  # a hyphen is not a minus sign
    ("The temperature is -5 now", "-5", "last number"),
    ("The answer is 7. Wait, the answer is 9.", "9", "stated answer"),  # the last statement wins
    ("The answer is N.\nSo 6 * 7 = 42", "42", "last number"),  # an echoed instruction is not an answer
    ("I cannot solve this.", None, "no number found"),
    ("", None, "no number found"),
])
def test_gsm8k_number_extraction(text, expected, rule):
    assert extract_number(text) == (expected, rule)


@pytest.mark.parametrize(("output", "gold", "score"), [
    ("The answer is 12.0.", "12", 1.0),  # 12.0 == 12
    ("The answer is $1,234.50", "1234.5", 1.0),
    ("The answer is 18", "180", 0.0),
    ("so the total is \\boxed{72}", "72", 1.0),
    ("The answer is 71.", "72", 0.0),
    ("no idea", "72", 0.0),
    ("The answer is -4.", "-4", 1.0),
])
def test_gsm8k_score(output, gold, score):
    s = get_benchmark("gsm8k").score(_gsm(gold), [output])
    assert isinstance(s, Score) and s.score == score, s
    assert s.reason


def test_gsm8k_score_records_why():
    s = get_benchmark("gsm8k").score(_gsm("72"), ["The answer is 71."])
    assert s.extracted == "71" and "mismatch" in s.reason and "72" in s.reason
    s = get_benchmark("gsm8k").score(_gsm("72"), ["nothing"])
    assert s.extracted is None and s.reason == "no number found"


def test_gsm8k_gold_and_exemplar_format():
    answer = "Natalia sold 48/2 = <<48/2=24>>24 clips.\nSo 48+24 = <<48+24=72>>72.\n#### 1,072"
    assert gold_answer(answer) == "1072"
    assert exemplar_solution(answer) == "Natalia sold 48/2 = 24 clips.\nSo 48+24 = 72.\nThe answer is 1072."


def test_score_checks_outputs_length():
    with pytest.raises(ValueError, match="one string per turn"):
        get_benchmark("gsm8k").score(_gsm("1"), "The answer is 1")  # a bare string, not a list
    with pytest.raises(ValueError, match="one string per turn"):
        get_benchmark("mmlu").score(_mmlu("A"), ["A", "B"])


@pytest.mark.parametrize(("text", "expected"), [
    ("Answer: C", "C"),
    ("(C)", "C"),
    ("C. Mitochondria", "C"),
    ("The answer is C", "C"),
    ("The correct answer is (B) because the others are wrong.", "B"),
    ("**D**", "D"),
    ("I would go with option B.", "B"),
    ("Option A is tempting, but the answer is D.", "D"),
    ("The answer is \\boxed{A}.", "A"),
    ("Looking at this...\nB\n", "B"),
    ("Because of osmosis, water moves.", None),  # the capital B of a word is not a letter answer
    ("A good question; it depends on Biology.", None),  # neither is the article A
    ("Both (A) and (B) look plausible", None),  # ambiguous parentheses
    ("the answer is a lot more complicated", None),
    ("", None),
])
def test_mmlu_letter_extraction(text, expected):
    assert extract_letter(text)[0] == expected


def test_mmlu_score_and_per_topic():
    bench = get_benchmark("mmlu")
    items = [_mmlu("A", "anatomy"), _mmlu("B", "anatomy"), _mmlu("C", "astronomy")]
    scores = [bench.score(items[0], ["Answer: A"]), bench.score(items[1], ["Because C"]),
              bench.score(items[2], ["The answer is (C)."])]
    assert [s.score for s in scores] == [1.0, 0.0, 1.0]
    assert scores[1].extracted is None and scores[1].reason == "no answer letter found"
    assert per_topic(items, scores) == {"anatomy": {"n": 2, "accuracy": 0.5}, "astronomy": {"n": 1, "accuracy": 1.0}}
