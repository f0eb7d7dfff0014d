"""sweep.state: a resumed study keeps the calibration its first start recorded (CPU engine only)."""

from __future__ import annotations

from sweep.state import _study_profile

RECORDED = {"cost_ratio": 0.254, "load_1m": 0.65, "draft_s": 0.0166, "target_s": 0.0653}
FRESH = {"cost_ratio": 0.341, "load_1m": 0.7, "draft_s": 0.0176, "target_s": 0.0516}


def test_a_resumed_cpu_study_keeps_its_recorded_calibration_and_says_so(capsys):
    assert _study_profile(RECORDED, FRESH, "cpu") is RECORDED
    out = capsys.readouterr()
    assert "c = 0.254" in out.out + out.err and "c = 0.341" in out.out + out.err
    assert _study_profile(RECORDED, dict(RECORDED), "cpu") is RECORDED
    assert "resumed" not in "".join(capsys.readouterr()), "nothing to say when they agree"


def test_a_new_study_or_another_engine_takes_this_starts_profile():
    assert _study_profile(None, FRESH, "cpu") is FRESH
    assert _study_profile({}, FRESH, "cpu") is FRESH, "a sweep.json written before profiles were recorded"
    assert _study_profile(RECORDED, FRESH, "vllm") is FRESH
    assert _study_profile(RECORDED, FRESH, "openai") is FRESH
