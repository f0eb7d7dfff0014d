"""The slim ``spectune-vllm`` wheel (``python -m jobs.plugin_wheel``) is all a vLLM environment needs for spectune's
rules: installed with one ``pip install`` into an environment that sees vLLM's packages but not this checkout, it
serves a stock ``vllm serve`` started by ``python -m jobs.vllm_serve --vllm-python``, and docs/endpoints.md's knob
check finds a lossy rule applied and a lossless one changing nothing. A guard in that environment fails any import
of Ray, MLflow, Optuna, polars (and the like) made by the wheel's own modules, in every process vLLM starts.

The environment: a venv without pip of its own whose site-packages names .vllm-venv's (a plain path line: none of
.vllm-venv's ``.pth`` files run, so the checkout that .vllm-venv installs in editable mode is not on its path).
Runs in .vllm-venv (marker vllm), one server, ~3 minutes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.workers.vllm.test_vllm_serve_cli import Launched, evaluate_knobs_vllm, free_port, launcher_env

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[3]
GUARD_LOG_ENV = "SPECTUNE_SLIM_GUARD_LOG"
# executed at start-up by every Python of the slim environment (a .pth import line): the wheel's own modules may
# import torch, vLLM and the standard library, never the rest of spectune's stack
GUARD = r'''
import os, sys
_HERE = os.path.dirname(os.path.abspath(__file__))
_OURS = tuple(os.path.join(_HERE, p) + os.sep for p in ("policies", "workers"))
_BANNED = frozenset(("ray", "mlflow", "optuna", "polars", "jsonargparse", "datasets", "pandas", "scipy", "sklearn",
                     "matplotlib", "requests", "fastapi"))


class _SlimGuard:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] not in _BANNED:
            return None
        frame = sys._getframe(1)
        while frame is not None and (frame.f_code.co_filename.startswith("<frozen")
                                     or os.sep + "importlib" + os.sep in frame.f_code.co_filename):
            frame = frame.f_back
        if frame is not None and frame.f_code.co_filename.startswith(_OURS):
            line = f"{frame.f_code.co_filename} imports {name}"
            log = os.environ.get("SPECTUNE_SLIM_GUARD_LOG")
            if log:
                with open(log, "a") as fh:
                    fh.write(line + "\n")
            raise ImportError("the slim plugin imported " + line)
        return None


sys.meta_path.insert(0, _SlimGuard())
'''


def slim_environment(tmp_path: Path) -> tuple[Path, Path]:
    """A Python that sees .vllm-venv's packages and the slim wheel, not this checkout; (its python, site-packages)."""
    wheel = subprocess.run([sys.executable, "-m", "jobs.plugin_wheel", "--out", str(tmp_path / "dist")], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
    assert wheel.returncode == 0, wheel.stderr
    install = [line for line in wheel.stdout.splitlines() if line.startswith("pip install ")]
    assert len(install) == 1, wheel.stdout
    env_dir = tmp_path / "slim-env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=120)
    python = env_dir / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "_vllm_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    (site / "_spectune_slim_guard.py").write_text(GUARD)
    (site / "_spectune_slim_guard.pth").write_text("import _spectune_slim_guard\n")
    # the docs' one command, in that environment (its pip is .vllm-venv's, installing into this prefix)
    got = subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "--quiet",
                          install[0].split()[-1]], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr[-3000:]
    return python, site


def test_the_slim_wheel_alone_serves_spectunes_rules_on_a_stock_vllm_serve(tmp_path):
    python, site = slim_environment(tmp_path)
    guard_log = tmp_path / "guard.log"
    env = launcher_env(SPECTUNE_CACHE=str(tmp_path / "cache"), **{GUARD_LOG_ENV: str(guard_log)})
    clean = {k: v for k, v in env.items() if k != "PYTHONPATH"}
    where = subprocess.run([str(python), "-c", "import workers.vllm.plugin as p, policies; "
                            "print(p.__file__); print(policies.__file__)\n"
                            "try:\n import workers.models\nexcept ImportError:\n print('no workers.models')"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=300, env=clean)
    assert where.returncode == 0, where.stderr[-2000:]
    plugin_file, policies_file, models = where.stdout.split("\n")[:3]
    assert plugin_file.startswith(str(site)) and policies_file.startswith(str(site)), where.stdout
    assert models == "no workers.models", "the slim environment must not see the checkout"

    port = free_port()
    server = Launched([sys.executable, "-m", "jobs.vllm_serve", "--vllm-python", str(python), "--pair", "tiny-random",
                       "--per-request", "--port", str(port), "--max-model-len", "2048", "--kv-cache-gb", "1"],
                      tmp_path / "serve.log", env)
    base = f"http://127.0.0.1:{port}"
    try:
        ready = server.wait_ready()
        assert "spectune's plugin active in processes" in ready, ready
        # a lossy rule per request (docs/endpoints.md's knob check): the plugin from the wheel decides
        got = evaluate_knobs_vllm(base, tmp_path / "runs")
        assert got.returncode == 0, (got.stdout[-2000:], got.stderr[-3000:])
        assert "knob check: applied" in got.stdout + got.stderr, (got.stdout[-3000:], got.stderr[-2000:])
        # the plugin's lossless rule as the candidate (carried in the request, --knobs none) against vLLM's own:
        # at T = 0 the same outputs and acceptance whether the server applies it or not, so the check never says
        # "applied": ignored (or cannot tell yet, with what would decide)
        rule = json.dumps({"policy": "lossless", "params": {}, "seed": 0})
        lossless = subprocess.run([sys.executable, "-m", "jobs.evaluate", "--engine", "openai", "--knobs", "none",
                                   "--extra-body", json.dumps({"vllm_xargs": {"spectune_rule": rule}}),
                                   "--base-url", f"{base}/v1", "--model", "spectune", "--benchmark", "gsm8k",
                                   "--limit", "8", "--max-new-tokens", "48", "--concurrency", "1",
                                   "--runs-root", str(tmp_path / "runs-lossless")],
                                  cwd=ROOT, capture_output=True, text=True, timeout=600, env=launcher_env())
        out = lossless.stdout + lossless.stderr
        assert lossless.returncode == 3, (lossless.stdout[-3000:], lossless.stderr[-2000:])
        assert "knob check: applied" not in out and ("knob check: ignored" in out or "knob check: cannot tell yet"
                                                      in out), (lossless.stdout[-3000:], lossless.stderr[-2000:])
    finally:
        server.stop()
    log = server.log.read_text()
    assert "spectune rules plugin active in process" in log
    assert not guard_log.exists(), guard_log.read_text()
