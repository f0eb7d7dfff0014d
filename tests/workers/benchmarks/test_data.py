"""Loading: row counts, pinned checksums, idempotent fetch, the registry, item order, shards and prompts."""

from __future__ import annotations

import hashlib
import shutil
import zipfile
from pathlib import Path

import pytest

from workers.benchmarks import BENCHMARKS, Benchmark, fetch_benchmarks, get_benchmark
from workers.benchmarks.__main__ import main as cli
from workers.benchmarks.data import DataFile, fetch_files
from workers.benchmarks.dataframebench import excluded as dataframebench_excluded
from workers.benchmarks.mmlu import format_question
from workers.models.assets import AssetError

EXPECTED = {"gsm8k": 1319, "mmlu": 14042 - 57 * 5, "humaneval": 164, "ifeval": 541, "mtbench": 80, "math500": 311,
            "dataframebench": 825 - len(dataframebench_excluded())}  # tasks whose reference fails are left out


def test_registry_lists_all_and_rejects_unknown():
    assert sorted(BENCHMARKS) == sorted(EXPECTED)
    assert all(isinstance(b, Benchmark) for b in BENCHMARKS.values())
    with pytest.raises(ValueError, match=r"unknown benchmark 'gsm9k'.*'gsm8k'.*'mtbench'"):
        get_benchmark("gsm9k")


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_row_counts_and_stable_ids(bench_cache, name):
    items = get_benchmark(name).items(cache_dir=bench_cache)
    assert len(items) == EXPECTED[name]
    assert [it.index for it in items] == list(range(len(items)))
    assert len({it.id for it in items}) == len(items) and all(it.id.startswith(f"{name}/") for it in items)
    assert all(isinstance(t, str) and t for it in items for t in it.turns)


def test_mmlu_drops_stray_header_rows(bench_cache):
    items = get_benchmark("mmlu").items(cache_dir=bench_cache)
    rows = {it.meta["row"] for it in items}
    assert {11776, 12793}.isdisjoint(rows) and len(rows) == 14044 - 2 - 57 * 5  # and 5 exemplars per topic
    assert {it.reference for it in items} == set("ABCD") and len({it.meta["topic"] for it in items}) == 57


def test_gsm8k_train_has_7473_rows(bench_cache):
    from workers.benchmarks.data import read_jsonl
    assert len(read_jsonl(get_benchmark("gsm8k").path("train.jsonl", bench_cache))) == 7473


def test_mtbench_has_two_turns_and_references(bench_cache):
    items = get_benchmark("mtbench").items(cache_dir=bench_cache)
    assert all(len(it.turns) == 2 for it in items)
    with_ref = {it.meta["category"] for it in items if it.reference is not None}
    assert with_ref == {"math", "reasoning", "coding"} and sum(it.reference is not None for it in items) == 30


def _copy_benchmark(src_root: Path, dst_root: Path, name: str) -> Path:
    shutil.copytree(src_root / "benchmarks" / name, dst_root / "benchmarks" / name)
    (dst_root / "wheels").symlink_to(src_root / "wheels")  # re-extraction must not hit the network
    return dst_root / "benchmarks" / name


def test_corrupt_file_raises_naming_checksums_then_fetch_repairs(bench_cache, tmp_path):
    bdir = _copy_benchmark(bench_cache, tmp_path, "gsm8k")
    path = bdir / "test.jsonl"
    data = bytearray(path.read_bytes())
    data[100] ^= 1  # same size, one bit flipped
    path.write_bytes(bytes(data))
    actual = hashlib.sha256(bytes(data)).hexdigest()
    with pytest.raises(AssetError) as err:
        get_benchmark("gsm8k").items(cache_dir=tmp_path)
    msg = str(err.value)
    assert "test.jsonl" in msg and actual in msg
    assert "9f098df7ff4522078d6ccec27a5c38a454790fdb51131bedfaa0e490070d5394" in msg  # expected
    assert "python -m workers.benchmarks fetch --benchmark gsm8k" in msg
    fetch_benchmarks(["gsm8k"], cache_dir=tmp_path)  # idempotent fetch re-extracts the bad file
    assert len(get_benchmark("gsm8k").items(cache_dir=tmp_path)) == 1319


def test_missing_files_are_extracted_on_first_use(bench_cache, tmp_path):
    (tmp_path / "wheels").symlink_to(bench_cache / "wheels")
    assert len(get_benchmark("humaneval").items(cache_dir=tmp_path)) == 164
    assert (tmp_path / "benchmarks" / "humaneval" / "HumanEval.jsonl.gz").is_file()


def _fake_wheel(root: Path, member: str, data: bytes) -> None:
    (root / "wheels").mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(root / "wheels" / "fake_pkg-1.0-py3-none-any.whl", "w") as zf:
        zf.writestr(member, data)


def test_extract_checks_the_wheel_member(tmp_path):
    _fake_wheel(tmp_path, "fake_pkg/data.txt", b"hello")
    good = DataFile("fake-pkg", "1.0", "fake_pkg/data.txt", "data.txt", 5, hashlib.sha256(b"hello").hexdigest())
    assert fetch_files("fake", (good,), tmp_path)["data.txt"].read_bytes() == b"hello"
    wrong = DataFile("fake-pkg", "1.0", "fake_pkg/data.txt", "other.txt", 5, "0" * 64)
    with pytest.raises(AssetError, match="expected sha256 0{64} size 5, got sha256 " + good.sha256):
        fetch_files("fake", (wrong,), tmp_path)
    assert not (tmp_path / "benchmarks" / "fake" / "other.txt").exists()  # nothing half-made is left
    assert not list((tmp_path / "benchmarks" / "fake").glob("*.tmp"))
    absent = DataFile("fake-pkg", "1.0", "fake_pkg/nope.txt", "nope.txt", 5, good.sha256)
    with pytest.raises(AssetError, match="no member 'fake_pkg/nope.txt'"):
        fetch_files("fake", (absent,), tmp_path)


