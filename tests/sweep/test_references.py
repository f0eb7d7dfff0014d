"""What the sweep's references hand the actors: replay steers the search wherever it runs (the CPU engine at
T = 0), but what a certificate is decided on replays only where replay is full decoding by construction (the
int8 path); elsewhere those items decode in full."""

from __future__ import annotations

from argparse import Namespace

import pytest

from sweep.references import References
from sweep.settings import Settings
from tests.workers.metrics.test_trial import rec
from workers.replay import REPLAY_VERSION


def _refs(dtype: str, replay: str = "auto", engine: str = "cpu", temperature: float = 0.0,
          cpus_per_actor: float = 1) -> References:
    args = Namespace(dtype=dtype, replay=replay, engine=engine, pair="tiny-random", cpus_per_actor=cpus_per_actor)
    settings = Settings(args=args, bench=None, budgets=[0.05], families=["lossless"], draft_len=(1, 3), enqueue=[],
                        ranges={}, search_overrides=None,
                        decode={"temperature": temperature, "seed": 0, "shots": 0, "max_new_tokens": 8})
    return References(settings, root=None, workers=[], items=[])


@pytest.mark.parametrize("dtype,search,confirm", [("int8", True, True), ("int4+int8", True, True), ("bf16", True, False), ("fp32", True, False),
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


def test_a_rule_whose_own_gemm_is_not_row_exact_is_decoded_in_full_in_confirmation():
    """DropMatch's exact mode runs its K full-vocabulary heads as one GEMM over the block's rows: a live round's few
    or the pass's hundreds. Confirmation decodes it in full (an any_of holding it too); the search still replays it."""
    from workers.evaluation import DecodeSpec

    refs = _refs("int4+int8")
    reference = {"a": rec("a", 1.0, ids=[[5, 6]])}
    exact = DecodeSpec.make("dropmatch", {"mode": "exact", "k": 3, "p_drop": 0.2}, 3, max_new_tokens=8)
    inside = DecodeSpec.make("any_of", {"members": [["top_k", {"k": 2}], ["dropmatch", {"mode": "exact"}]]}, 3,
                             max_new_tokens=8)
    candidate = DecodeSpec.make("dropmatch", {"k": 3}, 3, max_new_tokens=8)
    no_dropout = DecodeSpec.make("dropmatch", {"mode": "exact", "p_drop": 0.0}, 3, max_new_tokens=8)
    for spec in (exact, inside):
        assert refs.replays() and not refs.replays(confirm=True, spec=spec), spec.policy
        assert refs.payload(reference, confirm=True, spec=spec) == {"a": ["x"]}
        assert isinstance(refs.payload(reference, spec=spec)["a"], dict), "the search replays it"
    for spec in (candidate, no_dropout):
        assert refs.replays(confirm=True, spec=spec)
        assert isinstance(refs.payload(reference, confirm=True, spec=spec)["a"], dict)


def test_int8_confirmation_replays_only_at_one_thread_per_actor():
    """At more threads some kernels split rows at other offsets: replay there is not exact by construction."""
    assert _refs("int8", cpus_per_actor=1.5).replays(confirm=True)
    many = _refs("int8", cpus_per_actor=4)
    assert many.replays() and not many.replays(confirm=True)


def test_a_shared_stores_replayed_records_are_redone_before_confirmation_reads_them(tmp_path):
    """bf16 confirmation decodes in full: a replayed record another sweep's search left in the shared store is
    not kept for it (it is sent again), while the store keeps every record it held; on int8 it is kept."""
    from workers.results.store import RecordStore

    store = RecordStore(tmp_path / "store")
    replayed, full, failed = rec("a", 1.0), rec("b", 1.0), rec("c", 1.0)
    replayed.replay, failed.replay = "exact", "full (replay failed: IndexError)"
    replayed.threads, replayed.replay_version = 1, REPLAY_VERSION
    for r in (replayed, full, failed):
        store.append(r)
    held, kept = _refs("bf16").held(store, confirm=True)
    assert set(held) == {"a", "b", "c"} and set(kept) == {"b", "c"}
    assert set(_refs("bf16").held(store)[1]) == {"a", "b", "c"}, "the search keeps them"
    assert set(_refs("int8").held(store, confirm=True)[1]) == {"a", "b", "c"}


def test_int8_confirmation_keeps_a_replayed_record_only_if_it_was_made_at_one_thread(tmp_path):
    """Replay is exact on int8 at one thread only: a shared store's replayed record made at two threads, or one
    that does not say (made before records did), is made again for a certificate; the search keeps both."""
    from workers.results.store import RecordStore

    store = RecordStore(tmp_path / "store")
    for item, threads in (("one", 1), ("two", 2), ("unsaid", 0)):
        r = rec(item, 1.0)
        r.replay, r.threads, r.replay_version = "diverged@3", threads, REPLAY_VERSION
        store.append(r)
    assert set(_refs("int8").held(store, confirm=True)[1]) == {"one"}
    assert set(_refs("int8").held(store)[1]) == {"one", "two", "unsaid"}
    assert RecordStore(tmp_path / "store").load()["two"].threads == 2, "the field survives the store"


def test_confirmation_keeps_a_replayed_record_only_under_the_current_replay_semantics(tmp_path):
    """A replayed record made by other replay code (an older version, or one that does not say: made before records
    did) is made again for a certificate, whatever its threads; a record decoded in full is kept; the search keeps
    all; the version survives the store."""
    from workers.results.store import RecordStore

    store = RecordStore(tmp_path / "store")
    for item, version, how in (("now", REPLAY_VERSION, "exact"), ("old", REPLAY_VERSION - 1, "exact"),
                               ("unsaid", 0, "diverged@2"), ("full", 0, "")):
        r = rec(item, 1.0)
        r.replay, r.threads, r.replay_version = how, 1, version
        store.append(r)
    assert set(_refs("int8").held(store, confirm=True)[1]) == {"now", "full"}
    assert set(_refs("int8").held(store)[1]) == {"now", "old", "unsaid", "full"}
    assert RecordStore(tmp_path / "store").load()["now"].replay_version == REPLAY_VERSION


def test_confirmation_makes_again_a_replayed_record_decided_after_the_fused_kernels_failed(tmp_path):
    """A replay decided by the eager kernels because the fused ones failed in its process rounds otherwise than the
    full decode it stands for: made again for a certificate; kept by the search; the reason survives the store."""
    from workers.results.store import RecordStore

    store = RecordStore(tmp_path / "store")
    for item, off, how in (("fused", "", "exact"), ("eager", "RuntimeError: no compiler", "exact"),
                           ("full", "RuntimeError: no compiler", "")):
        r = rec(item, 1.0)
        r.replay, r.threads, r.replay_version, r.fused_off = how, 1, REPLAY_VERSION, off
        store.append(r)
    assert set(_refs("int8").held(store, confirm=True)[1]) == {"fused", "full"}
    assert set(_refs("int8").held(store)[1]) == {"fused", "eager", "full"}
    assert RecordStore(tmp_path / "store").load()["eager"].fused_off == "RuntimeError: no compiler"


def test_a_record_says_when_the_fused_kernels_were_off_in_its_process(monkeypatch):
    from policies import fused
    from workers.evaluation import _fused_off

    assert _fused_off() == (fused.failure() or "")
    monkeypatch.setattr(fused, "_failed", ["RuntimeError: no compiler"])
    assert _fused_off() == "RuntimeError: no compiler"


def test_the_lossless_bundles_progress_starts_after_the_target_only_reference(tmp_path, monkeypatch):
    """The bundle replays from target-only: its progress line (rate, ETA) starts once that reference is held, not
    before it runs (the line said ETA 1,606 min while 64 items took 8)."""
    from types import SimpleNamespace

    import cluster.pool
    import sweep.references as references
    from workers.benchmarks.base import Item

    order = []

    class Bar:
        def __init__(self, label, total, *a, **k):
            order.append("bar")

        def update(self, *a):
            pass

        def close(self, *a):
            pass

    refs = _refs("int8")
    refs.root, refs.items = tmp_path, [Item(id="a", index=0, turns=("q",), reference="1")]
    refs.settings = Settings(**{**refs.settings.__dict__, "bench": SimpleNamespace(key="gsm8k", ref="gsm8k")})
    monkeypatch.setattr(references, "Progress", Bar)
    monkeypatch.setattr(References, "target_only", lambda self: order.append("target-only") or {})
    monkeypatch.setattr(cluster.pool, "run_bundles", lambda *a, **k: order.append("bundles"))
    refs._lossless_bundle([1, 2])
    assert order == ["target-only", "bar", "bundles"]
