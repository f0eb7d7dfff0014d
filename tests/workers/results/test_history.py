"""The shipped history: every committed result's attempt is in it, whole, and can be rebuilt from its folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from workers.results.history import KNOWN, append_rows, holds, read_rows, reconstruct

RESULTS = Path(__file__).resolve().parents[3] / "docs" / "results"
FOLDERS = sorted(p.parent for p in RESULTS.glob("*/certification.json"))


def test_there_are_committed_results_to_check():
    assert {f.name for f in FOLDERS} >= {"gsm8k-int4-frontier", "gsm8k-real-frontier", "gsm8k-real-kl-judge"}


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda p: p.name)
def test_every_committed_result_has_its_attempt_in_the_shipped_history(folder):
    assert holds(folder, read_rows()) == [], f"{folder.name}: its attempt's rows are not (all) in {KNOWN.name}"


@pytest.mark.parametrize("folder", [f for f in FOLDERS if json.loads((f / "certification.json").read_text())
                                    ["budgets"].popitem()[1]["certification"].get("attempt")], ids=lambda p: p.name)
def test_an_attempt_rebuilt_from_its_folder_is_the_one_shipped(folder):
    rebuilt = reconstruct(folder)
    aid = rebuilt[0]["attempt"]
    shipped = [r for r in read_rows() if r.get("attempt") == aid]
    opened = next(r for r in shipped if r["event"] == "opened")
    # the shipped attempt planned at least the items its evidence used, in the same order
    assert opened["items"][: len(rebuilt[0]["items"])] == rebuilt[0]["items"]
    assert set(opened["search_items"]) == set(rebuilt[0]["search_items"])
    decided = {float(r["budget"]): r["certified"] for r in shipped if r["event"] == "decided"}
    assert {float(r["budget"]): r["certified"] for r in rebuilt[1:]} == decided


def test_a_history_without_the_attempt_fails_naming_it(tmp_path):
    folder = RESULTS / "gsm8k-int4-frontier"
    rows = [r for r in read_rows() if r.get("attempt") != "62cf91379d51"]
    assert holds(folder, rows) == ["no opened row for attempt 62cf91379d51"]
    flipped = [dict(r, certified=not r["certified"]) if r.get("event") == "decided" and r.get("attempt") ==
               "62cf91379d51" and float(r["budget"]) == 0.05 else r for r in read_rows()]
    assert any("at 5% says certified False" in m for m in holds(folder, flipped))


def test_shipping_rows_adds_each_once(tmp_path):
    path = tmp_path / "history.jsonl"
    shutil.copy(KNOWN, path)
    before = len(read_rows(path))
    new = reconstruct(RESULTS / "gsm8k-int4-frontier")
    assert append_rows(new, path) == 0, "the int4+int8 attempt is shipped already"
    row = dict(new[0], attempt="another")
    assert append_rows([row], path) == 1 and append_rows([row], path) == 0
    assert len(read_rows(path)) == before + 1
