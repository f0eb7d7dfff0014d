"""Pieces of the vLLM engines that need no vLLM: memory shares of the two engines on one device, the
per-rank merge of the plugin's ledgers, the exact draft distribution handed to the rules, and the
number of device-to-host syncs one verify step makes. Main environment."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from policies import POLICIES, get_spec, make_policy
from tests.workers.vllm.test_rule_fallback import D, V, step_inputs
from workers.vllm.common import engine_kwargs, memory_shares, merge_rank_ledgers, rule_missing
from workers.vllm.drafts import scaled_as_vllm
from workers.vllm.host_syncs import HostSyncs
from workers.vllm.settings import VLLMSettings
from workers.vllm.step import decide_step

DIRS = (Path("/pair/target"), Path("/pair/draft"))


def test_two_engines_on_one_device_fit_in_the_budget_together():
    s = VLLMSettings(gpu_memory_utilization=0.9)
    spec = engine_kwargs(s, *DIRS, shared=True)["gpu_memory_utilization"]
    ref = engine_kwargs(s, DIRS[0], None, shared=True)["gpu_memory_utilization"]
    assert spec + ref <= 0.9 + 1e-9 and ref < spec, (spec, ref)
    # one at a time (vLLM-CPU, or the reference elsewhere): each may take the whole budget
    assert memory_shares(s, shared=False) == (0.9, 0.9)
    assert memory_shares(VLLMSettings(gpu_memory_utilization=0.9, target_only_memory_utilization=0.3),
                         shared=True) == (0.6, 0.3)
    with pytest.raises(ValueError, match="target_only_memory_utilization 0.88 leaves the speculative engine"):
        memory_shares(VLLMSettings(gpu_memory_utilization=0.9, target_only_memory_utilization=0.88), shared=True)


def test_the_scheduler_budget_reaches_vllm_only_when_set():
    assert "max_num_batched_tokens" not in engine_kwargs(VLLMSettings(), *DIRS)  # vLLM's platform default
    s = VLLMSettings(max_num_batched_tokens=512, max_num_seqs=8)
    for draft in (DIRS[1], None):  # both engines
        kw = engine_kwargs(s, DIRS[0], draft)
        assert (kw["max_num_batched_tokens"], kw["max_num_seqs"]) == (512, 8)
    with pytest.raises(ValueError, match="max_num_batched_tokens must be an integer >= 1"):
        VLLMSettings(max_num_batched_tokens=0)


def test_a_target_only_engine_is_a_yes_or_no():
    assert VLLMSettings().target_only is False and VLLMSettings(target_only=True).target_only is True
    with pytest.raises(ValueError, match="target_only must be true or false, got 'yes'"):
        VLLMSettings(target_only="yes")


def test_a_rank_that_did_not_run_the_rule_fails_the_request_check():
    entry = {"steps": 3, "lossless_fallback_steps": 1, "rules": {"abc": 3}}
    both, totals = merge_rank_ledgers([{"requests": {"7-x": entry}}, {"requests": {"7-x": entry}, "totals": {"n": 1}}])
    assert both["7-x"]["rules"] == {"abc"} and both["7-x"]["ranks_without"] == [] and totals == {"n": 1}
    one, _ = merge_rank_ledgers([{"requests": {"7-x": entry}}, {"requests": {}}])
    assert one["7-x"]["rules"] == set() and one["7-x"]["ranks_without"] == [1]
    assert one["7-x"]["steps"] == 3 and one["7-x"]["lossless_fallback_steps"] == 1
    assert "in TP rank(s) [1]" in str(rule_missing("request 0", 5, "lossless", one["7-x"]))


@pytest.mark.parametrize("temperature", [0.7, 0.3, 1.3])
def test_the_rules_see_exactly_the_distribution_vllm_drew_the_draft_from(temperature):
    """vLLM draws draft tokens from softmax(bf16 logits / T) (the division in place, in bf16; greedy rows by 1).
    The plugin hands the rules the same division, made on a copy, in bf16 (half a float32 distribution's
    bytes), and they take q = softmax of it: vLLM's distribution to fp32 rounding, where a recomputation
    from the logits in fp32 is off by bf16's rounding of the division."""
    from policies import VerifyBatch

    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(6, 4000, generator=g) * 4).to(torch.bfloat16)
    temps = torch.full((6,), temperature)
    temps[5] = 0.0  # a greedy row in a sampling batch

    def vllm_draw(x):  # vLLM's compute_probs_and_sample_next_token, its division and softmax
        t = torch.where(temps < 1e-5, 1.0, temps)
        return x.div_(t.view(-1, 1)).softmax(dim=-1, dtype=torch.float32)

    scaled = scaled_as_vllm(logits, temps)
    vllm_probs = vllm_draw(logits.clone())
    assert scaled.dtype == torch.bfloat16, "kept in the draft's dtype"
    ids = torch.zeros(1, 5, dtype=torch.long)
    batch = VerifyBatch(draft_token_ids=ids, draft_logits=scaled[:5].unsqueeze(0), draft_scaled=True,
                        target_logits=torch.zeros(1, 6, 4000), temperature=temperature)
    rule_q = torch.softmax(batch.draft_at(temperature), dim=-1)[0]  # what the lossless rule and emission use
    assert (rule_q - vllm_probs[:5]).abs().max() < 1e-6
    assert torch.allclose(batch.draft_lse(temperature)[0], torch.logsumexp(scaled[:5].float(), -1))
    recomputed = torch.softmax(logits[:5].float() / temperature, dim=-1)
    assert (recomputed - vllm_probs[:5]).abs().max() > 1e-4, "bf16's division should differ from fp32's here"
    assert torch.equal(scaled[5], logits[5]), "vLLM's greedy rows in a mixed batch are divided by 1"
    assert torch.allclose(batch.draft_f32[0], scaled[:5].float() * temperature), "the T = 1 view"


