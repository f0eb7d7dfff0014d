"""The plugin's version and signature gates (workers/vllm/gates.py), its TP agreement helpers, and the
memory decision of the engines (main environment: no vLLM needed)."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import pytest
import torch

from workers.vllm import gates
from workers.vllm.common import check_patch_gates


class Runner:
    def sample_tokens(self, grammar_output):
        pass


class NewRunner:
    def sample_tokens(self, grammar_output, extra):  # a release that added a parameter
        pass


def reject(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs, target_logits,
           bonus_token_ids, sampling_metadata, synthetic_mode=None):
    pass


SIGS = {"m.GPUModelRunner.sample_tokens": (("self", "grammar_output"), "exact"),
        "m.rejection_sample": (gates.SIGNATURES["vllm.v1.sample.rejection_sampler.rejection_sample"][0], "prefix"),
        "m.optional": (("self",), "optional")}


def test_matching_signatures_and_a_supported_version_pass():
    symbols = {"m.GPUModelRunner.sample_tokens": Runner.sample_tokens, "m.rejection_sample": reject, "m.optional": None}
    assert gates.check(version="0.32.0+cpu", symbols=symbols, signatures=SIGS) == []
    assert gates.check(version="0.33.1", symbols=symbols, signatures=SIGS) == []


def test_a_changed_signature_is_named_with_expected_and_found():
    symbols = {"m.GPUModelRunner.sample_tokens": NewRunner.sample_tokens, "m.rejection_sample": reject,
               "m.optional": None}
    problems = gates.check(version="0.32.0", symbols=symbols, signatures=SIGS)
    assert problems == ["m.GPUModelRunner.sample_tokens: expected (self, grammar_output), "
                        "found (self, grammar_output, extra)"]
    with pytest.raises(gates.PatchGateError, match="sample_tokens: expected"):
        gates.verify(version="0.32.0", symbols=symbols, signatures=SIGS)


def test_a_missing_symbol_and_a_reordered_prefix_fail():
    def reordered(num_draft_tokens, draft_token_ids, *rest):
        pass

    problems = gates.check(version="0.32.0", symbols={"m.GPUModelRunner.sample_tokens": None,
                                                      "m.rejection_sample": reordered, "m.optional": None},
                           signatures=SIGS)
    assert len(problems) == 2 and "missing" in problems[0] and "rejection_sample: expected" in problems[1]


class State(NamedTuple):
    logits: object
    spec_decode_metadata: object


@dataclasses.dataclass
class Cached:
    num_computed_tokens: int
    sampling_params: object


class Batch:
    def __init__(self):
        self.temperature_cpu = None
        self._req_ids: list[str] = []

    @property
    def req_ids(self):
        return self._req_ids


def test_attributes_are_read_from_fields_properties_and_assignments_and_a_missing_one_is_named():
    attrs = {"m.State": ("logits", "spec_decode_metadata"), "m.Cached": ("num_computed_tokens", "sampling_params"),
             "m.Batch": ("req_ids", "temperature_cpu")}
    symbols = {"m.State": State, "m.Cached": Cached, "m.Batch": Batch}
    assert gates.check(version="0.32.0", symbols=symbols, signatures={}, attributes=attrs) == []
    renamed = {**attrs, "m.State": ("logits", "sample_hidden_states"), "m.Gone": ("x",)}
    assert gates.check(version="0.32.0", symbols={**symbols, "m.Gone": None}, signatures={}, attributes=renamed) == [
        "m.State: has no sample_hidden_states (the plugin reads them)", "m.Gone: missing (the plugin reads its x)"]
    assert "temperature_cpu" in gates.attribute_names(Batch) and "temperature" not in gates.attribute_names(Batch)


def test_a_drafter_that_overrides_the_patched_sampling_is_named():
    """draft_model and eagle3 draft through SpecDecodeBaseProposer._sample_draft_tokens (patched): a proposer
    that defines its own would bypass the rules' drafting, so the gate names it."""
    class Base:
        def _sample_draft_tokens(self, hidden_states, sampling_metadata): ...

    class Eagle(Base):
        pass

    class Own(Base):
        def _sample_draft_tokens(self, hidden_states, sampling_metadata): ...

    wanted = {"m.Eagle": ("_sample_draft_tokens",), "m.Own": ("_sample_draft_tokens",), "m.Gone": ("x",)}
    problems = gates.check(version="0.32.0", symbols={"m.Eagle": Eagle, "m.Own": Own, "m.Gone": None},
                           signatures={}, inherited=wanted)
    assert problems == ["m.Own defines its own _sample_draft_tokens: its drafts would bypass spectune's patch of "
                        "the base proposer's", "m.Gone: missing (spectune's rules draft through it)"]
    assert set(gates.INHERITED) == {"vllm.v1.spec_decode.draft_model.DraftModelProposer",
                                    "vllm.v1.spec_decode.eagle.EagleProposer"}


