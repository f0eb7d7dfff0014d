"""The sweep's outputs stay field for field what they were: a tiny-pair sweep's ``report/`` (certificates,
per-item evidence, chosen files, frontier, trials, the pages' text) against the golden file captured from the
code before the sweep library was moved out of ``jobs/``, times, ids and paths masked (``tests.sweep.outputs``)."""

from __future__ import annotations

import json

import pytest

from tests.sweep.outputs import GOLDEN, differences, normalized, run_sweep

pytestmark = pytest.mark.slow


def test_a_tiny_sweep_leaves_the_golden_outputs(tmp_path):
    got = json.loads(json.dumps(normalized(run_sweep(tmp_path)), default=str))
    diff = differences(json.loads(GOLDEN.read_text()), got)
    assert diff == [], "the sweep's outputs changed (rewrite the golden only for an intended change):\n" + "\n".join(diff[:40])


def test_the_comparison_sees_a_changed_decision():
    golden = json.loads(GOLDEN.read_text())
    changed = json.loads(GOLDEN.read_text())
    budget = next(iter(changed["certification.json"]["budgets"].values()))
    budget["certified"] = not budget["certified"]
    assert differences(golden, golden) == []
    assert any("certified" in line for line in differences(golden, changed))
