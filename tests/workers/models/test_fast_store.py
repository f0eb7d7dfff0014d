"""The fast path's stores as a start shows them (workers.models.fast_store with workers.startup): converting, then
loading back, each said with an ETA; and two processes starting together convert the draft and the target side by
side instead of one waiting on the other."""

from __future__ import annotations

import threading
import time

import pytest

from workers import startup
from workers.models import fast_store
from workers.models.pair import load_pair
from workers.models.tiny import save_tiny_pair


@pytest.fixture
def tiny(tmp_path):
    draft, target = save_tiny_pair(tmp_path / "tiny", head_dim=16)
    return f"{draft}+{target}", tmp_path / "cache"


@pytest.fixture
def heard():
    lines: list[str] = []
    stop = startup.listen(lines.append)
    yield lines
    stop()


def test_a_first_load_converts_and_the_next_loads_with_the_last_durations_as_etas(tiny, heard):
    name, cache = tiny
    pair = load_pair(name, dtype="int4+int8", cache_dir=cache)
    starts = [line for line in heard if ": started" in line]
    assert starts[0].startswith("converting the draft to 4-bit (once per pair") and "ETA" in starts[0]
    assert starts[1].startswith("converting the target to int8 (once per pair")
    assert sum("done in" in line for line in heard) == 2
    kept = startup._read(pair.cache_dir / startup.TIMINGS)[startup.host_fingerprint()]
    assert {"convert-4-bit-draft", "convert-int8-target"} <= set(kept)
    heard.clear()
    load_pair(name, dtype="int4+int8", cache_dir=cache)
    starts = [line for line in heard if ": started" in line]
    assert starts == [f"loading the draft (4-bit, converted earlier): started, ETA {startup._secs(0)} (from its size)",
                      f"loading the target (int8, converted earlier): started, ETA {startup._secs(0)} (from its size)"]


def test_a_start_that_finds_the_draft_being_converted_converts_the_target_first(tiny, heard):
    """Another process holds the draft's lock (it is converting it): this one converts the target meanwhile, then
    waits for the draft, then loads what the other stored."""
    name, cache = tiny
    from workers.models.pair import pair_dirs

    pair_cache = pair_dirs(name, cache)[2]
    draft_store = pair_cache / "int4" / "draft"
    draft_store.parent.mkdir(parents=True, exist_ok=True)
    lock = open(draft_store.with_name("draft.lock"), "w")  # noqa: SIM115 - released below
    assert fast_store.try_lock(lock) and fast_store.converting(draft_store)
    got: list = []
    loader = threading.Thread(target=lambda: got.append(load_pair(name, dtype="int4+int8", cache_dir=cache)))
    loader.start()
    deadline = time.monotonic() + 60
    while not any(line.startswith("waiting for another process converting the draft") for line in heard):
        assert time.monotonic() < deadline and loader.is_alive(), heard
        time.sleep(0.05)
    assert any(line.startswith("converting the target to int8") and "done in" in line for line in heard)
    lock.close()  # the other process is gone without storing: this one converts the draft itself
    loader.join(timeout=60)
    assert got and not fast_store.converting(draft_store)
    order = [line.split(" (")[0].split(":")[0] for line in heard if ": started" in line]
    assert order == ["converting the target to int8", "waiting for another process converting the draft to 4-bit",
                     "converting the draft to 4-bit"]


def test_converting_is_false_without_a_lock_file(tmp_path):
    assert not fast_store.converting(tmp_path / "int8" / "target")
