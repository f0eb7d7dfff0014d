"""``jobs.results check <root>`` on a results page (sweep.recheck.index): every listed folder rechecked by what it
holds, on copies of committed folders; a folder the page does not list, a listed one that is missing, a quality
figure or table that is not its evidence's, a table without its raw rows and a superseded folder whose row does not
say so each fail, named."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from jobs.results import main

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"
COPIED = ("gsm8k-real-frontier", "fast-cpu-path", "batched-cpu-engine")


def page(names: list[str], superseded: tuple[str, ...] = ()) -> str:
    rows = "\n".join(f"| [{n}]({n}/) | {'superseded' if n in superseded else 'a setting'} |" for n in names)
    return f"# Results\n\n| folder | what |\n|---|---|\n{rows}\n"


@pytest.fixture
def root(tmp_path) -> Path:
    for name in COPIED:
        shutil.copytree(RESULTS / name, tmp_path / name)
    (tmp_path / "README.md").write_text(page(list(COPIED)))
    return tmp_path


def lines_of(capsys) -> dict[str, str]:
    return {line.split(": ", 1)[0]: line.split(": ", 1)[1] for line in capsys.readouterr().out.splitlines()
            if ": " in line and not line.startswith(" ")}


def test_every_listed_folder_is_rechecked_by_what_it_holds(root, capsys):
    assert main(["check", str(root)]) == 0
    got = lines_of(capsys)
    assert got["gsm8k-real-frontier"].startswith("ok (certificates re-decided: 4 budget(s)")
    assert got["fast-cpu-path"].startswith("ok (quality recomputed from 200 items' evidence: drop +2.00% "
                                           "(lost 23, won 19), upper bound 7.50%")
    assert got["batched-cpu-engine"].startswith("ok (measurements: 2 table(s)")


def test_what_a_sceptic_could_change_fails_named(root, capsys):
    (root / "unlisted").mkdir()
    (root / "README.md").write_text(page([*COPIED, "missing"]))
    quality = json.loads((root / "fast-cpu-path" / "quality.json").read_text())
    (root / "fast-cpu-path" / "quality.json").write_text(json.dumps({**quality, "lost": quality["lost"] - 3}))
    next((root / "batched-cpu-engine").glob("batch-*.json")).unlink()
    (root / "gsm8k-real-frontier" / "SUPERSEDED.md").write_text("# Superseded: a test\n")
    assert main(["check", str(root)]) == 1
    got = lines_of(capsys)
    assert got["unlisted"].startswith("FAILED: a folder under") and "does not list" in got["unlisted"]
    assert got["missing"] == "FAILED: README.md lists it and there is no such folder"
    assert got["fast-cpu-path"].startswith("FAILED: quality.json differs from its evidence: lost 20 (recomputed 23)")
    assert got["batched-cpu-engine"].startswith("FAILED: batch-") and "has no raw rows" in got["batched-cpu-engine"]
    assert got["gsm8k-real-frontier"] == "FAILED: the folder holds SUPERSEDED.md and its row does not say superseded"


def test_a_superseded_row_needs_its_note_and_a_table_must_render_from_its_figures(root, capsys):
    (root / "README.md").write_text(page(list(COPIED), superseded=("gsm8k-real-frontier",)))
    md = root / "fast-cpu-path" / "quality.md"
    md.write_text(md.read_text().replace("| accuracy, int8 | 0.475 |", "| accuracy, int8 | 0.495 |"))
    assert main(["check", str(root)]) == 1
    got = lines_of(capsys)
    assert got["gsm8k-real-frontier"] == "FAILED: its row says superseded and the folder holds no SUPERSEDED.md"
    assert got["fast-cpu-path"] == "FAILED: quality.md is not what quality.json renders to"


def test_a_folder_that_is_neither_results_nor_a_page_is_one_line(tmp_path, capsys):
    assert main(["check", str(tmp_path)]) == 2
    assert "is not a results folder: it has no certification.json" in capsys.readouterr().err
