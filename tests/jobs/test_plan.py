"""`python -m jobs.plan`: items a certificate needs, from numbers or from a pilot's record dirs."""

from __future__ import annotations

import json
import math

import pytest

from jobs.plan import main
from workers.certify.decide import drop_bound, items_needed
from workers.certify.exact import exact_plan, exact_power
from workers.evaluation import Record
from workers.results.store import RecordStore


def rec(item: str, score: float, error: str | None = None) -> Record:
    return Record(item_id=item, index=0, benchmark="b", spec_key="k", policy="p", params="{}", draft_len=0,
                  outputs=["x"], score=score, extracted=None, reason="", tokens=10, num_drafts=10,
                  num_draft_tokens=0, num_accepted_tokens=0, accepted_per_position=[], target_forwards=10,
                  draft_forwards=0, prefill_time_s=0.0, draft_time_s=0.0, verify_time_s=1.0, policy_time_s=0.0,
                  wall_time_s=1.0, finish_reasons=["length"], output_token_ids=[[1]], error=error)


def store(path, scores: dict[str, float], failed: tuple[str, ...] = ()) -> str:
    s = RecordStore(path)
    for item, score in scores.items():
        s.append(rec(item, math.nan if item in failed else score, "boom" if item in failed else None))
    return str(path)


