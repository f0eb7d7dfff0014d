"""The docs stand alone and stay true to the tree and to what happened: no reference outside the repository,
every relative link resolves (anchors too), every ``python -m`` module, ``make`` target, dotted module name and
file path they name exists, no GPU measurement is claimed, no superseded certificate is shown as certified,
and the README stays a front door (at most 220 lines)."""

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
README_MAX_LINES = 220


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
            if module in ("pip", "venv", "pytest") or module.startswith("sglang."):  # another engine's server
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


# A backticked name that starts a code span with one of the project's packages: `jobs.confirm`,
# `workers.certify.decide`, `workers.vllm.plugin:register`, `policies.ragged.CHUNK_ELEMENTS_CPU`.
PACKAGES = ("jobs", "workers", "cluster", "policies", "dashboards", "sweep")
TOPS = "|".join(PACKAGES)
DOTTED = re.compile(rf"`((?:{TOPS})\.[A-Za-z_][\w.]*?(?::[A-Za-z_][\w.]*?)?)\.?[`\s(\[,]")
# a backticked path that starts a code span in one of the tree's folders: `jobs/sweep.py`, `workers/metrics/cost.py`
# (one written as vLLM's `docs/...` names vLLM's own tree and is not checked)
PATH = re.compile(rf"(?<!vLLM's )`((?:{TOPS}|tests|scripts|infra|examples|constraints|docs)/[^`\s]*)[`\s]")
FILE_NAMES = {"py", "json", "jsonl", "yaml", "yml", "md", "db", "parquet", "csv", "png", "txt", "toml"}


def module_file(parts: list[str]) -> Path | None:
    """The file of the module ``parts`` names (a/b/c.py or a/b/c/__init__.py), found on disk, never imported."""
    for path in (ROOT.joinpath(*parts[:-1], parts[-1] + ".py"), ROOT.joinpath(*parts, "__init__.py")):
        if path.is_file():
            return path
    return None


def resolves(dotted: str) -> bool:
    """A module, or a module and then at most two names (``module.name``, ``module.Class.method``,
    ``module:name``) of which the first occurs in the module's file. The longest prefix that is a module file
    wins, and it must be at least two components long (``jobs.confirm``, not ``jobs`` alone)."""
    module, _, attr = dotted.partition(":")
    parts = module.split(".")
    if not attr and parts[-1] in FILE_NAMES:  # a file name such as `sweep.json`, not a module
        return True
    for k in range(len(parts), 1, -1):
        path = module_file(parts[:k])
        if path is not None:
            rest = parts[k:] + (attr.split(".") if attr else [])
            return len(rest) <= 2 and (not rest or re.search(rf"\b{re.escape(rest[0])}\b", path.read_text()) is not None)
    return False


def test_every_dotted_module_and_file_path_the_docs_name_exists():
    """Module names are resolved by file existence under the repository (importing would pull in torch, Ray and
    vLLM); paths may be files or folders, a glob must match something, ``::test`` and ``:line`` are cut off, and
    a path written as vLLM's `...` is vLLM's own."""
    missing = []
    for doc in DOCS:
        name = doc.relative_to(ROOT).as_posix()
        for dotted in sorted(set(DOTTED.findall(TEXT[doc]))):
            if not resolves(dotted):
                missing.append(f"{name}: `{dotted}`")
        for path in sorted(set(PATH.findall(TEXT[doc]))):
            if "<" in path or "{" in path:  # a placeholder: runs/sweeps/<study>
                continue
            clean = re.sub(r":\d+$", "", path.split("::")[0]).rstrip(".,;:")
            found = any(ROOT.glob(clean)) if "*" in clean else (ROOT / clean).exists()
            if not found:
                missing.append(f"{name}: `{path}`")
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


def test_the_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; detail belongs in docs/"


