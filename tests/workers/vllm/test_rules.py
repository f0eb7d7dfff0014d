"""The rule file's rule under tensor parallelism: read by rank 0 alone and shared with every rank
(workers.vllm.rules._RuleState.shared). Two ranks simulated in one process with a group whose broadcast
hands rank 0's object to the others, as vLLM's ``GroupCoordinator.broadcast_object`` does. Main env."""

from __future__ import annotations

import os
from typing import Any

import pytest

from workers.vllm.rules import RULE_FILE_ENV, _RuleState, write_rule


class _Group:
    """One rank's view of a TP group of two: rank 0's broadcast leaves its object in a shared mailbox,
    the other rank's broadcast takes it from there."""

    def __init__(self, rank: int, mailbox: list[Any], fail: bool = False) -> None:
        self.rank_in_group, self.world_size, self.mailbox, self.fail = rank, 2, mailbox, fail

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        assert src == 0
        if self.fail:
            raise RuntimeError("gloo: connection reset")
        if self.rank_in_group == 0:
            self.mailbox.append(obj)
            return obj
        return self.mailbox.pop(0)


@pytest.fixture
def rule_file(tmp_path, monkeypatch):
    path = tmp_path / "rule.json"
    write_rule(path, "kl_judge", {"threshold": 0.5})
    monkeypatch.setenv(RULE_FILE_ENV, str(path))
    return path


def test_rank_0_reads_the_rule_file_and_every_rank_decides_by_its_rule(rule_file):
    mailbox: list[Any] = []
    rank0, rank1 = _RuleState(), _RuleState()
    first = rank0.shared(_Group(0, mailbox))
    # the file is rewritten between the two ranks' steps: rank 1 still takes the rule rank 0 read
    write_rule(rule_file, "top_k", {"k": 3})
    os.utime(rule_file, ns=(1, 1))  # a stamp of its own, whatever the clock's resolution
    second = rank1.shared(_Group(1, mailbox))
    assert first.spec == second.spec and first.digest == second.digest and first.policy.name == "kl_judge"
    assert (rank0.file_reads, rank1.file_reads) == (1, 0)
    # the next step: rank 0 reads the new rule, rank 1 takes it too; a step with no change builds nothing
    a, b = rank0.shared(_Group(0, mailbox)), rank1.shared(_Group(1, mailbox))
    assert a.policy.name == b.policy.name == "top_k" and a.digest == b.digest
    rank0.shared(_Group(0, mailbox))
    again = rank1.shared(_Group(1, mailbox))
    assert again is b and (rank0.file_reads, rank1.file_reads) == (2, 0)


def test_no_rule_file_on_rank_0_means_no_rule_on_any_rank(monkeypatch):
    monkeypatch.delenv(RULE_FILE_ENV, raising=False)
    mailbox: list[Any] = []
    assert _RuleState().shared(_Group(0, mailbox)) is None and mailbox == [None]
    assert _RuleState().shared(_Group(1, mailbox)) is None


def test_without_tp_or_when_the_broadcast_fails_each_rank_reads_the_file(rule_file, caplog):
    solo = _RuleState()
    assert solo.shared(None).policy.name == "kl_judge" and solo.file_reads == 1
    rank1 = _RuleState()
    active = rank1.shared(_Group(1, [], fail=True))  # never raises inside a worker
    assert active.policy.name == "kl_judge" and rank1.file_reads == 1
    assert any("could not be shared across tensor-parallel ranks" in r.getMessage() for r in caplog.records)


def test_top_p_top_k_rows_are_flagged_and_counted_per_request():
    from types import SimpleNamespace

    import torch

    from workers.vllm.step import _Ledger, constrained_rows

    assert constrained_rows(SimpleNamespace(top_p=None, top_k=None), 3, 100) is None, "no request asks: no read"
    meta = SimpleNamespace(top_p=torch.tensor([1.0, 0.8, 1.0, 1.0]), top_k=torch.tensor([100, 100, 20, 100]))
    flags = constrained_rows(meta, 4, 100)
    assert flags == [False, True, True, False], "top-k at the vocabulary size is vLLM's 'off'"
    ledger = _Ledger()
    ledger.record(["a", "b", "c", "d"], [2, 2, 2, 0], [None] * 4, None, flags)
    got = ledger.take()
    assert "top_p_top_k_steps" not in got["requests"]["a"] and got["requests"]["b"]["top_p_top_k_steps"] == 1
    assert got["totals"]["top_p_top_k_steps"] == 2, "d drafted nothing this step: not a verify of it"
