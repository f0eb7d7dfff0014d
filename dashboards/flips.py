"""``report/flips.md``: the flipped items of each confirmed candidate and trial (``flips.parquet``, written by
``workers.results.flips``), both outputs side by side. Reads the parquet files; knows no records."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any


def summary(rows: list[dict[str, Any]]) -> dict[str, int]:
    return {"n": len(rows), "lost": sum(r["flip"] == "lost" for r in rows), "won": sum(r["flip"] == "won" for r in rows),
            "diverged": sum(bool(r["diverged"]) for r in rows)}


def flips_page(sections: list[tuple[str, Path]], title: str, per_section: int = 25) -> str:
    """Markdown for ``report/flips.md``: per ``(heading, flips.parquet)``, the counts and each flipped
    item (lost first) with both outputs side by side (an HTML table, as GitHub and MLflow render it)."""
    import polars as pl

    lines = [f"# Flipped items: {title}", "",
             "Items where the candidate's score differs from target-only's on the same item (lost: lower; won: "
             "higher), each with both outputs side by side. Descriptions, not certificates: a budget is decided on "
             "the confirmation split's evidence (see certification.md). n is the items both arms ran.", ""]
    for heading, path in sections:
        if not path.is_file():
            continue
        rows = pl.read_parquet(path).to_dicts()
        s = summary(rows)
        lines += [f"## {heading}", "",
                  f"n = {s['n']}: lost {s['lost']}, won {s['won']}; output diverged from target-only on {s['diverged']} "
                  f"item(s). Every row: `{path.name}` beside the records.", ""]
        flipped = sorted((r for r in rows if r["flip"] != "same"), key=lambda r: (r["flip"] != "lost", r["item_id"]))
        for r in flipped[:per_section]:
            where = f"first differs at output token {r['divergence']}" if r["diverged"] else "same tokens"
            lines += [f"<details><summary><b>{html.escape(r['item_id'])}</b>: {r['flip']} "
                      f"({r['reference_score']:g} → {r['candidate_score']:g}; {where})</summary>", "",
                      "<table><tr><th>target-only</th><th>candidate</th></tr>",
                      f"<tr><td>answer {html.escape(r['reference_answer'] or '-')}: "
                      f"{html.escape(r['reference_reason'] or '')}</td>"
                      f"<td>answer {html.escape(r['candidate_answer'] or '-')}: "
                      f"{html.escape(r['candidate_reason'] or '')}</td></tr>",
                      f"<tr><td><pre>{html.escape(r['reference_text'])}</pre></td>"
                      f"<td><pre>{html.escape(r['candidate_text'])}</pre></td></tr></table>", "</details>", ""]
        if len(flipped) > per_section:
            lines += [f"... and {len(flipped) - per_section} more in `{path}`.", ""]
    return "\n".join(lines) + "\n"