@pytest.mark.parametrize("version", ["0.31.2", "0.34.0", "1.0.0", "dev"])
def test_an_unsupported_version_is_refused(version):
    problems = gates.check(version=version, symbols={}, signatures={})
    assert len(problems) == 1 and "0.32.x and 0.33.x" in problems[0]


def test_the_engines_raise_what_register_recorded(monkeypatch):
    monkeypatch.setattr(gates, "FAILURES", ["x.y: expected (self), found (self, z)"])
    with pytest.raises(gates.PatchGateError, match=r"x\.y: expected \(self\), found \(self, z\)"):
        check_patch_gates()


def test_the_gate_records_failures_in_the_plugin_process(monkeypatch):

    monkeypatch.setattr(gates, "FAILURES", [])
    monkeypatch.setattr(gates, "check", lambda: ["a.b: expected (self), found ()"])
    assert gates.refuse_unsupported()
    assert gates.FAILURES == ["a.b: expected (self), found ()"]


class FakeGroup:
    """Rank 1 of a TP group whose rank 0 decided ``rank0``."""

    world_size = 2

    def __init__(self, rank0, peer_short: int = 0):
        self.rank0, self.calls, self.peer_short, self.reduces = rank0, 0, peer_short, 0

    def all_reduce(self, tensor):  # the other rank adds whether it was short of memory
        self.reduces += 1
        return tensor + self.peer_short

    def broadcast(self, tensor, src=0):
        assert src == 0 and tensor.is_contiguous()
        self.calls += 1
        tensor.copy_(self.rank0)
        return tensor


def test_ranks_take_rank_zeros_tokens():
    from workers.vllm.heads import agree_across_ranks

    mine = torch.tensor([[5, -1, -1], [7, 8, 9]], dtype=torch.int32)  # this rank fell back alone
    rank0 = torch.tensor([[5, 6, -1], [7, 8, 9]], dtype=torch.int32)
    group = FakeGroup(rank0)
    assert torch.equal(agree_across_ranks(mine, group), rank0) and group.calls == 1
    assert agree_across_ranks(mine, None) is mine  # TP 1: no collective


def test_the_head_is_gathered_once_under_tp_only(monkeypatch):
    from workers.vllm import heads

    gathered = []
    monkeypatch.setattr(heads, "_lm_head", lambda model, vocab, mask, gather: gathered.append((vocab, mask, gather)))
    model = torch.nn.Module()
    model.lm_head = torch.nn.Linear(4, 8, bias=False)
    heads.gather_head_under_tp(model, 16, 0, None)
    assert gathered == []
    heads.gather_head_under_tp(model, 16, 12, FakeGroup(None))
    assert gathered == [(16, 12, True)]
    quantized = torch.nn.Module()
    quantized.lm_head = torch.nn.Module()  # no plain weight: skipped alike on every rank
    heads.gather_head_under_tp(quantized, 16, 0, FakeGroup(None))
    assert gathered == [(16, 12, True)]


