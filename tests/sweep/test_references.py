"""What the sweep's references hand the actors: replay steers the search wherever it runs (the CPU engine at
T = 0), but what a certificate is decided on replays only where replay is full decoding by construction (the
int8 path); elsewhere those items decode in full."""

from __future__ import annotations

from argparse import Namespace

import pytest

from sweep.references import References
from sweep.settings import Settings
from tests.workers.metrics.test_trial import rec


def _refs(dtype: str, replay: str = "auto", engine: str = "cpu", temperature: float = 0.0) -> References:
    args = Namespace(dtype=dtype, replay=replay, engine=engine, pair="tiny-random")
    settings = Settings(args=args, bench=None, budgets=[0.05], families=["lossless"], draft_len=(1, 3), enqueue=[],
                        ranges={}, search_overrides=None,
                        decode={"temperature": temperature, "seed": 0, "shots": 0, "max_new_tokens": 8})
    return References(settings, root=None, workers=[], items=[])


@pytest.mark.parametrize("dtype,search,confirm", [("int8", True, True), ("bf16", True, False), ("fp32", True, False),
                                                   ("bfloat16", True, False)])
def test_confirmation_replays_only_where_replay_is_exact(dtype, search, confirm):
    refs = _refs(dtype)
    assert refs.replays() is search and refs.replays(confirm=True) is confirm
    reference = {"a": rec("a", 1.0, ids=[[5, 6]]), "b": rec("b", float("nan"), error="boom")}
    held = refs.payload(reference, confirm=True)
    assert held["b"] == ["x"], "a failed reference is never replayed from"
    assert isinstance(held["a"], dict) is confirm, "tokens to replay from only where replay is exact"
    assert isinstance(refs.payload(reference)["a"], dict), "the search replays in every dtype"


@pytest.mark.parametrize("kw", [{"replay": "off"}, {"engine": "vllm"}, {"temperature": 0.7}])
def test_nothing_replays_off_the_cpu_engine_at_t0_or_with_replay_off(kw):
    refs = _refs("int8", **kw)
    assert not refs.replays() and not refs.replays(confirm=True)
    assert refs.payload({"a": rec("a", 1.0)}) == {"a": ["x"]}