def test_numbers_give_the_exact_plan_with_one_line_of_explanation(capsys):
    """The plan is the smallest n (of a bisection) whose exact power reaches 80%; the normal
    approximation the planner used before promises 80% where the exact test has 76%."""
    assert main(["--discordance", "0.1", "--budget", "0.05"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    need = exact_plan(0.1, 0.05)
    assert lines[0] == f"{need} items needed for budget 0.05" and len(lines) == 2
    assert "80% power" in lines[1] and "exact power" in lines[1]
    assert exact_power(need, 0.05, 0.05, 0.1) >= 0.8 > exact_power(need - 1, 0.05, 0.05, 0.1)
    assert exact_power(items_needed(0.1, 0.05), 0.05, 0.05, 0.1) < 0.77 and need > items_needed(0.1, 0.05)


def test_json_lists_every_budget_and_never_for_a_drop_at_the_budget(capsys):
    assert main(["--discordance", "0.15", "--budget", "0.01,0.05", "--drop", "0.01", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["items_needed"] for r in out["budgets"]] == [None, exact_plan(0.15, 0.05, 0.01)]
    assert out["budgets"][1]["plan"] == "exact power"


def test_pilot_pairs_items_counts_failures_as_zero_and_plans_at_the_observed_discordance(tmp_path, capsys):
    ref_scores = {f"q{i}": 1.0 for i in range(40)}
    trial_scores = dict(ref_scores, q0=0.0, q1=0.0, q2=0.0, extra=1.0)
    trial_scores["q3"] = 1.0  # failed below: counts as a loss, not a dropped item
    ref_scores["q39"] = 0.0  # a win for the trial
    ref_dir = store(tmp_path / "ref", ref_scores)
    trial_dir = store(tmp_path / "trial", trial_scores, failed=("q3",))
    assert main(["--records", trial_dir, "--reference", ref_dir, "--budget", "0.05,0.5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    pilot = out["pilot"]
    assert pilot["items"] == 40 and pilot["only_in_records"] == 1 and pilot["only_in_reference"] == 0
    expected = drop_bound([ref_scores[f"q{i}"] for i in range(40)],
                          [0.0 if i < 4 else 1.0 for i in range(40)])
    assert pilot["bound"] == expected.to_dict() and expected.losses == 4 and expected.wins == 1
    assert out["budgets"][0]["items_needed"] is None  # observed drop 7.5% >= the 5% budget: no n suffices
    assert [r["certified_by_pilot"] for r in out["budgets"]] == [False, True]
    assert main(["--records", trial_dir, "--reference", ref_dir, "--budget", "0.05"]) == 0
    text = capsys.readouterr().out
    assert "pilot: 40 paired items (1 only in --records" in text and "exact-unconditional" in text


def test_looks_plan_a_group_sequential_design_that_reaches_the_power(capsys):
    assert main(["--discordance", "0.1", "--budget", "0.1", "--looks", "3", "--json"]) == 0
    seq = json.loads(capsys.readouterr().out)["budgets"][0]["sequential"]
    assert len(seq["looks"]) == 3 and seq["power"] >= 0.8
    assert seq["expected_items"] <= seq["max_items"] and seq["expected_items"] < seq["fixed_items_same_power"]
    assert main(["--discordance", "0.1", "--budget", "0.1", "--looks", "3"]) == 0
    assert "with 3 looks" in capsys.readouterr().out


@pytest.mark.parametrize("args,message", [
    (["--budget", "0.02"], "--discordance"),
    (["--discordance", "0.1", "--budget", "2"], "--budget"),
    (["--discordance", "0.1", "--budget", "x"], "--budget"),
    (["--discordance", "1.5", "--budget", "0.02"], "--discordance"),
    (["--discordance", "0.1", "--drop", "0.3", "--budget", "0.02"], "--drop"),
    (["--discordance", "0.1", "--budget", "0.02", "--alpha", "1"], "--alpha"),
    (["--discordance", "0.1", "--budget", "0.02", "--power", "0"], "--power"),
    (["--records", "somewhere", "--budget", "0.02"], "--reference"),
    (["--discordance", "0.1", "--budget", "0.1", "--looks", "0"], "--looks"),
    (["--discordance", "0.1", "--budget", "0.1", "--pools", "nosuchbench"], "nosuchbench"),
    (["--discordance", "0.1", "--budget", "0.1", "--pools", "gsm8k", "--search-items", "-1"], "--search-items"),
])
def test_bad_input_is_one_line_naming_the_flag(args, message, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err


def test_empty_or_unrelated_record_dirs_are_one_line_errors(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    a = store(tmp_path / "a", {"q1": 1.0})
    b = store(tmp_path / "b", {"q2": 1.0})
    assert main(["--records", str(empty), "--reference", a, "--budget", "0.02"]) == 2
    assert "--records" in capsys.readouterr().err
    assert main(["--records", a, "--reference", b, "--budget", "0.02"]) == 2
    assert "share no item ids" in capsys.readouterr().err


def test_the_plan_is_made_at_the_level_the_next_attempt_of_the_family_gets(tmp_path, capsys):
    from workers.certify.exact import exact_plan

    assert main(["--discordance", "0.05", "--budget", "0.05", "--benchmark", "gsm8k", "--pair-id", "srv",
                 "--ledger", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "attempt #1 of its family" in out and "0.05 x 2^-1 = 0.025" in out
    assert f"{exact_plan(0.05, 0.05, 0.0, 0.025, 0.8)} items needed" in out
    assert main(["--discordance", "0.05", "--budget", "0.05", "--attempt", "5"]) == 0
    assert f"{exact_plan(0.05, 0.05, 0.0, 0.05 / 32, 0.8)} items needed" in capsys.readouterr().out
    assert main(["--discordance", "0.05", "--budget", "0.05", "--benchmark", "gsm8k", "--pair-id", "srv",
                 "--ledger", str(tmp_path), "--attempt", "3"]) == 2
    assert "would open attempt #1 next" in capsys.readouterr().err


def test_pools_say_which_budgets_each_benchmark_can_reach(capsys):
    """Per pool: both splits less the search sample, which budgets its items cover (the plan's), and the smallest
    budget it could certify; 'a+b' pools benchmarks; a plan of thousands of items is the approximation, said so."""
    from workers.benchmarks import get_benchmark

    assert main(["--discordance", "0.3", "--budget", "0.02,0.1", "--pools", "gsm8k,humaneval+math500",
                 "--search-items", "32", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    two, ten = out["budgets"]
    assert two["items_needed"] == items_needed(0.3, 0.02) > 2_000 and two["plan"].startswith("normal approximation,")
    assert ten["items_needed"] == exact_plan(0.3, 0.1) and ten["plan"] == "exact power"

    def size(name):
        bench = get_benchmark(name)
        return len(bench.items(split="search")) - 32 + len(bench.items(split="confirm"))

    gsm, code = out["pools"]
    assert gsm["pool"] == "gsm8k" and gsm["items"] == size("gsm8k")
    assert code["pool"] == "humaneval+math500" and code["items"] == size("humaneval") + size("math500") < 2_000
    assert gsm["reaches"] == {"0.02": True, "0.1": True} and code["reaches"] == {"0.02": False, "0.1": True}
    low = code["smallest_budget"]
    assert 0.02 < low < 0.1 and items_needed(0.3, low) <= code["items"] < items_needed(0.3, low - 0.001)
    assert main(["--discordance", "0.3", "--budget", "0.1", "--pools", "gsm8k"]) == 0
    text = capsys.readouterr().out
    assert "smallest budget" in text and "the limit is data, not compute" in text


def test_the_pools_line_of_the_usage_page_runs_as_written(capsys):
    import shlex
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "usage.md").read_text()
    line = next(ln for ln in page.splitlines() if ln.startswith(".venv/bin/python -m jobs.plan") and "--pools" in ln)
    argv = shlex.split(line.split("#")[0])
    assert argv[:3] == [".venv/bin/python", "-m", "jobs.plan"]
    assert main(argv[3:]) == 0
    text = capsys.readouterr().out
    assert "gsm8k" in text and "humaneval" in text and "smallest budget" in text
