"""MT-bench: two-turn messages, FastChat judge prompts and rating parsing, and MiniLM similarity."""

from __future__ import annotations

import math

import pytest

from workers.benchmarks import get_benchmark, similarity
from workers.benchmarks.mtbench import MTBench, parse_judgement


@pytest.fixture(scope="module")
def items(bench_cache):
    return get_benchmark("mtbench").items(cache_dir=bench_cache)


@pytest.mark.parametrize(("text", "rating"), [
    ("The answer is helpful. Rating: [[7]]", 7.0),
    ("Rating: [[8.5]]", 8.5),
    ("I'd give it [6] overall", 6.0),  # FastChat's backup pattern
    ("Rating: 4", 4.0),
    ("[[11]]", None),  # out of the 1..10 scale
    ("no rating here", None),
    ("Explanation first. [[3]] then a stray [[9]]", 3.0),  # first match, as FastChat
])
def test_parse_judgement(text, rating):
    assert parse_judgement(text) == rating


def test_turn_two_includes_the_models_first_answer(items, bench_cache):
    bench, item = get_benchmark("mtbench"), items[0]
    assert bench.messages(item, cache_dir=bench_cache) == [{"role": "user", "content": item.turns[0]}]
    msgs = bench.messages(item, turn=1, previous=[(item.turns[0], "MY ANSWER")], cache_dir=bench_cache)
    assert [m["role"] for m in msgs] == ["user", "assistant", "user"]
    assert msgs[1]["content"] == "MY ANSWER" and msgs[2]["content"] == item.turns[1]
    with pytest.raises(ValueError, match="previous"):
        bench.messages(item, turn=1, cache_dir=bench_cache)


def test_judge_prompts_follow_fastchat(items, bench_cache):
    bench = get_benchmark("mtbench")
    writing = next(it for it in items if it.meta["category"] == "writing")
    math_item = next(it for it in items if it.meta["category"] == "math")
    p1 = bench.judge_prompt(writing, ["ANSWER ONE", "ANSWER TWO"], turn=0, cache_dir=bench_cache)
    assert p1.startswith("You are a helpful assistant.") and "ANSWER ONE" in p1 and "ANSWER TWO" not in p1
    assert '"[[rating]]"' in p1
    p2 = bench.judge_prompt(math_item, ["ANSWER ONE", "ANSWER TWO"], turn=1, cache_dir=bench_cache)
    assert "second question" in p2 and "ANSWER TWO" in p2 and math_item.reference[1] in p2  # reference answers shown


def test_judge_score_is_normalised_rating(items, bench_cache):
    prompts = []

    def judge(prompt: str) -> str:
        prompts.append(prompt)
        return "Solid. Rating: [[10]]" if len(prompts) == 1 else "Weak. Rating: [[1]]"

    s = MTBench(judge=judge).score(items[0], ["a", "b"], cache_dir=bench_cache)
    assert s.details["judge_ratings"] == [10.0, 1.0] and s.score == pytest.approx(0.5) and len(prompts) == 2
    unparseable = get_benchmark("mtbench").with_judge(lambda p: "I refuse").score(items[0], ["a", "b"], cache_dir=bench_cache)
    assert math.isnan(unparseable.score) and "unparseable" in unparseable.reason
    assert get_benchmark("mtbench").judge is None, "with_judge must not change the registry's instance"


def test_score_needs_references_or_a_judge(items):
    with pytest.raises(ValueError, match="reference_outputs"):
        get_benchmark("mtbench").score(items[0], ["a", "b"])


def test_similarity_orders_related_above_unrelated(bench_cache):
    a = "To make tea, boil water, steep the tea leaves for three minutes, then pour it into a cup."
    paraphrase = "Boil some water, let the tea leaves steep about three minutes and pour the tea into a mug."
    unrelated = "The quarterly financial report shows revenue growth in European markets."
    same = similarity(a, a, bench_cache)
    assert same == pytest.approx(1.0, abs=1e-5)
    assert same > similarity(a, paraphrase, bench_cache) > similarity(a, unrelated, bench_cache)


def test_similarity_sees_past_the_first_window(bench_cache):
    head = "The cat sat on the mat. " * 80  # well over 256 tokens
    assert similarity(head + "Stock markets crashed today. " * 80, head + "Stock markets crashed today. " * 80,
                      bench_cache) > similarity(head + "Stock markets crashed today. " * 80,
                                                head + "A recipe for apple pie. " * 80, bench_cache)


def test_similarity_score_with_reference_outputs(items, bench_cache):
    bench = get_benchmark("mtbench")
    same = bench.score(items[0], ["Hawaii is lovely.", "Always amazing."],
                       reference_outputs=["Hawaii is lovely.", "Always amazing."], cache_dir=bench_cache)
    assert same.score == pytest.approx(1.0, abs=1e-5) and len(same.details["similarity"]) == 2
    other = bench.score(items[0], ["Hawaii is lovely.", "Always amazing."],
                        reference_outputs=["Quarterly revenue rose.", "Tax rules changed."], cache_dir=bench_cache)
    assert 0.0 <= other.score < same.score and other.reason.startswith("similarity to reference")
