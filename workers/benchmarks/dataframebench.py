"""DataFrameBench: 825 pandas tasks (BigCodeBench-derived) scored pass@1 by their unittest suites.

Data: ``dataframebench==0.1.1`` (``dataframebench/data/{test,val,train}.jsonl``; CC-BY-4.0): task_id,
category, entry_point, libs, prompt (with ``{library_instruction}``/``{library_import}`` placeholders),
prompt_parts, test_code (a unittest ``TestCases`` class) and ground_truth (a pandas and a polars
reference solution). Only the data files are read (the wheel says Python >= 3.12; it is downloaded
with ``--python-version 3.12`` and never installed). All three splits are items,
``dataframebench/<split>/<task_id>`` (train is the split the authors allow training on; for a
decoding rule's acceptance it is as good an evaluation set as the others).

Prompt: the task's own prompt with the pandas condition filled in ("Use pandas as the data
processing library", ``import pandas as pd``), as the package's ``fill_condition`` does.

Scoring: the reply's code (``humaneval.extract_code``: the fenced block defining the entry point)
after the task's stub (so the stub's imports and constants stay in scope, as in HumanEval), then
the tests and a runner that fails unless every test passes, run in the data-stack sandbox
(``workers.benchmarks.sandbox_data``: .sandbox-venv, an unprivileged uid, no network, limits).

Excluded tasks: every reference solution was run three times in the sandbox
(``python -m workers.benchmarks.dataframebench_check --write``); a task whose reference failed or timed out
in any run is listed with its reason in ``dataframebench_excluded.json`` and is no item (most need a
library the sandbox venv leaves out: faker, requests, bs4, statsmodels, ...).

Harness errors are not model failures: a sandbox that did not start, a module the task needs
that the environment lacks, or a timeout the reference solution also hits on a rerun now, score
NaN with ``details["harness_error"] = True`` and a reason starting "harness error:". The
evaluation records them as failed items (``Record.failed``: NaN score), which the reference
store retries and the summaries count apart, not as a wrong answer.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

from workers.benchmarks.base import BenchmarkBase, Item, Score, register, user
from workers.benchmarks.data import DataFile, read_jsonl
from workers.benchmarks.humaneval import extract_code
from workers.benchmarks.sandbox import SandboxResult
from workers.benchmarks.sandbox_data import DEFAULT_TIMEOUT_S, run_data_python

SPLITS = ("test", "val", "train")
FILES = (
    DataFile("dataframebench", "0.1.1", "dataframebench/data/test.jsonl", "test.jsonl", 963_865,
             "a3bc8d0fd051321e28a3696304489da755490270addb2256fd1c26c589a16f1d", python_version="3.12"),
    DataFile("dataframebench", "0.1.1", "dataframebench/data/val.jsonl", "val.jsonl", 163_015,
             "a823178315e9920d70686bb84968e71219ab255b5c78a2053f7dd6ea29cae8cb", python_version="3.12"),
    DataFile("dataframebench", "0.1.1", "dataframebench/data/train.jsonl", "train.jsonl", 6_747_835,
             "e1266407f0bb857272a579a6e20c21fa891302ed8fa4ce608344ac7bf4c360a8", python_version="3.12"),
)
EXCLUDED_FILE = Path(__file__).with_name("dataframebench_excluded.json")
LIBRARY = "pandas"
IMPORT_LINE = "import pandas as pd"
INSTRUCTION_LINE = "Use pandas as the data processing library in your solution."
CHECK_RUNS = 3
# modules of the benchmark's requirements.txt (and the task libs' import names): missing one is the
# environment's gap, not the model's
ENVIRONMENT_MODULES = frozenset("""pandas polars numpy matplotlib seaborn scipy sklearn statsmodels faker requests
    bs4 lxml openpyxl holidays regex folium geopy dateutil pytz""".split())

_RUNNER = r'''

import sys as _sys
import unittest as _unittest
_cases = [_c for _c in list(globals().values()) if isinstance(_c, type) and issubclass(_c, _unittest.TestCase)
          and _c.__module__ == __name__]
_suite = _unittest.TestSuite(_unittest.defaultTestLoader.loadTestsFromTestCase(_c) for _c in _cases)
_result = _unittest.TextTestRunner(stream=_sys.stderr, verbosity=0).run(_suite)
if _result.testsRun == 0:
    raise SystemExit("no tests ran")
if not _result.wasSuccessful():
    _bad = _result.failures + _result.errors
    _lines = [_ln for _ln in _bad[0][1].strip().splitlines() if _ln.strip()]
    _sys.stderr.write(f"\n{len(_result.failures)} failed, {len(_result.errors)} errors of {_result.testsRun}: "
                      f"{_bad[0][0].id().rsplit('.', 1)[-1]}: {_lines[-1] if _lines else ''}\n")
    raise SystemExit(1)
'''
_MISSING = re.compile(r"No module named '([\w.]+)'")


def fill(text: str) -> str:
    """The pandas condition (the package's ``fill_condition(text, "pandas")``)."""
    return text.replace("{library_import}", IMPORT_LINE).replace("{library_instruction}", INSTRUCTION_LINE)


def build_program(stub: str, code: str, test_code: str) -> str:
    """The stub (imports, constants, the def), the reply's code, the tests, and the runner."""
    return f"{stub}\n\n{code}\n\n{test_code}\n{_RUNNER}"


def excluded() -> dict[str, str]:
    """``{item id: reason}`` of the tasks whose reference solution did not pass every check run."""
    if not EXCLUDED_FILE.exists():
        return {}
    return json.loads(EXCLUDED_FILE.read_text())["excluded"]


def missing_module(res: SandboxResult) -> str | None:
    """The environment's module a failed run could not import, else None."""
    for text in (res.reason, res.stderr_tail[-4000:]):
        for name in _MISSING.findall(text):
            if name.split(".")[0] in ENVIRONMENT_MODULES:
                return name
    return None


@register
class DataFrameBench(BenchmarkBase):
    name = "dataframebench"
    files = FILES
    stop: tuple[str, ...] = ()
    default_max_new_tokens = 1024
    max_shots = 0

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.timeout_s = timeout_s

    def all_items(self, cache_dir: str | os.PathLike[str] | None = None) -> list[Item]:
        """Every task, excluded ones included (the check runs on these)."""
        items = []
        for split in SPLITS:
            for r in read_jsonl(self.path(f"{split}.jsonl", cache_dir)):
                stub = fill(r["prompt_parts"]["stub"])
                items.append(Item(f"dataframebench/{split}/{r['task_id'].split('/')[-1]}", len(items),
                                  (fill(r["prompt"]),),
                                  {"stub": stub, "test_code": r["test_code"], "entry_point": r["entry_point"],
                                   "solution": r["ground_truth"][LIBRARY], "libs": r["libs"]},
                                  {"task_id": r["task_id"], "category": r["category"], "split": split,
                                   "entry_point": r["entry_point"], "seed_id": r.get("seed_id")}))
        return items

    def _load(self, cache_dir: str | os.PathLike[str] | None) -> list[Item]:
        skip = excluded()
        kept = [it for it in self.all_items(cache_dir) if it.id not in skip]
        return [Item(it.id, i, it.turns, it.reference, it.meta) for i, it in enumerate(kept)]

    def messages(self, item: Item, shots: int = 0, turn: int = 0, previous: list[tuple[str, str]] | None = None,
                 cache_dir: str | os.PathLike[str] | None = None) -> list[dict]:
        self._check(item, shots, turn)
        return [user(item.turns[0])]

    def run(self, item: Item, code: str, timeout_s: float | None = None) -> SandboxResult:
        ref = item.reference
        return run_data_python(build_program(ref["stub"], code, ref["test_code"]),
                               timeout_s=self.timeout_s if timeout_s is None else timeout_s)

    def score(self, item: Item, outputs: list[str], reference_outputs: list[str] | None = None) -> Score:
        """pass@1 of the reply in the data sandbox; a harness error scores NaN (see the module's docstring)."""
        self._check_outputs(item, outputs)
        code, found = extract_code(outputs[0], item.reference["entry_point"])
        if found == "none":
            return Score(0.0, None, "no code found", {"extraction": found})
        res = self.run(item, code)
        details: dict[str, Any] = {"extraction": found, "status": res.status, "returncode": res.returncode,
                                   "stderr_tail": res.stderr_tail[-2000:], "wall_s": res.wall_s,
                                   "isolation": res.network, "harness_error": False}
        harness = None
        if res.status == "error":
            harness = f"sandbox did not start: {res.reason}"
        elif res.status == "failed" and (mod := missing_module(res)):
            harness = f"the sandbox environment lacks {mod}"
        elif res.status == "timeout":
            again = self.run(item, item.reference["solution"])  # is it the reply, or the machine?
            details["reference_rerun"] = again.status
            if not again.passed:
                harness = f"{res.reason}, and the reference solution now gets {again.status}: {again.reason}"
        if harness is not None:
            return Score(math.nan, code, f"harness error: {harness}", details | {"harness_error": True})
        if res.passed:
            return Score(1.0, code, "passed", details)
        reason = res.reason if res.status == "timeout" else f"test failed: {res.reason}"
        return Score(0.0, code, reason, details)
