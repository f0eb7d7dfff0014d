"""The GPU check (jobs.gpu_check) at small shapes on CPU: every section runs, every rule x T is measured,
the correctness checks pass, and they can fail (a lossless rule that accepts everything is caught)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from jobs import gpu_check
from jobs.gpu.steps import CHI2_P_MIN
from policies import POLICIES, Decision

ROOT = Path(__file__).resolve().parents[2]


def rule_x_t() -> set[tuple[str, float]]:
    return {(name, t) for name in POLICIES for t in gpu_check.TEMPERATURES}


@pytest.mark.slow
def test_the_small_cpu_run_passes_and_covers_every_section_rule_and_temperature(tmp_path):
    out = tmp_path / "out"
    # ~20 s on this 2-core CPU when idle; the budget is lifted so a loaded machine cannot skip cases
    proc = subprocess.run([sys.executable, "-m", "jobs.gpu_check", "--device", "cpu", "--small", "--out", str(out),
                           "--budget-s", "1000"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert set(gpu_check.SECTIONS) | {"meta", "correctness", "rules_decide", "skipped"} <= set(results)
    assert results["correctness"] == {"checks": dict.fromkeys([*gpu_check.CORRECTNESS, "rules_decide"], True),
                                      "passed": True, "failed": []}
    assert results["skipped"] == []
    for section in gpu_check.MEASUREMENTS:
        cases = results[section]["cases"]
        assert {(c["rule"], c["T"]) for c in cases} == rule_x_t(), section
        assert not any(c.get("skipped") or c.get("fallback") for c in cases), section
    timing = results["timing"]["cases"]
    small = gpu_check.SMALL
    assert {(c["rule"], c["T"], c["B"], c["V"]) for c in timing} == {
        (name, t, b, v) for name, t in rule_x_t() for b in small.batches for v in small.vocabs}
    assert all(c["median_ms"] > 0 and c["argmax_ms"] > 0 and c["L"] == 5 for c in timing)
    # at T > 0 the fused statistics kernel is timed beside (off by default at these vocabularies), and works
    assert all(c["fused_median_ms"] > 0 and c["fused_failed"] is None for c in timing if c["T"] > 0)
    assert all(c["cuda_sync_warnings"] == "n/a" and c["host_syncs"] >= 0 for c in results["syncs"]["cases"])
    assert all(c["leaf_aten_ops"] > 0 for c in results["launches"]["cases"])
    heads = {tuple(c["head"]) for c in results["memory"]["cases"] if c["rule"] == "dropmatch"}
    assert heads == set(small.memory_heads)
    exact = [c for c in results["memory"]["cases"] if c["params"].get("mode") == "exact"]
    assert {(tuple(c["head"]), c["T"]) for c in exact} == {(h, t) for h in small.memory_heads for t in (0.0, 0.7)}
    # every memory case carries what the plan keeps for a rule at its shape (the device's peak is held to it
    # on CUDA); the syncs table counts host-to-device copies apart (a GPU run's check of items 1 and 2)
    from workers.vllm.memory import rule_working_bytes

    for c in results["memory"]["cases"]:
        assert c["plan_mib"] == round(rule_working_bytes(c["head"][0], c["B"] * c["L"], 8) / 2**20, 1) > 0, c
        assert c["within_plan"] == c["peak_extra_mib"] == "n/a"
    md = (out / "results.md").read_text()
    assert "| plan MiB | within plan |" in md and "| of which host-to-device |" in md
    # the exactness batch really holds the traps it is about
    for check in results["exactness"]["checks"]:
        assert check["drafts_at_a_later_tie"] > 0 and check["placeholder_drafts"] > 0
        assert check["requests_without_drafts"] > 0 and check["full_acceptances"] > 0
    assert {c["dtype"] for c in results["exactness"]["checks"]} == {"bfloat16", "float32"}
    assert all(c["p"] >= CHI2_P_MIN for c in results["chi_square"]["cases"])
    assert results["determinism"]["inputs_equal"] and len(results["determinism"]["hashes"]) == len(rule_x_t())
    pair = results["tiny_pair"]
    assert pair["equal"] and len(pair["reference"]) == small.pair_tokens and pair["accepted_drafts"] > 0
    assert "| lossless | 0 |" in (out / "results.md").read_text()


def accept_everything(batch, config):
    return Decision(accepted=torch.ones_like(batch.draft_token_ids, dtype=torch.bool))


def test_a_lossless_rule_that_accepts_everything_fails_exactness_and_chi_square(tmp_path, monkeypatch):
    monkeypatch.setitem(POLICIES, "lossless", replace(POLICIES["lossless"], fn=accept_everything))
    rc = gpu_check.main(["--device", "cpu", "--small", "--sections", "exactness,chi_square", "--out", str(tmp_path)])
    assert rc == 1
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["correctness"]["failed"] == ["chi_square", "exactness"]
    assert all(c["mismatched_requests"] > 0 for c in results["exactness"]["checks"])
    assert all(c["p"] < CHI2_P_MIN for c in results["chi_square"]["cases"])


def test_a_spent_budget_skips_measurements_and_records_why(tmp_path, capsys):
    rc = gpu_check.main(["--device", "cpu", "--small", "--sections", "timing", "--budget-s", "0",
                         "--out", str(tmp_path)])
    assert rc == 0  # timings never fail the run
    results = json.loads((tmp_path / "results.json").read_text())
    cases = results["timing"]["cases"]
    assert cases and all(c["skipped"] and "budget" in c["reason"] for c in cases)
    assert len(results["skipped"]) == len(cases)
    assert "skipping its remaining cases" in capsys.readouterr().out


def test_the_determinism_child_runs_from_the_repository_root_with_the_checkout_on_its_path(monkeypatch):
    """It ran from jobs/ and only imported `jobs` because .venv has an editable install: on a bare GPU box
    ("No module named jobs") the check failed. The child now starts at the repository root with it on PYTHONPATH."""
    import subprocess

    from jobs.gpu import correctness

    seen = {}

    class Stop(Exception):
        pass

    def popen(cmd, cwd=None, env=None, **_):
        seen.update(cwd=Path(cwd), path=(env or {}).get("PYTHONPATH", ""))
        raise Stop

    monkeypatch.setattr(subprocess, "Popen", popen)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    run = type("R", (), {"device": "cpu", "small": True})()
    with pytest.raises(Stop):
        correctness.check_determinism(run)
    assert (seen["cwd"] / "jobs" / "gpu_check.py").is_file() and (seen["cwd"] / "policies").is_dir()
    assert str(seen["cwd"]) in seen["path"].split(os.pathsep)
