"""``python -m workers.calibrate --engine vllm`` for real on vLLM-CPU with the tiny pair (head_dim 64):
both models decode through vLLM, the profile lands at ``--out`` (and with the pair without it), and
``--print-ratio`` reads back the figure a GPU RayJob hands the sweep. Runs in .vllm-venv (`make test`'s
vLLM run); the flow without vLLM: tests/workers/models/test_calibrate.py."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("vllm", reason="runs in .vllm-venv (make test's vLLM run), where vllm imports")

from workers import calibrate  # noqa: E402
from workers.models import calibrate as stored  # noqa: E402
from workers.models.pair import pair_dirs  # noqa: E402
from workers.models.tiny import save_tiny_pair  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_calibrate_through_vllm_cpu_stores_a_ratio_the_sweep_can_read(tmp_path, capsys):
    draft, target = save_tiny_pair(tmp_path / "tiny", head_dim=64)
    pair, cache, out = f"{draft}+{target}", tmp_path / "cache", tmp_path / "runs" / "calibration" / "c.json"
    argv = ["--engine", "vllm", "--pair", pair, "--cache-dir", str(cache), "--dtype", "fp32", "--batch", "2",
            "--context", "24", "--new-tokens", "16", "--reps", "2", "--max-model-len", "256",
            "--kv-cache-gb", "0.125", "--enforce-eager", "--out", str(out)]
    code = calibrate.main(argv)
    captured = capsys.readouterr()
    printed = captured.out
    assert code == 0, (printed[-3000:], captured.err[-3000:])
    for line in ("target: engine started", "target: run 2/2", "draft: engine started", "draft: run 2/2", "-> c = "):
        assert line in printed, printed  # progress, model by model
    profile = json.loads(out.read_text())
    c = profile["cost_ratio"]
    why = (profile, printed[-3000:])  # every check below shows the profile and the progress when it fails
    assert math.isfinite(c) and 0 < c < 20 and profile["engine"] == "vllm" and profile["dtype"] == "fp32", why
    assert c == pytest.approx(profile["draft_step_s"] / profile["target_step_s"]), why
    assert profile["machine"] == stored.machine_key(), why  # vLLM-CPU: no CUDA device
    assert len(profile["vllm"]["step_s"]["target"]) == len(profile["vllm"]["step_s"]["draft"]) == 2, why
    assert profile["vllm"]["settings"] == {"max_model_len": 256, "enforce_eager": True,
                                           "kv_cache_memory_bytes": 128 << 20}, why
    assert profile["vllm"]["pair_cache"] == str(pair_dirs(pair, cache)[2]), why
    assert not stored.vllm_profile_path(profile["vllm"]["pair_cache"], "fp32", profile["machine"]).exists()
    assert calibrate.main(["--print-ratio", str(out)]) == 0
    assert float(capsys.readouterr().out) == pytest.approx(c, abs=5e-5)
