"""The install paths resolve: pyproject.toml's ranges admit every environment's pins (constraints/),
the environments agree where they must, .venv holds exactly constraints/cpu.txt, every installer uses
its own constraints, and the GPU environment (vllm 0.33.0's CUDA build + spectune) resolves on PyPI
for linux x86_64 CPython 3.11 (pip --dry-run --report: nothing installed; where the index serves no separate
wheel metadata, as this machine's PyPI route does, pip downloads whole wheels to read it, torch's 555 MB
included, which is most of the test's minute). The last test needs PyPI: it fails, saying so, where PyPI cannot
be reached (CI can reach it); it is never skipped."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
CONSTRAINTS = ROOT / "constraints"
PYPI = "https://pypi.org/simple"
ENVIRONMENTS = ("cpu", "vllm-cpu", "gpu")
# The GPU environment's target: the wheels a Linux x86_64 CPython gets (manylinux_2_17 .. 2_39: the GPU
# image is Ubuntu 24.04, glibc 2.39). pip does not widen a --platform tag to older glibc itself.
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(39, 16, -1)] + ["manylinux2014_x86_64", "linux_x86_64"]
# Requirements PyPI serves as source only: pip cannot resolve them for another platform (--platform needs
# --only-binary=:all:), so their metadata is built here (pure Python, no platform in it) and what they
# require joins the platform resolve.
SDIST_ONLY = {"langdetect"}


def pins(env: str) -> dict[str, Version]:
    """name -> pinned version of constraints/<env>.txt (every line a `name==version` pin)."""
    out = {}
    for line in (CONSTRAINTS / f"{env}.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        spec = list(req.specifier)
        assert len(spec) == 1 and spec[0].operator == "==", f"constraints/{env}.txt: {line!r} is not an exact pin"
        out[canonicalize_name(req.name)] = Version(spec[0].version)
    return out


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def requirements(extras: tuple[str, ...] = ()) -> list[Requirement]:
    p = project()
    return [Requirement(r) for r in p["dependencies"] + [r for e in extras for r in p["optional-dependencies"][e]]]


def test_pyproject_has_ranges_and_every_environment_pin_satisfies_them():
    reqs = requirements(("dev", "vllm"))
    assert not [str(r) for r in reqs if any(s.operator == "==" for s in r.specifier)], \
        "exact pins belong in constraints/<environment>.txt, not pyproject.toml"
    by_name = {canonicalize_name(r.name): r for r in reqs}
    for env in ("cpu", "gpu"):
        for name, version in pins(env).items():
            if name in by_name:
                assert by_name[name].specifier.contains(version, prereleases=True), \
                    f"constraints/{env}.txt pins {name}=={version}, outside pyproject.toml's {by_name[name]}"
    # what the GPU environment needs from the project: the `vllm` extra names the pinned vllm
    assert by_name["vllm"].specifier.contains(pins("gpu")["vllm"])
    assert {"torch", "transformers", "ray"} <= set(by_name)


def test_environments_agree_where_they_must():
    cpu, vllm_cpu, gpu = (pins(env) for env in ENVIRONMENTS)
    # Ray checks that the driver (.venv) and the vLLM actors run the same version; a cluster runs one Ray
    assert cpu["ray"] == vllm_cpu["ray"] == gpu["ray"]
    assert cpu["torch"] == vllm_cpu["torch"] == Version("2.13.0"), "vllm-cpu 0.32.0 needs torch 2.13.0+cpu"
    # everything but the engine's own stack is the same in the CPU and the GPU environment
    differ = {n for n in set(cpu) & set(gpu) if cpu[n] != gpu[n]}
    assert differ == {"torch", "transformers"}, differ
    assert gpu["vllm"] == Version("0.33.0") and gpu["torch"] == Version("2.14.0")
    assert Version("5.16.1") <= gpu["transformers"] < Version("5.21"), "vllm 0.33.0: transformers>=5.16.1,<5.21"
    assert Version("5.16.1") <= vllm_cpu["transformers"] < Version("5.20"), "vllm-cpu 0.32.0: transformers<5.20"


def this_environment() -> str:
    """Which constraints file made the environment running the tests: the one with vllm is the GPU
    environment, the one with vllm-cpu .vllm-venv, else .venv (scripts/setup-env)."""
    for dist, env in (("vllm", "gpu"), ("vllm-cpu", "vllm-cpu")):
        try:
            importlib.metadata.version(dist)
            return env
        except importlib.metadata.PackageNotFoundError:
            pass
    return "cpu"


def test_main_environment_is_what_constraints_cpu_pins():
    """In .venv (scripts/setup-env): the installed versions are constraints/cpu.txt's pins, so the two
    cannot drift apart (in the GPU environment, constraints/gpu.txt's)."""
    env = this_environment()
    wanted = pins(env)
    assert {"torch", "transformers", "ray", "optuna", "mlflow"} <= set(pins("cpu"))
    drift = {}
    for name, version in wanted.items():
        try:
            got = Version(importlib.metadata.version(name))
        except importlib.metadata.PackageNotFoundError:
            drift[name] = f"not installed (pinned {version})"
            continue
        if Version(got.public) != version:  # torch's local label (+cpu) is the build, not the version
            drift[name] = f"{got} installed, constraints/{env}.txt pins {version}"
    assert drift == {}, f"{sys.prefix} differs from constraints/{env}.txt (rerun its setup script): {drift}"
    if env == "cpu":
        assert Version(importlib.metadata.version("torch")).local in (None, "cpu"), "the CPU build of torch"


def test_every_installer_uses_its_own_constraints():
    files = {"scripts/setup-env": "constraints/cpu.txt", "infra/docker/Dockerfile": "constraints/cpu.txt",
             "scripts/setup-vllm-env": "constraints/vllm-cpu.txt", "scripts/setup-gpu-env": "constraints/gpu.txt",
             "infra/docker/Dockerfile.gpu": "constraints/gpu.txt",
             "scripts/setup-sandbox-env": "constraints/sandbox.txt"}
    for path, constraints in files.items():
        text = (ROOT / path).read_text()
        assert constraints in text, path
        for other in set(files.values()) - {constraints}:
            assert other not in text, f"{path} names {other}"
        named = re.search(r"^C=(\S+)$", text, flags=re.M)
        flag = f"-c {constraints}" if named is None else "-c $C"
        assert named is None or named.group(1) == constraints
        for line in text.splitlines():
            if "pip install" not in line or line.lstrip().startswith("#") or "--upgrade pip" in line:
                continue
            # every install takes its versions from the constraints; spectune itself without dependencies
            # goes into .vllm-venv only (vllm-cpu's pins are not the project's)
            assert flag in line or (path == "scripts/setup-vllm-env" and "--no-deps" in line), f"{path}: {line.strip()}"
        if path.startswith("scripts/"):  # the stamp covers the constraints: a changed pin reinstalls
            stamp = next(line for line in text.splitlines() if line.startswith("want="))
            assert constraints in stamp or "$C" in stamp, path
    gpu = (ROOT / "scripts/setup-gpu-env").read_text()
    assert gpu.index("-c $C vllm") < gpu.index('-e ".[vllm,dev]"'), "vllm (CUDA build) first, then the project"
    for dockerfile in ("Dockerfile", "Dockerfile.gpu"):
        assert "COPY constraints ./constraints" in (ROOT / "infra/docker" / dockerfile).read_text()
    assert os.access(ROOT / "scripts/setup-gpu-env", os.X_OK)


def _pip(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    """pip of this interpreter against PyPI alone: no config files (this machine's extra indexes, local
    wheels and constraints are not the GPU node's), no index from the environment."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_INDEX_URL", "PIP_CONSTRAINT", "PIP_NO_INDEX")}
    env["PIP_CONFIG_FILE"] = os.devnull
    return subprocess.run([sys.executable, "-m", "pip", *args, "--index-url", PYPI, "--disable-pip-version-check"],
                          capture_output=True, text=True, timeout=timeout, env=env)


def _report(path: Path) -> dict[str, dict]:
    return {canonicalize_name(i["metadata"]["name"]): i for i in json.loads(path.read_text())["install"]}


@pytest.mark.slow
def test_gpu_environment_resolves_on_pypi_for_linux_x86_64_cp311(tmp_path):
    """scripts/setup-gpu-env's two installs as one resolve: vllm and the project with its `vllm` and `dev`
    extras, under constraints/gpu.txt, for a Linux x86_64 CPython 3.11 — from PyPI's metadata only."""
    try:
        probe = _pip(["index", "versions", "vllm", "--timeout", "15", "--retries", "1"], timeout=90)
        said = (probe.stderr or probe.stdout).strip()[-400:] if probe.returncode or "0.33.0" not in probe.stdout else ""
    except subprocess.TimeoutExpired:
        said = "no answer in 90 s"
    if said:
        pytest.fail(f"PyPI ({PYPI}) cannot be reached or does not list vllm 0.33.0, so the GPU environment cannot "
                    f"be resolved (this test needs PyPI; it is not skipped): {said}", pytrace=False)
    reqs = requirements(("vllm", "dev"))
    constraints = str(CONSTRAINTS / "gpu.txt")
    # 1) requirements served as source only: their metadata (built here, platform-free) says what they need
    sdists = [str(r) for r in reqs if canonicalize_name(r.name) in SDIST_ONLY]
    extra: list[str] = []
    if sdists:
        got = _pip(["install", "--dry-run", "--ignore-installed", "--no-deps", "--quiet", "--report",
                    str(tmp_path / "sdists.json"), "-c", constraints, *sdists], timeout=120)
        assert got.returncode == 0, got.stderr[-2000:]
        for name, item in _report(tmp_path / "sdists.json").items():
            assert item["download_info"]["url"].endswith((".tar.gz", ".zip")), f"{name} has a wheel now: drop it from SDIST_ONLY"
            extra += [d for d in item["metadata"].get("requires_dist", []) if "extra ==" not in d]
    # 2) everything else, for the GPU node's platform: wheels only, metadata only
    platform = [flag for tag in PLATFORMS for flag in ("--platform", tag)]
    wheels = [str(r) for r in reqs if canonicalize_name(r.name) not in SDIST_ONLY] + ["vllm"] + extra
    got = _pip(["install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(tmp_path / "gpu.json"),
                "--only-binary=:all:", *platform, "--python-version", "3.11", "--implementation", "cp",
                "--abi", "cp311", "--abi", "abi3", "--abi", "none", "--target", str(tmp_path / "target"),
                "-c", constraints, *wheels], timeout=300)
    assert got.returncode == 0, (
        "the GPU environment does not resolve on PyPI for linux x86_64 cp311 (a requirement with no wheel "
        f"there belongs in SDIST_ONLY):\n{got.stderr[-3000:]}")
    resolved = _report(tmp_path / "gpu.json") | (_report(tmp_path / "sdists.json") if sdists else {})
    version = {name: Version(item["metadata"]["version"]) for name, item in resolved.items()}
    gpu = pins("gpu")
    for name, pin in gpu.items():
        assert version.get(name) == pin, f"{name}: resolved {version.get(name)}, constraints/gpu.txt pins {pin}"
    # what vllm 0.33.0 itself demands, read from its metadata: the pins satisfy it
    vllm_needs = {canonicalize_name(Requirement(d).name): Requirement(d)
                  for d in resolved["vllm"]["metadata"]["requires_dist"] if "extra ==" not in d}
    assert str(vllm_needs["torch"].specifier) == "==2.14.0"
    assert vllm_needs["transformers"].specifier.contains(gpu["transformers"])
    # the CUDA build: PyPI's torch 2.14.0 for Linux brings the CUDA runtime and cuDNN wheels
    assert any(name.startswith("nvidia-cudnn") for name in resolved), "torch resolved without CUDA libraries"
    assert resolved["vllm"]["download_info"]["url"].endswith("manylinux_2_28_x86_64.whl")