GPU_PHRASE = re.compile(r"first GPU run|\bon (?:a|the) GPUs?\b", re.I)
FIGURE = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?\s?(?:ms|s|GB|GiB|MiB|tok/s|x|%)(?![\w/])")
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Za-z*`(\[])")


def sentences(md: str) -> list[tuple[int, str]]:
    """(line, text) of every sentence outside fenced code: a paragraph's lines are joined and split after
    . ! or ? before a letter, a backtick, a bracket or bold; a heading and a table row are one sentence each,
    and a list item starts a new one."""
    out: list[tuple[int, str]] = []
    para: list[str] = []
    start = 0
    fenced = False

    def flush():
        if para:
            out.extend((start, s) for s in SENTENCE_END.split(" ".join(para)))
            para.clear()

    for n, line in enumerate(md.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            flush()
            fenced = not fenced
            continue
        if fenced:
            continue
        if not stripped or stripped.startswith(("#", "|")):
            flush()
            if stripped:
                out.append((n, stripped))
            continue
        if re.match(r"([-*+]|\d+\.)\s", stripped):
            flush()
        if not para:
            start = n
        para.append(stripped)
    flush()
    return out


def gpu_measurement_recorded() -> bool:
    """docs/measurements.md has a section whose heading says GPU and measured (and not 'not', 'never', 'no')."""
    return any(line.startswith("#") and "GPU" in line and re.search(r"\bmeasured\b", line, re.I)
               and not re.search(r"\b(not|never|no|un\w*)\b", line, re.I)
               for line in (ROOT / "docs" / "measurements.md").read_text().splitlines())


def test_no_doc_claims_a_gpu_measurement():
    """The rule: no sentence (or table row) of any doc says "first GPU run", or says "on a GPU" / "on the GPU"
    next to a measured figure (a number with ms, s, GB, GiB, MiB, tok/s, x or %). No GPU has run this project's
    code; the day one does, docs/measurements.md gets a section headed with "GPU" and "measured", and such
    sentences are allowed again."""
    if gpu_measurement_recorded():
        return
    claims = [f"{doc.relative_to(ROOT)}:{n}: {text[:120]}" for doc in DOCS for n, text in sentences(TEXT[doc])
              if GPU_PHRASE.search(text) and (FIGURE.search(text) or "first GPU run" in text.replace("\n", " "))]
    assert claims == []


def test_the_gpu_claim_rule_sees_what_it_forbids():
    bad = "Measured on the first GPU run: a 20 GB worker.\n\nThe step took 3.2 ms on a GPU, batch 64.\n"
    good = "The step took 3.2 ms on the AVX2-only VM. It has never run on a GPU.\n\n| on a GPU | never run |\n"
    assert [n for n, t in sentences(bad) if GPU_PHRASE.search(t) and FIGURE.search(t)] == [1, 3]
    assert [n for n, t in sentences(good) if GPU_PHRASE.search(t) and FIGURE.search(t)] == []


UPSTREAM_ISSUE = re.compile(r"\[[^\]]*\]\(https://github\.com/[\w.-]+/[\w.-]+/issues/\d+[^)\s]*\)"
                            r"|https://github\.com/[\w.-]+/[\w.-]+/issues/\d+\S*")


def test_no_doc_refers_to_project_issues():
    """Docs say what the code does and what happened, never which tracker entry asked for it: the word "issue"
    appears only inside a link to an upstream project's GitHub issue."""
    bad = [f"{doc.relative_to(ROOT)}:{n}" for doc in DOCS for n, line in enumerate(TEXT[doc].splitlines(), 1)
           if re.search(r"\bissues?\b", UPSTREAM_ISSUE.sub("", line), re.I)]
    assert bad == []


def test_no_doc_shows_a_superseded_certificate_as_certified():
    """A results folder holding SUPERSEDED.md is withdrawn: no line that links to it (or names it) says
    **yes** or certified: yes."""
    withdrawn = sorted(p.parent for p in (ROOT / "docs" / "results").glob("*/SUPERSEDED.md"))
    assert withdrawn, "docs/results/gsm8k-real-kl-judge is superseded: the rule must have a folder to guard"
    bad = []
    for doc in DOCS:
        if any(folder in doc.parents for folder in withdrawn):
            continue  # the withdrawn folder's own record, which SUPERSEDED.md withdraws
        for n, line in enumerate(TEXT[doc].splitlines(), 1):
            if not re.search(r"\*\*yes\*\*|certified:\s*(\*\*)?yes", line, re.I):
                continue
            targets = [(doc.parent / (m.group(1) or m.group(2)).partition("#")[0]).resolve()
                       for m in LINK.finditer(line) if not re.match(r"[a-z]+:", m.group(1) or m.group(2))]
            if any(t == f or f in t.parents for t in targets for f in withdrawn) or \
                    any(f"results/{f.name}" in line for f in withdrawn):
                bad.append(f"{doc.relative_to(ROOT)}:{n}")
    assert bad == []
