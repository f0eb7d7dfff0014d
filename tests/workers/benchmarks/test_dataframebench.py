"""DataFrameBench: the prompts carry the pandas condition, reference solutions pass and a neighbour's fail in
the data sandbox, the exclusion list holds (a sample rechecked three times), and harness errors are no losses."""

from __future__ import annotations

import json
import math
import subprocess

import pytest

from workers.benchmarks import get_benchmark
from workers.benchmarks.dataframebench import CHECK_RUNS, EXCLUDED_FILE, DataFrameBench, excluded
from workers.benchmarks.dataframebench_check import check, check_one, lacking
from workers.benchmarks.sandbox_data import REPO_ROOT


@pytest.fixture(scope="module", autouse=True)
def sandbox_venv():
    subprocess.run(["bash", str(REPO_ROOT / "scripts" / "setup-sandbox-env")], check=True, timeout=1200)


@pytest.fixture(scope="module")
def items(bench_cache):
    return get_benchmark("dataframebench").items(cache_dir=bench_cache)


@pytest.fixture(scope="module")
def sample(items):
    """The first kept task of each of three categories."""
    by_category: dict[str, object] = {}
    for it in items:
        by_category.setdefault(it.meta["category"], it)
    return list(by_category.values())[:3]


def _fenced(code: str) -> str:
    return f"Here is the solution:\n\n```python\n{code}\n```\n"


def test_items_are_every_task_but_the_excluded(items, bench_cache):
    every = DataFrameBench().all_items(bench_cache)
    skip = excluded()
    assert len(every) == 825 and len({it.id for it in every}) == 825
    assert set(skip) <= {it.id for it in every} and len(items) == 825 - len(skip)
    assert not {it.id for it in items} & set(skip)
    item = items[0]
    assert "{library_import}" not in item.turns[0] and "{library_instruction}" not in item.turns[0]
    assert "import pandas as pd" in item.turns[0] and "Use pandas" in item.turns[0]
    assert get_benchmark("dataframebench").messages(item) == [{"role": "user", "content": item.turns[0]}]


def test_the_exclusion_list_says_how_it_was_made():
    data = json.loads(EXCLUDED_FILE.read_text())
    assert data["tasks"] == 825 and data["excluded_count"] == len(data["excluded"]) == sum(data["by_reason"].values())
    assert "dataframebench_check" in data["command"]
    assert all(isinstance(why, str) and why for why in data["excluded"].values())


def test_reference_solutions_pass_and_a_neighbours_fail(sample):
    bench = get_benchmark("dataframebench")
    assert len(sample) >= 2
    for i, item in enumerate(sample):
        s = bench.score(item, [_fenced(item.reference["solution"])])
        assert s.score == 1.0 and s.details["harness_error"] is False, (item.id, s.reason, s.details["stderr_tail"])
        neighbour = sample[(i + 1) % len(sample)]
        s = bench.score(item, [_fenced(neighbour.reference["solution"])])
        assert s.score == 0.0 and s.reason.startswith("test failed"), (item.id, s.reason)


def test_a_sample_of_kept_tasks_passes_every_check_run(sample):
    done = check(DataFrameBench(), sample[:2], runs=CHECK_RUNS, workers=2)
    assert [(r["reason"], r["runs"]) for r in done.values()] == [(None, CHECK_RUNS)] * 2, done


def test_a_task_needing_a_library_the_venv_leaves_out_is_excluded_without_a_run(bench_cache):
    every = DataFrameBench().all_items(bench_cache)
    item = next(it for it in every if "faker" in it.reference["libs"])
    assert lacking(item) == ["faker"]
    row = check_one(DataFrameBench(), item)
    assert row["runs"] == 0 and "needs faker" in row["reason"]
    assert item.id in excluded()


def test_no_code_and_broken_code_are_model_failures(sample):
    bench = get_benchmark("dataframebench")
    assert bench.score(sample[0], ["  "]).reason == "no code found"
    s = bench.score(sample[0], [_fenced("def task_func(:\n")])
    assert s.score == 0.0 and "SyntaxError" in s.reason and not s.details["harness_error"]
    s = bench.score(sample[0], [_fenced("import notarealmodule\ndef task_func(*a, **k):\n    return None\n")])
    assert s.score == 0.0 and not s.details["harness_error"], s.reason  # a made-up module is the model's


def test_a_module_the_environment_lacks_is_a_harness_error(sample):
    s = get_benchmark("dataframebench").score(sample[0], [_fenced("import faker\ndef task_func(*a, **k):\n    pass\n")])
    assert math.isnan(s.score) and s.details["harness_error"] and "lacks faker" in s.reason, s


def test_a_sandbox_that_does_not_start_is_a_harness_error(sample, monkeypatch, tmp_path):
    monkeypatch.setenv("SPECTUNE_SANDBOX_VENV", str(tmp_path / "missing"))
    s = get_benchmark("dataframebench").score(sample[0], [_fenced(sample[0].reference["solution"])])
    assert math.isnan(s.score) and s.details["harness_error"] and "sandbox did not start" in s.reason, s


def test_a_timeout_is_the_models_unless_the_reference_times_out_too(sample):
    loop = "def task_func(*a, **k):\n    while True:\n        pass\n"
    s = DataFrameBench(timeout_s=0.5).score(sample[0], [_fenced(loop)])  # too short for the reference too
    assert math.isnan(s.score) and s.details["harness_error"] and s.details["reference_rerun"] == "timeout", s
    s = DataFrameBench(timeout_s=20).score(sample[0], [_fenced(loop)])
    assert s.score == 0.0 and not s.details["harness_error"] and s.details["reference_rerun"] == "passed", s
