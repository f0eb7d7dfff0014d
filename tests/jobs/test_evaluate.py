"""The evaluate job end to end on the tiny pair: every benchmark, references cached, resume."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from jobs import evaluate
from workers.evaluation import DecodeSpec
from workers.results.store import RecordStore


def run(tmp_path, *extra: str) -> int:
    return evaluate.main(["--pair", "tiny-random", "--dtype", "fp32", "--runs-root", str(tmp_path),
                          "--cost-ratio", "0.4", *extra])


def summaries(tmp_path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((tmp_path / "eval" / "summaries").glob("*.json"))]


TASK = str(Path(__file__).resolve().parents[2] / "examples" / "gsm8k" / "task.yaml")


@pytest.mark.parametrize("benchmark", ["gsm8k", "mmlu", "humaneval", "ifeval", "mtbench", TASK])
def test_tiny_pair_end_to_end_per_benchmark(tmp_path, benchmark, capsys):
    rc = run(tmp_path, "--benchmark", benchmark, "--policy", "kl_judge", "--param", "threshold=1.0",
             "--draft-len", "3", "--limit", "2", "--max-new-tokens", "12")
    assert rc == 0
    out = capsys.readouterr().out
    assert "accuracy" in out and "speedup vs target-only" in out and "noise floor" in out
    metrics = summaries(tmp_path)[0]["metrics"]
    assert metrics["items"] == 2 and metrics["failures"] == 0
    assert 0.0 <= metrics["accuracy"] <= 1.0
    assert metrics["mean_acceptance_length"] >= 1.0
    parquet = list(tmp_path.glob("eval/*/*/records.parquet"))
    assert len(parquet) == 1, "the rule's per-item records are written as parquet"


def test_a_bad_task_file_is_one_line(tmp_path, capsys):
    (tmp_path / "t.yaml").write_text("name: x\ndata: none.jsonl\nprompt: '{q}'\nreference: a\nscorer: exact\n")
    assert run(tmp_path, "--benchmark", str(tmp_path / "t.yaml"), "--limit", "1") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: task file") and "data:" in err and "\n" not in err


def test_references_are_cached_and_reused(tmp_path, capsys):
    args = ("--benchmark", "gsm8k", "--limit", "3", "--max-new-tokens", "8", "--draft-len", "2")
    assert run(tmp_path, *args, "--policy", "top_k", "--param", "k=4") == 0
    capsys.readouterr()
    assert run(tmp_path, *args, "--policy", "typical") == 0
    err = capsys.readouterr().err
    assert "target-only: 3 items cached" in err and "lossless L=2: 3 items cached" in err


def test_rerun_after_interruption_loses_nothing_and_redoes_nothing(tmp_path, capsys):
    args = ("--benchmark", "gsm8k", "--limit", "4", "--max-new-tokens", "8", "--policy", "dropmatch",
            "--param", "criterion=naive", "--draft-len", "3", "--no-lossless-ref")
    assert run(tmp_path, *args) == 0
    store = RecordStore(next(tmp_path.glob("eval/*/*/records.jsonl")).parent)
    before = store.load()
    # Simulate a crash: drop the last two records and tear the last remaining line.
    lines = store.jsonl.read_text().splitlines(keepends=True)
    store.jsonl.write_text("".join(lines[:2]) + lines[2][:40])
    capsys.readouterr()
    assert run(tmp_path, *args) == 0
    err = capsys.readouterr().err
    assert "[2/2]" in err and "[3/" not in err.split("dropmatch")[-1], "only the two lost items are redone"
    after = store.load()
    assert set(after) == set(before)
    for key in before:
        assert after[key].output_token_ids == before[key].output_token_ids, "deterministic redo"


def test_target_only_and_lossless_policies(tmp_path):
    base = ("--benchmark", "mmlu", "--limit", "2", "--max-new-tokens", "6")
    assert run(tmp_path, *base, "--policy", "target-only", "--no-lossless-ref") == 0
    assert run(tmp_path, *base, "--policy", "lossless", "--draft-len", "4") == 0
    lossless = [s for s in summaries(tmp_path) if s["args"]["policy"] == "lossless"][0]["metrics"]
    assert lossless["accuracy_drop"] == 0.0, "fp32 lossless greedy reproduces target-only on the tiny pair"
    assert lossless["output_divergence_vs_ar"] == 0.0


@pytest.mark.parametrize("bad, message", [
    (["--policy", "kl_jduge"], "unknown policy"),
    (["--policy", "kl_judge", "--param", "treshold=1"], "unknown parameter"),
    (["--policy", "kl_judge", "--param", "threshold=-1"], "threshold"),
    (["--policy", "kl_judge", "--param", "threshold"], "NAME=VALUE"),
    (["--benchmark", "gsm9k"], "unknown benchmark"),
    (["--draft-len", "0"], "draft_len"),
    (["--shard", "3/2"], "--shard"),
    (["--limit", "0"], "--limit"),
    (["--sampler", "gumbel", "--temperature", "0.7"], "--sampler must be one of standard, coupled"),
    (["--sampler", "coupled"], "--temperature 0"),
    (["--top-p", "1.5", "--temperature", "0.7"], "--top-p"),
])
def test_bad_input_is_one_clear_error(tmp_path, capsys, bad, message):
    args = ["--benchmark", "gsm8k", "--limit", "1", "--max-new-tokens", "4"]
    for i in range(0, len(bad), 2):
        if bad[i] in args:
            j = args.index(bad[i])
            args[j + 1] = bad[i + 1]
        else:
            args += bad[i : i + 2]
    assert run(tmp_path, *args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_decode_spec_keys_separate_settings():
    a = DecodeSpec.make("kl_judge", {"threshold": 0.5}, 5, temperature=0.0, seed=0, max_new_tokens=8, shots=0)
    b = DecodeSpec.make("kl_judge", {"threshold": 0.5}, 5, temperature=0.0, seed=0, max_new_tokens=9, shots=0)
    c = DecodeSpec.make("kl_judge", {"threshold": 0.5}, 5, temperature=0.0, seed=0, max_new_tokens=8, shots=0)
    assert a.key() != b.key() and a.key() == c.key()
    assert not math.isnan(float(a.draft_len))


def test_the_vllm_engine_reruns_itself_where_vllm_imports(tmp_path):
    """``--engine vllm`` from the main environment (no vllm here): the command reruns itself in the interpreter that
    has it (the checkout's .vllm-venv), which then answers; without one, a line that names the fix."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    got = subprocess.run([sys.executable, "-m", "jobs.evaluate", "--engine", "vllm", "--pair", "tiny-random",
                          "--benchmark", "gsm8k", "--runs-root", str(tmp_path)],
                         cwd=root, capture_output=True, text=True, timeout=600)
    assert got.returncode == 2, got.stderr[-2000:]
    if (root / ".vllm-venv" / "bin" / "python").is_file():
        assert f"--engine vllm: rerunning in {root / '.vllm-venv' / 'bin' / 'python'}" in got.stderr
        assert got.stderr.strip().splitlines()[-1] == ("error: --engine vllm needs --cost-ratio: vLLM does not time "
                                                       "draft and target steps apart (python -m workers.calibrate "
                                                       "--engine vllm --pair ...)")
    else:
        assert got.stderr.strip().splitlines()[-1].startswith("error: the vLLM engine needs vllm: `make vllm-env`")
    bad = subprocess.run([sys.executable, "-m", "jobs.evaluate", "--engine", "vllm", "--vllm-python", "/nonexistent",
                          "--benchmark", "gsm8k"], cwd=root, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip() == "error: --vllm-python /nonexistent: not an executable file"


def test_the_coupled_sampler_makes_lossless_output_target_only_output_at_t_above_0(tmp_path, capsys, monkeypatch):
    """docs/usage.md's --sampler coupled command, run as written (runs root in a scratch folder), at T 0.8 with
    top-k/top-p: the noise floor (lossless against target-only) reads 0 differing outputs, where the standard
    sampler's two independent samples differ; the spec keys keep the coupled and the standard runs apart."""
    import shlex

    page = (Path(__file__).resolve().parents[2] / "docs" / "usage.md").read_text()
    line = next(ln for ln in page.splitlines() if ln.startswith(".venv/bin/python -m jobs.evaluate")
                and "--sampler coupled" in ln)
    argv = shlex.split(line)
    assert argv[:3] == [".venv/bin/python", "-m", "jobs.evaluate"]
    monkeypatch.setenv("SPECTUNE_RUNS", str(tmp_path))
    assert evaluate.main(argv[3:]) == 0
    out = capsys.readouterr().out
    assert "noise floor (lossless vs target-only, 4 items): outputs differ on 0.0%" in out, out
    assert "coupled sampler: every arm drew token t with the same noise" in out
    standard = argv[3:-2]
    assert argv[-2:] == ["--sampler", "coupled"]
    assert evaluate.main(standard) == 0
    out = capsys.readouterr().out
    assert "noise floor (lossless vs target-only, 4 items): outputs differ on 0.0%" not in out, out
    assert sorted(s["args"]["sampler"] for s in summaries(tmp_path)) == ["coupled", "standard"], "two summaries"
    plain = DecodeSpec.make("kl_judge", {}, 3, temperature=0.8)
    assert DecodeSpec.make("kl_judge", {}, 3, temperature=0.8, sampler="coupled").key() != plain.key()
    assert DecodeSpec.make("kl_judge", {}, 3, temperature=0.8, sampler="standard").key() == plain.key()
