"""The frontier page's writer (dashboards.frontier.write): a page without its lossless table is refused, naming the
problem, and nothing is written; a page with one is written, with where a recomputed table came from."""

from __future__ import annotations

import json
import math

import pytest

from dashboards.frontier import check, render, write
from tests.workers.metrics.test_frontier import rec
from workers.metrics.frontier import summary


def page(lossless=None):
    lossless = {2: {"a": rec("a", 10, 5, 10, 5, 10, draft_len=2)}, 4: {"a": rec("a", 12, 4, 16, 8, 16)}} \
        if lossless is None else lossless
    return summary(lossless=lossless, cost_ratio=0.5, verify_factor=lambda n: 1.0, frame=None, chosen={})


def test_a_page_without_a_lossless_row_at_any_l_is_refused_and_nothing_is_written(tmp_path):
    """What the int4+int8 frontier's page was: a resumed study held no lossless records, so the table, the best
    lossless and the ceiling came out empty and the page said n = 0."""
    empty = page({})
    assert empty["lossless"] == [] and math.isnan(empty["best_lossless"]["tokens_per_cost"])
    with pytest.raises(ValueError, match="no lossless row at any L"):
        write(empty, tmp_path / "report", "study")
    assert not (tmp_path / "report").exists(), "no page, not an empty one"


def test_a_page_whose_best_lossless_is_not_a_number_is_refused(tmp_path):
    # rows at every L, but no item every L holds unfailed: nothing can be priced
    broken = page({2: {"a": rec("a", 10, 5, 10, 5, 10, draft_len=2)}, 4: {"b": rec("b", 12, 4, 16, 8, 16)}})
    assert broken["lossless"] and all(r["items"] == 0 for r in broken["lossless"])
    with pytest.raises(ValueError, match="no lossless row at any L"):
        write(broken, tmp_path, "study")
    nan_best = {**page(), "best_lossless": {"draft_len": None, "tokens_per_cost": math.nan}}
    with pytest.raises(ValueError, match="best lossless is nan"):
        check(nan_best)
    assert not (tmp_path / "frontier.json").exists() and not (tmp_path / "frontier.md").exists()


def test_a_page_with_its_lossless_table_is_written_with_where_a_recomputed_one_came_from(tmp_path):
    good = page()
    write(good, tmp_path, "study")
    assert json.loads((tmp_path / "frontier.json").read_text())["best_lossless"]["draft_len"] == 2
    assert "n = 1 search items" in (tmp_path / "frontier.md").read_text()
    source = {"at": "2026-12-06T02:06:11+0000", "settings": {"items": 1, "actors": 2, "threads_per_actor": 1},
              "code": {"commit": "e2f854d7f2fc" + "0" * 28, "dirty_files": ["x.py"], "fast_numerics": 2,
                       "replay_version": 1},
              "machine": {"cpu": "Some CPU", "cpus": 2, "avx512_bf16": True, "load_1m": 1.5, "load_1m_after": 2.0,
                          "uptime": " 02:06:11 up  2:17,  0 user,  load average: 1.50, 1.20, 1.00"},
              "calibration": {"context": 1536, "load_1m": 1.5}, "study_code": "git:e001f3593e36",
              "this_machine": {"cost_model": {"cost_ratio": 0.4, "verify_factor": {"0": 0.3, "2": 1.1}},
                               "best_lossless": {"draft_len": 2, "tokens_per_cost": 1.3}, "ceiling_best": 1.25}}
    text = render({**good, "lossless_source": source}, "study")
    assert "commit `e2f854d7f2fc`" in text and "FAST_NUMERICS 2" in text and "avx512_bf16 yes" in text
    assert "The study itself ran on older code (git:e001f3593e36)" in text
    assert "c = 0.400" in text and "v(L): 2: 1.10" in text and "L 2 at 1.30x target-only" in text
    assert "load average 1.50, 1.20, 1.00 (1 / 5 / 15 min) at the start, 2.00 at the end" in text
    assert "not ones to quote" not in text
    busy = render({**good, "lossless_source": {**source, "calibration_under_load": True}}, "study")
    assert "busy with other work" in busy and "not ones to quote" in busy
