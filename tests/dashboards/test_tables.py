"""Budget winners (long, wide, per budget), the parameter formatter and markdown rendering."""

from __future__ import annotations

import polars as pl

from dashboards.tables import (
    WINNER_COLUMNS,
    budget_table,
    budget_winners,
    chosen_per_budget,
    format_params,
    to_markdown,
)
from tests.dashboards.trialdata import frame, sweep, trial

BUDGETS = [0.05, 0.01, 0.02]  # unsorted on purpose: outputs are by budget


def _winners(df: pl.DataFrame) -> list[tuple[float, str, int]]:
    return list(zip(df["budget"].to_list(), df["family"].to_list(), df["trial"].to_list(), strict=True))


def test_budget_winners_known():
    winners = budget_winners(sweep(), BUDGETS)
    assert winners.columns == WINNER_COLUMNS
    # dropmatch is pruned-only and typical has a NaN speedup: neither can win anything.
    assert _winners(winners) == [
        (0.01, "kl_judge", 1), (0.01, "lossless", 0),
        (0.02, "kl_judge", 1), (0.02, "lossless", 0),
        (0.05, "kl_judge", 1), (0.05, "lossless", 0), (0.05, "top_k", 4),
    ]
    assert winners.filter(pl.col("trial") == 4)["speedup"].to_list() == [2.4]


def test_budget_winners_on_ci_upper_bound():
    # Upper bounds are drop + 0.02: 0 -> 0.02, 1 -> 0.03, 2 -> 0.04, 3 -> 0.05, 4 -> 0.07.
    winners = budget_winners(sweep(), BUDGETS, use_ci=True)
    assert _winners(winners) == [(0.02, "lossless", 0), (0.05, "kl_judge", 1), (0.05, "lossless", 0),
                                 (0.05, "top_k", 3)]


def test_chosen_per_budget():
    chosen = chosen_per_budget(sweep(), BUDGETS)
    assert {b: row["trial"] for b, row in chosen.items()} == {0.01: 1, 0.02: 1, 0.05: 4}
    assert chosen[0.05]["family"] == "top_k" and chosen[0.05]["draft_len"] == 6
    conservative = chosen_per_budget(sweep(), BUDGETS, use_ci=True)
    assert conservative[0.01] is None, "no upper bound is within 1%"
    # trials 1 and 3 tie at 1.9x; the smaller drop (trial 1: 1% vs 3%) wins.
    assert conservative[0.05]["trial"] == 1


def test_ties_and_float_tolerance():
    trials = frame(trial(0, "a", 2.0, 0.60, reference=0.62), trial(1, "a", 2.0, 0.61, reference=0.62),
                   trial(2, "a", 2.0, 0.61, reference=0.62))
    assert budget_winners(trials, [0.05])["trial"].to_list() == [1], "equal speed: smaller drop, then earlier trial"
    drop = frame(trial(0, "a", 1.7, 0.0)).with_columns(accuracy_drop=pl.lit(0.07000000000000001))
    assert budget_winners(drop, [0.07]).height == 1, "0.07 + float noise meets a 7% budget"


def test_other_speedup_column():
    winners = budget_winners(sweep(), [0.05], speedup="speedup_vs_lossless_measured")
    assert winners.filter(pl.col("family") == "top_k")["speedup"].round(6).to_list() == [round(0.9 * 2.4 / 1.5, 6)]


def test_budget_table_display():
    table = budget_table(sweep(), BUDGETS)
    assert table.columns == ["budget", "dropmatch", "kl_judge", "lossless", "top_k", "typical", "best"]
    assert table["budget"].to_list() == ["1%", "2%", "5%"]
    rows = {r["budget"]: r for r in table.iter_rows(named=True)}
    assert rows["1%"]["kl_judge"] == "1.90x (τ=0.5, conf=0.9, L=5)"
    assert rows["1%"]["top_k"] == "—" and rows["5%"]["dropmatch"] == "—"
    assert rows["5%"]["best"] == "2.40x top_k (k=8, L=6)"


def test_degenerate_inputs():
    empty = pl.DataFrame()
    assert budget_winners(empty, BUDGETS).height == 0
    assert chosen_per_budget(empty, BUDGETS) == {0.01: None, 0.02: None, 0.05: None}
    assert budget_table(empty, [0.01]).to_dicts() == [{"budget": "1%", "best": "—"}]
    assert budget_winners(sweep(), []).columns == WINNER_COLUMNS
    single = frame(trial(9, "top_k", 1.3, 0.615, params={"k": 2}))
    assert budget_winners(single, [0.01])["trial"].to_list() == [9]


def test_format_params():
    assert format_params("kl_judge", '{"confidence": 0.9, "threshold": 0.5}', 5) == "τ=0.5, conf=0.9, L=5"
    assert format_params("dropmatch", '{"criterion": "js", "k": 5, "p_drop": 0.3}', 4) == "K=5, p=0.3, js, L=4"
    assert format_params("lossless", "{}", 5) == "L=5"
    assert format_params("typical", '{"delta": 0.123456, "epsilon": 0.1}', None) == "ε=0.1, δ=0.123"
    assert format_params("new_rule", '{"alpha": 2}', 3) == "alpha=2, L=3"
    assert format_params("top_k", "not json", 3) == "not json, L=3"
    members = '{"members": [{"policy": "kl_judge", "params": {"threshold": 0.5}}, ["top_k", {"k": 4}]]}'
    assert format_params("any_of", members, 5) == "kl_judge(τ=0.5) + top_k(k=4), L=5"


def test_to_markdown():
    df = pl.DataFrame({"name": ["a|b", None], "x": [1.23456789, float("nan")], "n": [3, 4]})
    assert to_markdown(df) == ("| name | x | n |\n| --- | --- | --- |\n"
                               "| a\\|b | 1.235 | 3 |\n| — | — | 4 |\n")
    assert to_markdown(pl.DataFrame()) == ""
    assert to_markdown(pl.DataFrame(schema={"a": pl.Int64})) == "| a |\n| --- |\n"
    md = to_markdown(budget_table(sweep(), BUDGETS))
    assert "| 5% | — | 1.90x (τ=0.5, conf=0.9, L=5) | 1.50x (L=5) | 2.40x (k=8, L=6) | — | 2.40x top_k (k=8, L=6) |" in md
