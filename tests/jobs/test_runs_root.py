"""Where run directories go: ./runs, SPECTUNE_RUNS, --runs-root; and never silently into the
temporary copy of the checkout that Ray unpacks for a job submitted with --working-dir."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.results.store import RAY_WORKING_DIR_MARK, runs_root


@pytest.fixture
def ray_copy(tmp_path, monkeypatch):
    """A cwd shaped like Ray's unpacked working_dir, a HOME of our own, no SPECTUNE_RUNS."""
    cwd = tmp_path / "session_x" / RAY_WORKING_DIR_MARK / "_ray_pkg_0123"
    cwd.mkdir(parents=True)
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("SPECTUNE_RUNS", raising=False)
    return cwd


def test_outside_a_ray_job_the_default_is_runs_under_the_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SPECTUNE_RUNS", raising=False)
    assert runs_root() == tmp_path.resolve() / "runs"
    monkeypatch.setenv("SPECTUNE_RUNS", str(tmp_path / "elsewhere"))
    assert runs_root() == tmp_path.resolve() / "elsewhere"
    assert runs_root(tmp_path / "given") == tmp_path.resolve() / "given", "--runs-root wins"


def test_a_ray_job_without_a_root_writes_to_a_persistent_default(ray_copy, tmp_path):
    root = runs_root()
    assert root == (tmp_path / "home" / "spectune_runs").resolve()
    assert RAY_WORKING_DIR_MARK not in root.as_posix()


def test_a_ray_job_honours_the_heads_spectune_runs(ray_copy, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECTUNE_RUNS", str(tmp_path / "checkout" / "runs"))
    assert runs_root() == (tmp_path / "checkout" / "runs").resolve()


@pytest.mark.parametrize("how", ["flag", "env"])
def test_a_relative_root_inside_rays_copy_is_refused_with_the_fix(ray_copy, monkeypatch, how):
    if how == "env":
        monkeypatch.setenv("SPECTUNE_RUNS", "runs")
    with pytest.raises(ValueError, match="--runs-root" if how == "flag" else "SPECTUNE_RUNS") as err:
        runs_root("runs" if how == "flag" else None)
    assert "working_dir" in str(err.value) and "absolute path" in str(err.value)


def test_the_sweep_refuses_a_run_dir_inside_rays_copy_before_starting_anything(ray_copy, capsys):
    from jobs import sweep as sweep_job

    rc = sweep_job.main(["--pair", "tiny-random", "--dtype", "fp32", "--items", "2", "--trials", "1",
                         "--run-dir", "runs/x"])
    err = capsys.readouterr().err
    assert rc == 2 and "--run-dir" in err and "Traceback" not in err
    assert not Path("runs").exists()