def test_the_head_is_gathered_only_for_rules_that_need_it_and_only_when_every_rank_can_hold_it(monkeypatch):
    """Gathered at the first step whose rules build dropout heads (not for a KL judge: +1.09 GB per rank for a
    7B target, for nothing), and only after every rank allocated its room: a rank short of memory would
    otherwise never enter the collective while the others wait in it (a hung engine)."""
    from policies import make_policy
    from workers.vllm import heads

    assert not heads.needs_head([make_policy("kl_judge"), None, make_policy("lossless")])
    assert heads.needs_head([make_policy("kl_judge"), make_policy("dropmatch")])
    gathered = []
    monkeypatch.setattr(heads, "_lm_head", lambda model, vocab, mask, gather: gathered.append(vocab))
    model = _shard_model()
    group = FakeGroup(None, peer_short=1)  # the other rank could not allocate
    heads.gather_head_under_tp(model, 16, 0, group)
    assert gathered == [] and group.reduces == 1, "no rank enters the gather"
    assert "1 rank(s) could not allocate" in model._spectune_lm_head_error
    heads.gather_head_under_tp(model, 16, 0, group)
    assert group.reduces == 1, "recorded: never tried again (DropMatch falls back, counted)"
    fine = FakeGroup(None)
    heads.gather_head_under_tp(_shard_model(), 16, 0, fine)
    assert gathered == [16] and fine.reduces == 1


def test_a_failed_gather_never_raises_and_dropmatch_falls_back_on_every_step(monkeypatch):
    """Under TP the head is gathered outside any rule's guard: a short head (or out of memory) there must not
    stop the engine. It is recorded; later calls raise inside the rule (DropMatch falls back, counted) and
    never try the collective again, and a shard is never gathered lazily inside a rule."""
    import sys
    import types

    from policies import make_policy
    from workers.vllm import heads
    from workers.vllm.step import decide_step

    calls = []

    def short_gather(tensor, dim):
        calls.append(tuple(tensor.shape))
        return tensor  # a rank's shard comes back as it went: fewer rows than the vocabulary

    fake = types.ModuleType("vllm.distributed")
    fake.tensor_model_parallel_all_gather = short_gather
    monkeypatch.setitem(sys.modules, "vllm.distributed", fake)
    model = torch.nn.Module()
    model.lm_head = torch.nn.Linear(4, 8, bias=False)  # a shard: 8 of 16 rows
    heads.gather_head_under_tp(model, 16, 0, FakeGroup(None))  # must not raise
    assert calls == [(8, 4)] and "8 of 16 rows" in model._spectune_lm_head_error
    with pytest.raises(RuntimeError, match="could not be gathered at the first step"):
        heads._lm_head(model, 16)
    assert calls == [(8, 4)], "no second collective, on any rank"
    with pytest.raises(RuntimeError, match="tensor-parallel shard and was not gathered"):
        heads._lm_head(_shard_model(), 16)

    g = torch.Generator().manual_seed(0)
    target = torch.randn(4, 16, generator=g)
    outcome = decide_step(make_policy("dropmatch"), draft_token_ids=target.argmax(-1).int(), num_draft_tokens=[2, 2],
                          max_spec_len=2, target_logits=target, bonus_token_ids=torch.tensor([[1], [2]]),
                          temperatures=[0.0, 0.0], draft_logits=target.clone(), target_hidden=torch.randn(4, 4),
                          lm_head=lambda: heads._lm_head(model, 16))
    assert all(r is not None for r in outcome.fallback), "every request fell back to the lossless rule"
    assert outcome.output_token_ids[:, :2].tolist() == target.argmax(-1).view(2, 2).tolist()


def _shard_model() -> torch.nn.Module:
    model = torch.nn.Module()
    model.lm_head = torch.nn.Linear(4, 8, bias=False)
    return model


def test_a_configured_rule_pins_vllms_v1_runner_and_a_forced_v2_is_refused():
    """vLLM 0.33 runs draft_model speculation on its V2 runner by default, where none of the plugin's patches
    sits: a stock `vllm serve` with a rule file would silently decide with vLLM's own rule. register() pins V1."""
    from workers.vllm.gates import PatchGateError, require_v1_runner
    from workers.vllm.rules import RULE_FILE_ENV

    env: dict[str, str] = {}
    assert require_v1_runner(env) is False and "VLLM_USE_V2_MODEL_RUNNER" not in env, "no rule: vLLM's choice"
    env = {RULE_FILE_ENV: "/tmp/rule.json"}
    assert require_v1_runner(env) is True and env["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    with pytest.raises(PatchGateError, match="VLLM_USE_V2_MODEL_RUNNER=1 with a spectune rule file"):
        require_v1_runner({RULE_FILE_ENV: "/tmp/rule.json", "VLLM_USE_V2_MODEL_RUNNER": "1"})
