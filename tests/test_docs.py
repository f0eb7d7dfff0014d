"""The docs stand alone and stay true to the tree: no reference outside the repository, every relative
link resolves (anchors too), every ``python -m`` module and ``make`` target they name exists."""

from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TRACKED = [ROOT / p for p in subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                                            capture_output=True, text=True, check=True).stdout.split()]
TEXT = {p: p.read_text(errors="replace") for p in TRACKED if p.is_file() and p.suffix != ".png"}
DOCS = sorted(p for p in TEXT if p.suffix == ".md")
OUTSIDE = re.compile(r"\.\./shared|\bshared/(DESIGN|ASSETS|STYLE|house)|\b(DESIGN|ASSETS|STYLE)\.md\b|house-sketch")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def anchors(md: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to dashes."""
    out = set()
    for line in md.splitlines():
        if line.startswith("#"):
            text = line.lstrip("#").strip().lower()
            out.add(re.sub(r"\s", "-", re.sub(r"[^\w\- ]", "", text)))
    return out


def test_docs_are_found():
    names = {p.relative_to(ROOT).as_posix() for p in DOCS}
    assert {"README.md", "docs/design.md", "docs/assets.md", "docs/measurements.md", "docs/cluster.md"} <= names


def test_nothing_refers_outside_the_repository():
    here = Path(__file__)
    bad = [f"{p.relative_to(ROOT)}:{n}" for p, text in TEXT.items() if p != here
           for n, line in enumerate(text.splitlines(), 1) if OUTSIDE.search(line)]
    assert bad == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(doc):
    text = TEXT[doc]
    broken = []
    for match in LINK.finditer(text):
        target = match.group(1) or match.group(2)
        if re.match(r"[a-z]+:", target):  # http(s):, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists() or ROOT not in dest.parents and dest != ROOT:
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            broken.append(target)
    assert broken == []


def test_every_module_and_make_target_the_docs_name_exists():
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([\w-]+):", makefile, flags=re.M))
    missing = []
    for doc in DOCS + [ROOT / "Makefile"]:
        text = TEXT.get(doc) or doc.read_text()
        for module in set(re.findall(r"python -m ([\w.]+)", text)):
            if module in ("pip", "venv", "pytest"):
                continue
            try:
                found = importlib.util.find_spec(module) is not None
            except ModuleNotFoundError:  # a parent package that does not exist
                found = False
            if not found:
                missing.append(f"{doc.name}: python -m {module}")
        for target in set(re.findall(r"`make ([\w-]+)", text)):
            if target not in targets:
                missing.append(f"{doc.name}: make {target}")
    assert missing == []


def test_the_readme_python_example_runs():
    import torch

    block = re.search(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S).group(1)
    gen = torch.Generator().manual_seed(0)
    scope = {"torch": torch, "ids": torch.randint(0, 32, (2, 4), generator=gen),
             "q_logits": torch.randn(2, 4, 32, generator=gen), "p_logits": torch.randn(2, 5, 32, generator=gen)}
    exec(compile(block, "README.md", "exec"), scope)
    out = scope["out"]
    assert out.output_token_ids.shape == (2, 5) and out.num_accepted.shape == (2,)
