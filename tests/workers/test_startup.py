"""Start-up progress lines (workers.startup): a phase says when it starts (with its ETA), how far it is while it runs
and when it ends; its duration is kept per host and is the next start's ETA; nothing is said without a listener."""

from __future__ import annotations

import json
import threading
import time

import pytest

from workers import startup


@pytest.fixture
def heard():
    lines: list[str] = []
    stop = startup.listen(lines.append)
    yield lines
    stop()


def test_nothing_is_said_without_a_listener(tmp_path, capsys):
    assert not startup.listening()
    with startup.phase("loading a thing", key="load", where=tmp_path, every_s=0.01):
        time.sleep(0.03)
    assert capsys.readouterr() == ("", "")
    assert startup.last_time(tmp_path, "load") is not None, "its duration is kept all the same"


def test_a_phase_says_start_and_end_and_the_next_start_has_the_last_duration_as_its_eta(tmp_path, heard):
    with startup.phase("converting the target", key="convert", where=tmp_path, every_s=0):
        pass
    assert heard[0] == "converting the target: started, no ETA yet (its first time on this machine)"
    assert heard[1].startswith("converting the target: done in ")
    data = json.loads((tmp_path / startup.TIMINGS).read_text())
    assert list(data) == [startup.host_fingerprint()] and "convert" in data[startup.host_fingerprint()]
    startup.record(tmp_path, "convert", 42.0)
    heard.clear()
    with startup.phase("converting the target", key="convert", where=tmp_path, every_s=0):
        pass
    assert heard[0] == "converting the target: started, ETA 42 s (the last time on this machine)"


def test_the_eta_is_kept_per_host(tmp_path, heard, monkeypatch):
    startup.record(tmp_path, "load", 12.0)
    host = startup.host()
    monkeypatch.setattr(startup, "host", lambda: {**host, "cpus": host["cpus"] + 64})
    assert startup.last_time(tmp_path, "load") is None
    with startup.phase("loading", key="load", where=tmp_path, estimate_s=7.0, estimate="from its size", every_s=0):
        pass
    assert heard[0] == "loading: started, ETA 7 s (from its size)"


def test_a_running_phase_says_how_far_it_is_and_a_failed_one_says_so(heard):
    with pytest.raises(RuntimeError):
        with startup.phase("calibrating", estimate_s=100.0, estimate="a guess", every_s=0.02):
            time.sleep(0.1)
            raise RuntimeError("boom")
    ticks = [line for line in heard[1:-1]]
    assert ticks and all(line.startswith("calibrating: 0 s, ETA ") and "(a guess)" in line for line in ticks)
    assert heard[-1].startswith("calibrating: failed after ")
    heard.clear()
    with startup.phase("waiting", estimate_s=0.0, every_s=0.02):
        time.sleep(0.06)
    assert any("past its ETA" in line for line in heard), heard


def test_a_phase_counting_its_own_steps_takes_its_eta_from_their_rate():
    running = startup.Phase("timing rounds", eta_s=None, source="")
    assert running.left() == (None, "")
    running.progress(0, 10, "rounds")
    time.sleep(0.02)
    running.progress(0, 10, "rounds")  # not moving yet: the rate starts when it moves
    t0 = time.perf_counter()
    time.sleep(0.05)
    running.progress(5, 10, "rounds")
    left, how = running.left()
    assert how == "at its rate so far" and 0.03 <= left <= (time.perf_counter() - t0) + 0.01
    assert "5/10 rounds" in running.line() and "ETA" in running.line()


def test_a_failing_listener_does_not_break_the_phase_and_lines_come_from_any_thread(heard):
    stop = startup.listen(lambda line: 1 / 0)
    try:
        threading.Thread(target=startup.say, args=("from a thread",)).start()
        with startup.phase("x", every_s=0):
            pass
    finally:
        stop()
    deadline = time.monotonic() + 2
    while "from a thread" not in heard and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "from a thread" in heard and heard[-1].startswith("x: done in")


def test_warn_goes_to_stderr_as_well(heard, capsys):
    startup.warn("calibrate: not stored")
    assert heard == ["calibrate: not stored"] and capsys.readouterr().err == "calibrate: not stored\n"
    with startup.to_stderr("> "):
        startup.say("hello")
    startup.say("unheard on stderr")
    assert capsys.readouterr().err == "> hello\n"


def test_the_host_fingerprint_names_what_a_steps_time_rests_on():
    fields = startup.host()
    assert set(fields) == {"cpu", "cpus", "flags", "torch", "aten", "transformers"}
    assert startup.fingerprint(fields) == startup.host_fingerprint()
    other = "AVX512" if fields["aten"] == "AVX2" else "AVX2"  # the other kernel level than this machine's
    assert startup.fingerprint({**fields, "aten": other}) != startup.host_fingerprint()
    assert startup.fingerprint({**fields, "cpus": fields["cpus"] + 1}) != startup.host_fingerprint()
