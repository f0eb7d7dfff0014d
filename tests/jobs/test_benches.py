"""The measurement scripts: bad input is one line naming it; bench_quality runs, resumes and tabulates."""

from __future__ import annotations

import pytest

from jobs import bench_engine, bench_quality
from workers import calibrate


@pytest.mark.parametrize("main,argv,words", [
    (bench_quality.main, ["--rule", "kl_jduge"], "unknown policy 'kl_jduge'"),
    (bench_quality.main, ["--rule", "kl_judge:threshold"], "--rule must look like"),
    (bench_quality.main, ["--rule", "kl_judge:threshold=-1"], "threshold"),
    (bench_quality.main, ["--pair", "nope"], "unknown pair 'nope'"),
    (bench_engine.main, ["--dtype", "fp8"], "unknown dtype 'fp8'"),
    (calibrate.main, ["--pair", "nope"], "unknown pair 'nope'"),
])
def test_bad_input_is_one_line(main, argv, words, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err


def test_bench_quality_tabulates_every_config_and_resumes(tmp_path, capsys):
    argv = ["--pair", "tiny-random", "--dtype", "fp32", "--items", "3", "--shots", "0", "--max-new-tokens", "8",
            "--rule", "top_k:k=3", "--runs-root", str(tmp_path)]
    assert bench_quality.main(argv) == 0
    out, err = capsys.readouterr()
    rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| config")]
    assert [r.split(" | ")[0] for r in rows] == ["| target-only", "| lossless() L=5", "| top_k(k=3) L=5"]
    assert "[3/3]" in err and "noise floor" in out
    assert bench_quality.main(argv) == 0  # everything cached: nothing recomputed
    out2, err2 = capsys.readouterr()
    assert "[1/" not in err2 and "all cached" in out2
