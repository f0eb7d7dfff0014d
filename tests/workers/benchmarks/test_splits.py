"""Search and confirmation splits: disjoint, covering, deterministic, and GSM8K's from its own files."""

from __future__ import annotations

import pytest

from workers.benchmarks import get_benchmark
from workers.benchmarks.base import SPLITS

SEED_HALF = ["mmlu", "humaneval", "ifeval", "mtbench"]


@pytest.mark.parametrize("name", ["gsm8k", *SEED_HALF])
def test_splits_are_disjoint_and_deterministic(bench_cache, name):
    bench = get_benchmark(name)
    search, confirm = (bench.items(split=s, cache_dir=bench_cache) for s in SPLITS)
    ids_s, ids_c = {it.id for it in search}, {it.id for it in confirm}
    assert search and confirm and not ids_s & ids_c, "an item in both splits would leak the search into the certificate"
    assert [it.id for it in bench.items(split="search", cache_dir=bench_cache)] == [it.id for it in search]
    info = bench.split_info()
    assert info["search"] and info["confirm"], "the split assignment is recorded with the sweep"


@pytest.mark.parametrize("name", SEED_HALF)
def test_default_split_is_a_seeded_half_of_all_items(bench_cache, name):
    bench = get_benchmark(name)
    everything = {it.id for it in bench.items(cache_dir=bench_cache)}
    search, confirm = ({it.id for it in bench.items(split=s, cache_dir=bench_cache)} for s in SPLITS)
    assert search | confirm == everything
    assert abs(len(search) - len(everything) / 2) < 4 * (len(everything) ** 0.5) / 2 + 1


def test_gsm8k_searches_on_train_after_the_exemplars_and_confirms_on_test(bench_cache):
    bench = get_benchmark("gsm8k")
    search = bench.items(split="search", cache_dir=bench_cache)
    confirm = bench.items(split="confirm", cache_dir=bench_cache)
    assert len(search) == 7473 - 8 and search[0].id == "gsm8k/train/0008"
    assert len(confirm) == 1319 and all(it.id.startswith("gsm8k/test/") for it in confirm)
    exemplars = {q for q, _ in bench.exemplars(8, cache_dir=bench_cache)}
    assert not exemplars & {it.turns[0] for it in search}, "few-shot exemplars are never searched on"
    # a search item scores like any other: the gold comes from the train row's '####' answer
    item = search[0]
    assert bench.score(item, [f"The answer is {item.reference}."]).score == 1.0
    # seeded subsets and limits apply inside a split
    assert [it.id for it in bench.items(split="search", limit=5, seed=3, cache_dir=bench_cache)] != \
        [it.id for it in search[:5]]


def test_unknown_split_is_refused():
    with pytest.raises(ValueError, match=r"unknown split 'train'.*search.*confirm"):
        get_benchmark("gsm8k").items(split="train")
