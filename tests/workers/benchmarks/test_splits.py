"""Search and confirmation splits: disjoint, covering, deterministic, and GSM8K's from its own files."""

from __future__ import annotations

import pytest

from workers.benchmarks import get_benchmark
from workers.benchmarks.base import SPLITS

SEED_HALF = ["mmlu", "humaneval", "ifeval", "mtbench", "math500", "dataframebench"]


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


def test_the_pool_order_is_chosen_by_nobody_and_no_search_sample_lines_up_with_its_front(bench_cache):
    """The confirmation pool is ordered by sha256('confirm/' + id), never by a seed: the search samples of any
    seed and size share no more items with the front of another study's pool than chance allows. (It once used
    the search sample's seeded order, so a seed-0 study with 200 search items had 101 of a 40-item study's first
    120 pool items as its search items, and ``jobs.evaluate --subset-seed 0`` ran exactly the pool's test items.)"""
    from scipy.stats import hypergeom

    bench = get_benchmark("gsm8k")
    sample = bench.items(limit=40, seed=0, split="search", cache_dir=bench_cache)
    pool, sources = bench.confirmation_pool(sample, cache_dir=bench_cache)
    assert sources == {"gsm8k/test": 1319, "gsm8k/train": 7465 - 40} and len(pool) == 1319 + 7465 - 40
    import hashlib

    ids = [it.id for it in pool]
    assert ids == sorted(ids, key=lambda i: hashlib.sha256(f"confirm/{i}".encode()).hexdigest())
    front = {it.id for it in pool[:120]}
    train_front = sum(i.startswith("gsm8k/train/") for i in front)
    for size in (32, 40, 100, 200):
        # a size-n search sample is n train rows at random: its overlap with the front is hypergeometric
        ceiling = hypergeom(7465, train_front, size).ppf(1 - 1e-4)
        for seed in range(20):
            other = {it.id for it in bench.items(limit=size, seed=seed, split="search", cache_dir=bench_cache)}
            assert len(other & front) <= ceiling, (size, seed, len(other & front))
    # another study's pool (another seed, another size) keeps the same order: only its own search items leave it
    other_sample = bench.items(limit=200, seed=7, split="search", cache_dir=bench_cache)
    other_pool = [it.id for it in bench.confirmation_pool(other_sample, cache_dir=bench_cache)[0]]
    gone = {it.id for it in other_sample}
    assert other_pool == [it.id for it in pool if it.id not in gone][: len(other_pool)] or \
        [i for i in other_pool if i not in {it.id for it in sample}] == [it.id for it in pool if it.id not in gone]
    # jobs.evaluate's seeded subsets of the test set are not the pool's test items in order
    test_front = [it.id for it in pool if it.id.startswith("gsm8k/test/")][:40]
    for seed in range(5):
        subset = [it.id for it in bench.items(limit=40, seed=seed, split="confirm", cache_dir=bench_cache)]
        assert len(set(subset) & set(test_front)) <= hypergeom(1319, 40, 40).ppf(1 - 1e-4)
