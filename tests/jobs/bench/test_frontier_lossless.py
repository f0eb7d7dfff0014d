"""jobs.bench.frontier_lossless without a model: the study's settings and items from an exported folder, its cost
model found or asked for, and the page rewritten with the recomputed lossless part and nothing else changed."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from jobs.bench import frontier_lossless as fl
from tests.workers.metrics.test_frontier import rec

ROOT = Path(__file__).resolve().parents[3]
STUDY = ROOT / "docs" / "results" / "gsm8k-int4-frontier"
PROFILE = {"pair": "p", "dtype": "int4+int8", "machine": "m", "context": 128, "draft_step_s": 0.25,
           "target_step_s": 1.0, "verify_s": {"2": 1.0, "4": 1.2}, "load_1m": 0.5, "cost_ratio": 0.25}


def records():
    return {0: {"a": rec("a", 8, 8, 0, 0, 0, draft_len=0)}, 2: {"a": rec("a", 8, 4, 8, 4, 8, draft_len=2)},
            3: {"a": rec("a", 8, 3, 9, 5, 9, draft_len=3)}}


def test_the_exported_studys_settings_and_items_are_the_ones_it_searched():
    from sweep.settings import parse_settings

    meta = json.loads((STUDY / "sweep.json").read_text())
    settings = parse_settings(fl.study_args(meta, None, None))
    assert settings.lengths == list(range(1, 13)) and settings.args.dtype == "int4+int8"
    assert settings.decode == {"temperature": 0.0, "seed": 0, "shots": 8, "max_new_tokens": 192}
    assert [it.id for it in fl.study_items(settings, STUDY)] == (STUDY / "search_items.txt").read_text().split()


def test_the_study_profile_is_asked_for_where_the_export_lacks_it(tmp_path):
    folder = tmp_path / "study"
    folder.mkdir()
    (folder / "sweep.json").write_text(json.dumps({"study": "s", "args": {}}))
    (folder / "frontier.json").write_text(json.dumps({"cost_model": {"cost_ratio": 0.25, "verify_factor": {}}}))
    with pytest.raises(ValueError, match="give --study-profile"):
        fl.study_profile(folder, None)
    given = tmp_path / "run-sweep.json"
    given.write_text(json.dumps({"profile": PROFILE}))
    assert fl.study_profile(folder, str(given))["cost_ratio"] == 0.25
    (folder / "frontier.json").write_text(json.dumps({"cost_model": {"cost_ratio": 0.25, "profile": PROFILE}}))
    assert fl.study_profile(folder, None) == PROFILE, "a rewritten page keeps it for the next run"


def test_the_page_gets_the_recomputed_lossless_part_and_keeps_the_rest(tmp_path):
    folder = tmp_path / "study"
    shutil.copytree(STUDY, folder)
    old = json.loads((folder / "frontier.json").read_text())
    study = fl.priced(records(), {**PROFILE, "cost_ratio": old["cost_model"]["cost_ratio"],
                                  "draft_step_s": old["cost_model"]["cost_ratio"]})
    here = fl.priced(records(), PROFILE)
    source = {"study": "s", "code": {"commit": "abc"}, "study_profile": PROFILE}
    fl.write_page(folder, study, here, source)
    new = json.loads((folder / "frontier.json").read_text())
    assert [r["draft_len"] for r in new["lossless"]] == [0, 2, 3] and math.isfinite(new["ceiling_best"])
    assert new["best_lossless"]["draft_len"] == study["best_lossless"]["draft_len"]
    assert set(new["cost_model"]["verify_factor"]) == {"0", "2", "3"} and new["cost_model"]["profile"] == PROFILE
    for key in ("trials", "pareto", "budgets", "lost_items"):
        assert new[key] == old[key], key
    assert new["lossless_source"]["this_machine"]["cost_model"]["cost_ratio"] == 0.25
    text = (folder / "frontier.md").read_text()
    assert "n = 1 search items" in text and "Recomputed after the study" in text


def test_a_page_priced_otherwise_than_its_trials_or_an_empty_recomputation_is_refused():
    old = json.loads((STUDY / "frontier.json").read_text())
    other = fl.priced(records(), PROFILE)  # c 0.25, the page's trials were priced at 0.368
    with pytest.raises(ValueError, match="not the study's cost model"):
        fl.page(old, other, other, {})
    with pytest.raises(ValueError, match="recomputed lossless table is empty"):
        fl.page(old, fl.priced({}, PROFILE), other, {})
