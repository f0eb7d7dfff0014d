"""Per-item flips: pairing a candidate's records with target-only's, the parquet file and the page."""

from __future__ import annotations

import dataclasses
import math

import polars as pl

from dashboards.flips import flips_page
from tests.workers.metrics.test_trial import rec
from workers.results.flips import COLUMNS, flip_rows, write_flips


def _with(r, text, answer, reason):
    return dataclasses.replace(r, outputs=[text], extracted=answer, reason=reason)


def test_flips_pair_items_say_lost_won_and_where_tokens_diverged(tmp_path):
    ref = {"a": _with(rec("a", 1.0, ids=[[5, 6, 7]]), "It is 7 <ok>", "7", "exact match 7"),
           "b": _with(rec("b", 0.0, ids=[[5, 6]]), "It is 3", "3", "mismatch 3, gold 4"),
           "c": rec("c", 1.0, ids=[[1, 2]]),
           "d": rec("d", 1.0, ids=[[9]])}
    cand = {"a": _with(rec("a", 0.0, ids=[[5, 9, 7]]), "It is 9", "9", "mismatch 9, gold 7"),
            "b": _with(rec("b", 1.0, ids=[[5, 6], [8]]), "It is 4", "4", "exact match 4"),
            "c": rec("c", 1.0, ids=[[1, 2]]),
            "d": rec("d", math.nan, error="engine died")}
    rows = flip_rows(["a", "b", "c", "d", "e"], ref, cand)
    assert [r["item_id"] for r in rows] == ["a", "b", "c", "d"], "e: neither arm has it"
    a, b, c, d = rows
    assert (a["flip"], a["diverged"], a["divergence"]) == ("lost", True, 1)
    assert (b["flip"], b["divergence"]) == ("won", 2), "b's candidate has one more turn: diverges where a ends"
    assert (c["flip"], c["diverged"], c["divergence"]) == ("same", False, -1)
    assert d["flip"] == "lost" and d["candidate_failed"] and d["candidate_reason"] == "failed: engine died"
    path = write_flips(tmp_path / "t" / "flips.parquet", rows)
    frame = pl.read_parquet(path)
    assert tuple(frame.columns) == COLUMNS and frame.height == 4
    assert frame.filter(pl.col("item_id") == "a")["candidate_text"].item() == "It is 9"
    assert pl.read_parquet(write_flips(tmp_path / "empty.parquet", [])).columns == list(COLUMNS)

    page = flips_page([("trial 3 kl_judge", path), ("missing", tmp_path / "nope.parquet")], "demo")
    assert "n = 4: lost 2, won 1; output diverged from target-only on 2 item(s)" in page
    assert page.index("<b>a</b>: lost") < page.index("<b>d</b>: lost") < page.index("<b>b</b>: won"), "lost first"
    assert "<pre>It is 7 &lt;ok&gt;</pre></td><td><pre>It is 9</pre>" in page, "side by side, escaped"
    assert "<b>c</b>" not in page and "missing" not in page