def test_host_syncs_are_counted():
    t = torch.arange(6.0)
    with HostSyncs() as s:
        int(t.sum())
        t[t > 2].sum()
        t.tolist()
        torch.nonzero(t)
    assert s.by_kind == {"item": 1, "bool_index": 1, "tolist": 1, "nonzero": 1}, s.by_kind


@pytest.mark.parametrize("per_request", [False, True], ids=["one-rule", "per-request-seeds"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("rule", sorted(POLICIES))
def test_a_verify_step_makes_no_host_sync_and_one_rule_call_per_group(rule, temperature, per_request):
    """decide_step never waits on the device: no finiteness guard read back, no residual check, no
    multinomial (sampling is an inverse CDF at a uniform per row). Requests that carry their own rule and
    seed (vLLM per-request rules) are still decided in ONE call per (rule, temperature) group, each row
    drawing from its own counter-based stream. The draft counts come from vLLM as a host list."""
    b = 64
    inputs, draft, g = step_inputs([5] * b)
    hidden = torch.randn(5 * b, D, generator=g)
    head = (torch.randn(V, D, generator=g), None)
    policy = make_policy(rule, **get_spec(rule).example)
    calls = []
    own = dict(policies=[policy] * b, keys=["r"] * b, request_seeds=list(range(b))) if per_request else {}
    kwargs = dict(**inputs, temperatures=[temperature] * b, draft_logits=draft, target_hidden=hidden,
                  lm_head=lambda: head, trace=lambda *a: calls.append(a), **own)
    with HostSyncs() as one_group:
        out = decide_step(policy, **kwargs)
    assert out.fallback == [None] * b
    assert one_group.total == 0, dict(one_group.by_kind)
    assert len(calls) == 1, "one rule call for the group, not one per request"
    kwargs["temperatures"] = [temperature, 2 * temperature] * (b // 2)  # two groups: two calls, no sync
    calls.clear()
    with HostSyncs() as two_groups:
        decide_step(policy, **kwargs)
    assert two_groups.total == 0 and len(calls) == (2 if temperature else 1), dict(two_groups.by_kind)


def test_step_temperatures_come_from_vllms_host_copy_without_a_device_read():
    """The plugin takes each request's temperature from vLLM's host copy (InputBatch.temperature_cpu, read in
    sample_tokens), not from the device tensor: no step waits on a device-to-host read for it."""
    from types import SimpleNamespace

    from workers.vllm import plugin

    meta = SimpleNamespace(all_greedy=False, temperature=torch.tensor([0.7, 0.0, 1.3]))
    plugin.STEP.temps_cpu = [0.7, 0.0, 1.3]
    try:
        with HostSyncs() as syncs:
            temps = plugin.step_temperatures(meta, 3)
        assert syncs.total == 0 and temps == [0.7, 0.0, 1.3]
    finally:
        plugin.STEP.temps_cpu = None
    with HostSyncs() as syncs:  # no host copy (another runner): the device tensor, one read
        assert plugin.step_temperatures(meta, 3) == pytest.approx([0.7, 0.0, 1.3])
    assert syncs.total == 1
    assert plugin.step_temperatures(SimpleNamespace(all_greedy=True, temperature=None), 2) == [0.0, 0.0]


@pytest.mark.parametrize("rule,needs", [(("lossless", {}), False), (("top_k", {"k": 4}), False),
                                        (("dropmatch", {"criterion": "naive"}), False), (("typical", {}), False),
                                        (("kl_judge", {"threshold": 0.5}), True),
                                        (("dropmatch", {"criterion": "js"}), True), (("draft_entropy", {}), True)])
def test_which_rules_read_the_draft_distribution_at_t0(rule, needs):
    """Greedy steps whose rules never read q let vLLM draft on its own (no full-vocabulary log-softmax and
    cached distribution per draft token); the probe decides which rules those are."""
    from workers.vllm.step import needs_draft_distribution

    assert needs_draft_distribution(make_policy(rule[0], **rule[1])) is needs


# -- a draft narrower than the target: validated before vLLM starts, named to both engines, padded --------

def test_a_narrower_draft_is_named_in_the_target_config_of_both_engines():
    from workers.vllm.settings import PAD_ATTR

    for draft in (DIRS[1], None):  # the reference masks the target's logits the same way
        assert engine_kwargs(VLLMSettings(), DIRS[0], draft, draft_width=288)["hf_overrides"] == {PAD_ATTR: 288}
        assert "hf_overrides" not in engine_kwargs(VLLMSettings(), DIRS[0], draft)


def test_pair_dirs_are_checked_before_vllm_starts(tmp_path):
    import json
    import shutil

    from workers.models.tiny import save_tiny_pair
    from workers.vllm.settings import check_pair_dirs

    same = save_tiny_pair(tmp_path / "same", head_dim=64)
    assert check_pair_dirs(*same) == 0
    narrow, wide = save_tiny_pair(tmp_path / "pad", head_dim=64, draft_vocab=288)
    assert check_pair_dirs(narrow, wide) == 288
    assert check_pair_dirs(narrow, wide, tensor_parallel_size=2) == 288  # 2 heads split, 1 KV head replicated
    with pytest.raises(ValueError, match="scores 320 ids but target .* only 288: .*no wider than the target"):
        check_pair_dirs(wide, narrow)
    with pytest.raises(ValueError, match="2 attention heads, not divisible by tensor_parallel_size 4"):
        check_pair_dirs(narrow, wide, tensor_parallel_size=4)
    # a draft whose tokenizer maps an id to another token: vLLM would run it with the target's tokenizer
    other = tmp_path / "other-draft"
    shutil.copytree(narrow, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    for added in tok["added_tokens"]:
        if added["content"] == "<|im_end|>":
            added["content"] = "<|end|>"
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match="do not share a tokenizer vocabulary"):
        check_pair_dirs(other, wide)


def test_padded_draft_logits_give_the_missing_ids_probability_zero():
    from types import SimpleNamespace

    from workers.vllm.plugin import mask_from, pad_logits, padded_draft_width
    from workers.vllm.settings import PAD_ATTR

    logits = torch.randn(3, 5)
    padded = pad_logits(logits, 8)
    assert padded.shape == (3, 8) and torch.equal(padded[:, :5], logits) and torch.isneginf(padded[:, 5:]).all()
    assert (torch.softmax(padded, -1)[:, 5:] == 0).all() and int(padded.argmax(-1).max()) < 5
    assert pad_logits(None, 8) is None and pad_logits(logits, 5) is logits

    def config(vocab, **attrs):
        return SimpleNamespace(hf_config=SimpleNamespace(**attrs), get_vocab_size=lambda: vocab)

    spec = SimpleNamespace(method="draft_model", target_model_config=config(320, **{PAD_ATTR: 288}),
                           draft_model_config=config(288))
    assert padded_draft_width(spec) == 288 and mask_from(spec.target_model_config) == 288
    # only what spectune's engine asked for: vLLM's own check applies to any other pair
    assert padded_draft_width(SimpleNamespace(**{**vars(spec), "target_model_config": config(320)})) == 0
    assert padded_draft_width(SimpleNamespace(**{**vars(spec), "draft_model_config": config(256)})) == 0
    assert padded_draft_width(SimpleNamespace(**{**vars(spec), "method": "eagle"})) == 0
    assert mask_from(config(320)) == 0 and mask_from(config(288, **{PAD_ATTR: 288})) == 0


OWNER = """
import multiprocessing as mp, os, signal, subprocess, sys, time
from workers.vllm import orphans

orphans.GRACE_S, orphans.PERIOD_S = 1.0, 0.2
assert not orphans.watch_parent(), "no owner named yet: nothing to watch"
orphans.arm()
assert not orphans.watch_parent(), "the owner never watches its own parent"

def stuck():  # a TP worker stuck in a step: SIGTERM does nothing, only the hard exit ends it
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(3600)

def core(q):  # the engine core, forked (vLLM's default on GPUs): forks a worker of its own
    w = mp.get_context("fork").Process(target=stuck)
    w.start()
    q.put(w.pid)
    time.sleep(3600)

q = mp.get_context("fork").Queue()
c = mp.get_context("fork").Process(target=core, args=(q,))
c.start()
worker = q.get(timeout=30)
spawned = subprocess.Popen([sys.executable, "-c", "import time; from workers.vllm.orphans import watch_parent; "
                            "assert watch_parent(0.2, 1.0); print('x', flush=True); time.sleep(3600)"],
                           stdout=subprocess.PIPE, text=True)
spawned.stdout.readline()  # a spawned child: the plugin's register() starts its watch
print(c.pid, worker, spawned.pid, flush=True)
time.sleep(3600)
"""


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_processes_started_for_an_engine_leave_with_their_owner(sig):
    """workers.vllm.orphans without vLLM: the owner's forked child (an engine core), that child's own forked
    child ignoring SIGTERM (a worker stuck in a step), and a spawned child all exit once the owner is gone,
    stopped or killed (the vLLM test in test_engine_start.py covers vLLM-CPU, which always spawns)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from workers.vllm.common import process_alive

    root = Path(__file__).resolve().parents[3]
    env = {k: v for k, v in os.environ.items() if k != "SPECTUNE_VLLM_OWNER_PID"}
    owner = subprocess.Popen([sys.executable, "-c", OWNER], cwd=root, env=env, stdout=subprocess.PIPE, text=True)
    kids: list[int] = []
    try:
        assert owner.stdout is not None
        kids = [int(x) for x in owner.stdout.readline().split()]
        assert len(kids) == 3 and all(process_alive(p) for p in kids), kids
        owner.send_signal(getattr(signal, sig))
        owner.wait(timeout=30)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(process_alive(p) for p in kids):
            time.sleep(0.2)
        assert [p for p in kids if process_alive(p)] == []
    finally:
        for pid in [owner.pid, *kids]:
            if process_alive(pid):
                os.kill(pid, signal.SIGKILL)
        owner.wait(timeout=30)


@pytest.mark.parametrize("knob, value", [("top_p", 0.9), ("top_k", 20), ("min_p", 0.05)])
def test_sampling_constraints_a_rule_would_ignore_are_refused_at_admission(knob, value):
    """While a spectune rule verifies, vLLM's apply_sampling_constraints is an identity: top-p/top-k/min-p
    would shape the bonus token only. Both vLLM engines refuse them before anything reaches vLLM, naming
    the parameter; their "off" values pass."""
    import asyncio

    from workers.vllm.async_engine import AsyncVLLMDecoder
    from workers.vllm.common import refuse_sampling_constraints
    from workers.vllm.engine import VLLMDecoder

    refuse_sampling_constraints(1.0, None, 0.0)
    refuse_sampling_constraints(1.0, -1, 0.0)
    refuse_sampling_constraints(top_k=0)
    with pytest.raises(ValueError, match=rf"^{knob}={value}: spectune's rules"):
        refuse_sampling_constraints(**{knob: value})
    sync = object.__new__(VLLMDecoder)  # no engine: the refusal comes first
    with pytest.raises(ValueError, match=rf"^{knob}={value}"):
        sync.generate([1, 2, 3], "top_k", **{knob: value})
    with pytest.raises(ValueError, match=rf"^{knob}={value}"):
        sync.generate_batch([[1, 2, 3]], "lossless", **{knob: value})
    served = object.__new__(AsyncVLLMDecoder)
    with pytest.raises(ValueError, match=rf"^{knob}={value}"):
        asyncio.run(served.generate([1, 2, 3], "lossless", **{knob: value}))


def test_reap_workers_kills_what_outlives_the_grace():
    """The decoder's backstop for a dead engine's workers (their parent watch normally makes them leave)."""
    import subprocess
    import sys

    from workers.vllm.common import process_alive, reap_workers

    stuck = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                              "signal.SIG_IGN); print('up', flush=True); time.sleep(60)"], stdout=subprocess.PIPE)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        assert stuck.stdout is not None and stuck.stdout.readline()
        gone.wait(timeout=30)
        assert reap_workers([stuck.pid, gone.pid], grace_s=0.5) == [stuck.pid]
        stuck.wait(timeout=10)
        assert not process_alive(stuck.pid)
    finally:
        if stuck.poll() is None:
            stuck.kill()
        stuck.wait(timeout=10)


def test_draft_logits_not_over_the_targets_ids_are_refused_not_read():
    """The rules read q over the target's ids (an EAGLE-3 head's reduced vocabulary is mapped onto them by vLLM,
    a narrower draft model's padded): logits of another width raise, so the plugin treats that propose as a
    failed one (its drafts judged by no rule) instead of reading the wrong ids."""
    from types import SimpleNamespace

    from workers.vllm.drafts import drafts_for_rules

    config = SimpleNamespace(model_config=SimpleNamespace(get_vocab_size=lambda: 32))
    proposer = SimpleNamespace(vllm_config=config, _enable_probabilistic_draft_probs=False)
    step = SimpleNamespace(greedy_drafts=False, draft_scaled=False)
    greedy = SimpleNamespace(all_greedy=True)
    tokens, q = drafts_for_rules(proposer, torch.randn(3, 32), greedy, step)
    assert tokens.shape == (3,) and q.shape == (3, 32) and step.draft_scaled
    with pytest.raises(ValueError, match="logits are 24 wide, the target scores 32 ids"):
        drafts_for_rules(proposer, torch.randn(3, 24), greedy, step)
