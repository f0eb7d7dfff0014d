"""Task files (``--benchmark PATH.yaml``) and the scorer registry: the shipped GSM8K task prompts and scores
exactly as the built-in, every optional key does what it says, and a bad task file is one line naming
the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workers.benchmarks import get_benchmark
from workers.benchmarks.scorers import make_scorer

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "gsm8k" / "task.yaml"


def test_the_gsm8k_task_file_prompts_and_scores_as_the_built_in(bench_cache):
    task, builtin = get_benchmark(str(EXAMPLE)), get_benchmark("gsm8k")
    mine = task.items()
    theirs = builtin.items()[: len(mine)]
    assert len(mine) == 100
    for a, b in zip(mine, theirs, strict=True):
        assert task.messages(a) == builtin.messages(b)
        gold = b.reference
        for output in (f"so {gold} it is.\nThe answer is {gold}.", "The answer is 5.", "no number at all",
                       f"\\boxed{{{gold}}}", f"#### {gold},000"):
            assert task.score(a, [output]).score == builtin.score(b, [output]).score, (a.id, output)


def _task(tmp_path: Path, rows: list[dict], file: str = "t.yaml", data: str = "items.jsonl", **keys) -> str:
    path = tmp_path / data
    if data.endswith(".jsonl"):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif data.endswith(".csv"):
        import csv

        with path.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    else:
        import polars as pl

        pl.DataFrame(rows).write_parquet(path)
    spec = {"name": "mine", "data": keys.pop("data_key", data), "prompt": "Q: {q}\nA:", "reference": "a", "scorer": "exact", **keys}
    import yaml

    (tmp_path / file).write_text(yaml.safe_dump(spec))
    return str(tmp_path / file)


ROWS = [{"qid": f"x{i}", "q": f"{i} + 1?", "a": str(i + 1), "part": "search" if i % 2 else "confirm"} for i in range(10)]


@pytest.mark.parametrize("data", ["items.jsonl", "items.csv", "items.parquet"])
def test_every_data_format_reads_the_same_items(tmp_path, data):
    task = get_benchmark(_task(tmp_path, ROWS, data=data, id="qid"))
    items = task.items()
    assert [it.id for it in items] == [f"mine/x{i}" for i in range(10)]
    assert items[3].turns == ("Q: 3 + 1?\nA:",) and str(items[3].reference) == "4"
    assert task.score(items[3], [" 4 "]).score == 1.0 and task.score(items[3], ["5"]).score == 0.0


def test_optional_keys(tmp_path):
    task = get_benchmark(_task(tmp_path, ROWS, id="qid", split="part", fewshot=2, system="Be brief.", stop=["\n\n"],
                               max_new_tokens=32, chat=False, fewshot_target="{a}."))
    assert task.stop == ("\n\n",) and task.default_max_new_tokens == 32 and task.chat is False
    ids = {it.id for it in task.items()}
    assert "mine/x0" not in ids and "mine/x1" not in ids and len(ids) == 8, "exemplars are in neither split"
    assert {it.id for it in task.items(split="search")} == {f"mine/x{i}" for i in (3, 5, 7, 9)}
    msgs = task.messages(task.items()[0], shots=2)
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert msgs[2]["content"] == "1." and msgs[1]["content"] == "Q: 0 + 1?\nA:"
    with pytest.raises(ValueError, match="shots"):
        task.messages(task.items()[0], shots=3)
    assert task.split_info()["method"] == "column"


def test_editing_the_data_changes_the_key(tmp_path):
    first = get_benchmark(_task(tmp_path, ROWS)).key
    second = get_benchmark(_task(tmp_path, ROWS[:5])).key
    assert first != second and first.startswith("mine-")


def short_answer(output, reference, row):
    return (1.0, "short") if len(output) < 5 else (0.0, "long")


def out_of_range(output, reference, row):
    return 2.0


def test_scorers():
    assert make_scorer("numeric")("The total is $1,234.", "1234", {}).score == 1.0
    assert make_scorer("numeric")("about 12 apples", "#### 12", {}).score == 1.0
    grab = make_scorer(r"regex:answer: ([A-D])")
    assert grab("answer: B ... answer: C", "C", {}).score == 1.0 and grab("nothing", "C", {}).score == 0.0
    mine = make_scorer("python:tests.workers.benchmarks.test_taskfile:short_answer")
    assert mine("/x", None, {}).score == 1.0 and mine("a long answer", None, {}).reason == "long"
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        make_scorer("python:tests.workers.benchmarks.test_taskfile:out_of_range")("x", None, {})
    code = make_scorer("code")
    assert code("```python\ndef f(x):\n    return x + 1\n```", "assert f(1) == 2", {}).score == 1.0
    assert code("def f(x):\n    return x", "assert f(1) == 2", {}).score == 0.0


@pytest.mark.parametrize(("keys", "message"), [
    ({"scorer": "fuzzy"}, "scorer: unknown scorer 'fuzzy'"),
    ({"scorer": "regex:("}, "not a valid regular expression"),
    ({"scorer": "python:nope_module:f"}, "cannot import"),
    ({"prompt": "Q: {question}"}, "prompt: field 'question' is not in the data"),
    ({"reference": "answer"}, "reference: field 'answer'"),
    ({"id": "nope"}, "id: field 'nope'"),
    ({"name": "gsm8k"}, "built-in benchmark"),
    ({"name": "a b"}, "name: must be"),
    ({"fewshot": 10}, "fewshot: 10 exemplars leave none"),
    ({"chat": "maybe"}, "chat: must be"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"colour": "blue"}, "colour: unknown key"),
    ({"data_key": "missing.jsonl"}, "data: "),
])
def test_a_bad_task_file_is_one_line_naming_the_key(tmp_path, keys, message):
    with pytest.raises(ValueError, match=None) as err:
        get_benchmark(_task(tmp_path, ROWS, **keys))
    text = str(err.value)
    assert message in text and "\n" not in text and "t.yaml" in text, text


def test_duplicate_ids_and_bad_split_values_are_named(tmp_path):
    rows = [*ROWS, {**ROWS[0]}]
    with pytest.raises(ValueError, match="id: 'x0' names two rows"):
        get_benchmark(_task(tmp_path, rows, id="qid")).items()
    rows = [{**r, "part": "train"} for r in ROWS]
    with pytest.raises(ValueError, match="split: row 0 says 'train'"):
        get_benchmark(_task(tmp_path, rows, split="part")).items()
    with pytest.raises(ValueError, match="does not exist"):
        get_benchmark(str(tmp_path / "nowhere.yaml"))


def test_python_benchmarks_register_through_the_entry_point(tmp_path, monkeypatch):
    """An installed package's ``spectune.benchmarks`` entry point (here a dist-info on sys.path)."""
    import sys

    from workers.benchmarks.base import BENCHMARKS

    (tmp_path / "mybench_pkg.py").write_text(
        "from workers.benchmarks.base import BenchmarkBase, Item, Score\n"
        "class Mine(BenchmarkBase):\n"
        "    name = 'mine-ep'\n"
        "    files = ()\n"
        "    def _load(self, cache_dir):\n"
        "        return [Item(f'mine-ep/{i}', i, (f'say {i}',), str(i)) for i in range(4)]\n"
        "    def messages(self, item, shots=0, turn=0, previous=None):\n"
        "        return [{'role': 'user', 'content': item.turns[0]}]\n"
        "    def score(self, item, outputs, reference_outputs=None):\n"
        "        return Score(float(outputs[0].strip() == item.reference), None, 'exact')\n")
    info = tmp_path / "mybench_pkg-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mybench-pkg\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[spectune.benchmarks]\nmine-ep = mybench_pkg:Mine\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        bench = get_benchmark("mine-ep")
        assert [it.id for it in bench.items()] == [f"mine-ep/{i}" for i in range(4)]
        assert bench.score(bench.items()[2], ["2"]).score == 1.0
    finally:
        BENCHMARKS.pop("mine-ep", None)
        sys.modules.pop("mybench_pkg", None)