def test_cli_fetch_and_verify(bench_cache, tmp_path, capsys):
    bdir = _copy_benchmark(bench_cache, tmp_path, "humaneval")
    assert cli(["verify", "--benchmark", "humaneval", "--cache-dir", str(tmp_path)]) == 0
    (bdir / "HumanEval.jsonl.gz").write_bytes(b"garbage")
    assert cli(["verify", "--benchmark", "humaneval", "--cache-dir", str(tmp_path)]) == 1
    assert "expected sha256" in capsys.readouterr().err
    assert cli(["fetch", "--benchmark", "humaneval", "--cache-dir", str(tmp_path)]) == 0
    assert cli(["verify", "--benchmark", "humaneval", "--cache-dir", str(tmp_path)]) == 0


@pytest.mark.parametrize("name", ["gsm8k", "humaneval", "mtbench"])
def test_order_is_deterministic_and_seed_changes_it(bench_cache, name):
    bench = get_benchmark(name)
    plain = [it.id for it in bench.items(cache_dir=bench_cache)]
    assert plain == sorted(plain)  # file order
    a = [it.id for it in bench.items(seed=3, cache_dir=bench_cache)]
    b = [it.id for it in bench.items(seed=3, cache_dir=bench_cache)]
    c = [it.id for it in bench.items(seed=4, cache_dir=bench_cache)]
    assert a == b and sorted(a) == plain and a != plain and a != c


def test_limit_takes_a_prefix_of_the_seeded_order(bench_cache):
    bench = get_benchmark("gsm8k")
    full = bench.items(seed=7, cache_dir=bench_cache)
    assert bench.items(limit=25, seed=7, cache_dir=bench_cache) == full[:25]
    assert bench.items(limit=0, cache_dir=bench_cache) == []


@pytest.mark.parametrize("n", [1, 3, 4])
def test_shards_partition_the_selection(bench_cache, n):
    bench = get_benchmark("gsm8k")
    selection = bench.items(limit=50, seed=1, cache_dir=bench_cache)
    shards = [bench.items(limit=50, seed=1, shard=(i, n), cache_dir=bench_cache) for i in range(n)]
    got = sorted((it for s in shards for it in s), key=lambda it: it.index)
    assert got == selection, "shards must cover every selected item exactly once"
    assert max(len(s) for s in shards) - min(len(s) for s in shards) <= 1


@pytest.mark.parametrize(("kwargs", "match"), [({"shard": (2, 2)}, "shard"), ({"shard": (0, 0)}, "shard"),
                                              ({"limit": -1}, "limit")])
def test_bad_selection_arguments_raise(bench_cache, kwargs, match):
    with pytest.raises(ValueError, match=match):
        get_benchmark("humaneval").items(cache_dir=bench_cache, **kwargs)


def test_gsm8k_messages_zero_and_eight_shot(bench_cache):
    bench = get_benchmark("gsm8k")
    item = bench.items(limit=1, cache_dir=bench_cache)[0]
    zero = bench.messages(item, cache_dir=bench_cache)
    assert [m["role"] for m in zero] == ["user"] and item.turns[0] in zero[0]["content"]
    eight = bench.messages(item, shots=8, cache_dir=bench_cache)
    assert [m["role"] for m in eight] == ["user", "assistant"] * 8 + ["user"]
    assert all(m["content"].endswith(".") and "The answer is " in m["content"] and "<<" not in m["content"]
               for m in eight[1::2])
    other = bench.items(limit=2, cache_dir=bench_cache)[1]
    assert bench.messages(other, shots=8, cache_dir=bench_cache)[:-1] == eight[:-1], "same prefix for every item"
    with pytest.raises(ValueError, match="shots"):
        bench.messages(item, shots=9, cache_dir=bench_cache)
    with pytest.raises(ValueError, match="turn"):
        bench.messages(item, turn=1, cache_dir=bench_cache)


def test_mmlu_five_shot_uses_same_topic_exemplars_that_are_never_items(bench_cache):
    """Exemplars from the items themselves put confirmation questions into search prompts (and back)."""
    bench = get_benchmark("mmlu")
    items = bench.items(cache_dir=bench_cache)
    first = next(it for it in items if it.meta["topic"] == "astronomy")
    msgs = bench.messages(first, shots=5, cache_dir=bench_cache)
    assert [m["role"] for m in msgs] == ["user", "assistant"] * 5 + ["user"]
    assert all("about astronomy" in m["content"] for m in msgs[::2])
    reserved = {i for rows in bench._exemplar_rows(bench_cache).values() for i, _ in rows}
    assert len(reserved) == 57 * 5 and reserved.isdisjoint(it.meta["row"] for it in items), "exemplars are never items"
    exemplar_text = {format_question(r) for rows in bench._exemplar_rows(bench_cache).values() for _, r in rows}
    assert all(m["content"] in exemplar_text for m in msgs[:-1:2])
    assert all(m["content"] in {f"Answer: {c}" for c in "ABCD"} for m in msgs[1::2])