def test_the_judge_scorer_is_configured_by_the_task_file_and_retries_a_dead_endpoint(tmp_path, monkeypatch):
    import socket

    from workers.benchmarks.scorers import make_scorer

    monkeypatch.delenv("SPECTUNE_JUDGE_URL", raising=False)
    monkeypatch.setenv("SPECTUNE_JUDGE_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="judge: needs the endpoint's base url"):
        get_benchmark(_task(tmp_path, ROWS, scorer="judge", judge={"model": "m"}))
    with pytest.raises(ValueError, match=r"judge: judge.rubric must .*\{output\}"):
        get_benchmark(_task(tmp_path, ROWS, scorer="judge", judge={"url": "http://127.0.0.1:9/v1", "model": "m",
                                                                   "rubric": "no slot"}))
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    judge = make_scorer("judge", {"url": f"http://127.0.0.1:{port}/v1", "model": "m", "retries": 1})
    with pytest.raises(RuntimeError, match=f"judge at http://127.0.0.1:{port}/v1/chat/completions failed 2 times"):
        judge("out", "ref", {"prompt": "q"})
    monkeypatch.setenv("SPECTUNE_JUDGE_URL", f"http://127.0.0.1:{port}/v1")
    task = get_benchmark(_task(tmp_path, ROWS, scorer="judge", judge={"model": "m"}))
    assert task.scorer_name == "judge", "--judge-url (SPECTUNE_JUDGE_URL) stands in for judge.url"


def test_rows_of_a_few_shot_file_are_removed_from_the_data(tmp_path):
    """``fewshot: <file>`` rows that are also in the data (the same prompt, or the same id) were evaluated and
    confirmed on while the model saw them as exemplars; they are now in neither split, like ``fewshot: n``."""
    shots = tmp_path / "shots.jsonl"
    shots.write_text(json.dumps({"q": "3 + 1?", "a": "4"}) + "\n" + json.dumps({"qid": "x7", "q": "other", "a": "8"}) + "\n")
    task = get_benchmark(_task(tmp_path, ROWS, id="qid", fewshot="shots.jsonl"))
    ids = [it.id for it in task.items()]
    assert len(ids) == 8 and "mine/x3" not in ids and "mine/x7" not in ids
    assert task.max_shots == 2
    both = {it.id for s in ("search", "confirm") for it in task.items(split=s)}
    assert both == set(ids)


def test_the_ledger_key_is_the_data_not_the_task_files_wording(tmp_path):
    """Editing a task file's prompt, scorer or a comment changes its cache key but not its ledger's: the items,
    and the confirmation attempts made on them, are the same."""
    first = get_benchmark(_task(tmp_path, ROWS, id="qid"))
    key = first.ledger_key
    path = tmp_path / "t.yaml"
    path.write_text(path.read_text().replace("Q: {q}", "Question: {q}") + "# edited\n")
    second = get_benchmark(str(path))
    assert first.key != second.key and key == second.ledger_key
    (tmp_path / "items.jsonl").write_text((tmp_path / "items.jsonl").read_text() + json.dumps(
        {"qid": "x99", "q": "new", "a": "1", "part": "search"}) + "\n")
    path.write_text(path.read_text() + "# and again\n")  # a new stamp: the task file is read afresh
    assert get_benchmark(str(path)).ledger_key != key, "other data: another ledger"
