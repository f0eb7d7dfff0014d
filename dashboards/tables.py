"""The quality-constrained speedup table: per accuracy budget, the fastest rule that stays within it.

Like Judge Decoding's Tables 6-7: rows are budgets on the accuracy drop vs target-only, columns
are rule families plus the best across them, and a cell is the best speedup among COMPLETE trials
whose drop is within the budget, with that trial's settings. ``budget_winners`` is the tidy
(machine) form; ``budget_table`` the display form; ``to_markdown`` renders either.
"""

from __future__ import annotations

import json
import math
from typing import Any

import polars as pl

from dashboards.frames import completed, normalise_trials

# Accuracy drops are means of per-item differences, so a drop of exactly 7 items in 100 can come
# out as 0.07000000000000001; without a tolerance it would miss the 7% budget it meets.
_TOLERANCE = 1e-9

WINNER_COLUMNS = ["budget", "family", "trial", "speedup", "accuracy", "accuracy_drop", "params", "draft_len"]

# Short names for knobs, so a table cell stays readable ("τ=0.5" rather than "threshold=0.5").
_SYMBOLS: dict[str, dict[str, str]] = {
    "kl_judge": {"threshold": "τ", "confidence": "conf"},
    "dropmatch": {"k": "K", "p_drop": "p", "num_candidates": "M"},
    "top_k": {"k": "k"},
    "relaxed_topk": {"n": "n", "delta": "δ"},
    "typical": {"epsilon": "ε", "delta": "δ"},
    "target_entropy": {"threshold": "H≥"},
    "draft_entropy": {"threshold": "H≤"},
    "fly": {"window": "W", "entropy_threshold": "H≥", "top_k": "k"},
}
# Choice knobs whose value alone says it all ("js" rather than "criterion=js").
_BARE = {"criterion", "mode"}


def _value(v: Any) -> str:
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def _params_text(family: str, params: dict[str, Any]) -> list[str]:
    if family == "any_of" and isinstance(params.get("members"), list):
        parts = []
        for member in params["members"]:
            # Members come as {"policy", "params"} (Rule.describe) or as (name, params) pairs.
            name, sub = ((member.get("policy"), member.get("params")) if isinstance(member, dict)
                         else (member[0], member[1]) if isinstance(member, list) and len(member) == 2
                         else (str(member), {}))
            inner = ", ".join(_params_text(str(name), sub if isinstance(sub, dict) else {}))
            parts.append(f"{name}({inner})" if inner else str(name))
        return [" + ".join(parts)]
    symbols = _SYMBOLS.get(family, {})
    # The family's main knob first (``_SYMBOLS`` order), not JSON's alphabetical order.
    rank = {k: i for i, k in enumerate(symbols)}
    params = dict(sorted(params.items(), key=lambda kv: rank.get(kv[0], len(rank))))
    return [_value(v) if k in _BARE else f"{symbols.get(k, k)}={_value(v)}" for k, v in params.items()]


def format_params(family: str, params_json: str | None, draft_len: int | None) -> str:
    """Compact settings of a trial, e.g. ``"τ=0.5, conf=0.9, L=5"`` (no surrounding parentheses).

    Unknown families show raw knob names; unparsable params are shown as given.
    """
    parts: list[str] = []
    if params_json:
        try:
            params = json.loads(params_json)
        except (TypeError, ValueError):
            params = None
        if isinstance(params, dict):
            parts.extend(_params_text(family, params))
        else:
            parts.append(str(params_json))
    if draft_len is not None:
        parts.append(f"L={draft_len}")
    return ", ".join(parts)


def _drop_column(use_ci: bool) -> str:
    return "accuracy_drop_ci_hi" if use_ci else "accuracy_drop"


def budget_winners(trials: pl.DataFrame, budgets: list[float] | tuple[float, ...], *,
                   speedup: str = "speedup_vs_ar_modelled", use_ci: bool = False) -> pl.DataFrame:
    """One row per (budget, family) with a feasible trial: the family's fastest COMPLETE trial
    whose accuracy drop (its 95% upper bound when ``use_ci``) is at most the budget.

    Ties on speedup go to the smaller drop, then the earlier trial, so the result is deterministic.
    Columns: ``WINNER_COLUMNS``; sorted by budget, then family.
    """
    drop = _drop_column(use_ci)
    done = completed(trials, speedup, drop)
    frames = []
    for b in sorted(set(budgets)):
        feasible = done.filter(pl.col(drop) <= b + _TOLERANCE)
        best = (feasible.sort([speedup, "accuracy_drop", "trial"], descending=[True, False, False],
                              nulls_last=True)
                .unique(subset="family", keep="first", maintain_order=True))
        frames.append(best.select(
            pl.lit(float(b)).alias("budget"), "family", "trial", pl.col(speedup).alias("speedup"),
            "accuracy", "accuracy_drop", "params", "draft_len"))
    if not frames:
        return pl.DataFrame(schema={"budget": pl.Float64, "family": pl.String, "trial": pl.Int64,
                                    "speedup": pl.Float64, "accuracy": pl.Float64,
                                    "accuracy_drop": pl.Float64, "params": pl.String, "draft_len": pl.Int64})
    return pl.concat(frames).sort(["budget", "family"])


def chosen_per_budget(trials: pl.DataFrame, budgets: list[float] | tuple[float, ...], *,
                      speedup: str = "speedup_vs_ar_modelled", use_ci: bool = False) -> dict[float, dict | None]:
    """Per budget, the overall winner's ``budget_winners`` row as a dict, or None if no trial fits."""
    winners = budget_winners(trials, budgets, speedup=speedup, use_ci=use_ci)
    chosen: dict[float, dict | None] = {}
    for b in sorted(set(budgets)):
        rows = (winners.filter(pl.col("budget") == float(b))
                .sort(["speedup", "accuracy_drop", "trial"], descending=[True, False, False]))
        chosen[float(b)] = rows.row(0, named=True) if rows.height else None
    return chosen


def budget_label(budget: float) -> str:
    return f"{100 * budget:g}%"


def _cell(row: dict[str, Any], with_family: bool = False) -> str:
    family = f"{row['family']} " if with_family else ""
    return f"{row['speedup']:.2f}x {family}({format_params(row['family'], row['params'], row['draft_len'])})"


def budget_table(trials: pl.DataFrame, budgets: list[float] | tuple[float, ...], *,
                 speedup: str = "speedup_vs_ar_modelled", use_ci: bool = False) -> pl.DataFrame:
    """Display form: one row per budget (``budget`` as text, e.g. ``"1%"``), one string column per
    family present in ``trials`` (also pruned-only ones, shown as "—") and ``best``; a cell reads
    ``"1.42x (τ=0.5, L=5)"``, the ``best`` cell also names the family."""
    families = sorted(normalise_trials(trials)["family"].drop_nulls().unique().to_list())
    winners = budget_winners(trials, budgets, speedup=speedup, use_ci=use_ci)
    chosen = chosen_per_budget(trials, budgets, speedup=speedup, use_ci=use_ci)
    rows = []
    for b in sorted(set(budgets)):
        at_b = {r["family"]: r for r in winners.filter(pl.col("budget") == float(b)).iter_rows(named=True)}
        row = {"budget": budget_label(b)}
        row.update({f: _cell(at_b[f]) if f in at_b else "—" for f in families})
        best = chosen[float(b)]
        row["best"] = _cell(best, with_family=True) if best else "—"
        rows.append(row)
    schema = {c: pl.String for c in ["budget", *families, "best"]}
    return pl.DataFrame(rows, schema=schema) if rows else pl.DataFrame(schema=schema)


def _markdown_cell(v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    text = f"{v:.4g}" if isinstance(v, float) else str(v)
    # A bare "|" would split the cell; newlines would end the row.
    return text.replace("|", "\\|").replace("\n", " ")


def to_markdown(df: pl.DataFrame) -> str:
    """``df`` as a GitHub markdown table (floats to 4 significant digits, null/NaN as "—").
    A frame with no columns gives an empty string; one with no rows, just the header."""
    if not df.columns:
        return ""
    lines = ["| " + " | ".join(_markdown_cell(c) for c in df.columns) + " |",
             "| " + " | ".join("---" for _ in df.columns) + " |"]
    lines += ["| " + " | ".join(_markdown_cell(v) for v in row) + " |" for row in df.iter_rows()]
    return "\n".join(lines) + "\n"


def _pct_or_dash(v: Any, signed: bool = False) -> str:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
        return "—"
    return f"{100 * v:+.2f}%" if signed else f"{100 * v:.2f}%"


def _speed(confirm: dict[str, Any], name: str) -> str:
    est, lo, hi = (confirm.get(f"speed.{name}{s}") for s in ("", "_lo", "_hi"))
    if not isinstance(est, (int, float)) or not math.isfinite(est):
        return "—"
    if isinstance(lo, (int, float)) and isinstance(hi, (int, float)) and math.isfinite(lo) and math.isfinite(hi):
        return f"{est:.2f}x [{lo:.2f}, {hi:.2f}]"
    return f"{est:.2f}x"


def _over_lossless(choice: dict[str, Any]) -> str:
    """'L 4: 1.08x / 1.02x (timed 8)': over lossless at its best L, modelled on the certificate's items and
    measured like for like on the timed ones."""
    vl = choice.get("vs_lossless")
    if not vl:
        return "—"

    def x(v: Any) -> str:
        return f"{v:.2f}x" if isinstance(v, float) and math.isfinite(v) else "—"

    timed = (vl.get("timed") or {}).get("items")
    name = "L 0 (target-only)" if vl["draft_len"] == 0 else f"L {vl['draft_len']}"
    return f"{name}: {x(vl.get('modelled'))} / {x(vl.get('measured'))}" + (f" (timed {timed})" if timed else "")


def certification_table(choices: list[dict[str, Any]], noise_floors: list[dict[str, Any]] | None = None) -> str:
    """The certified-budget table (markdown): per budget, certified or not, the rule, the exact test's
    p-value, the one-sided upper bound of the drop on the confirmation split, the observed drop, n, discordance, the items a
    certificate would need, and speed on the confirmation items (ratios of sums, with intervals);
    then the noise floor (lossless vs target-only) as rows of its own."""
    header = ["budget", "certified", "rule", "p-value", "drop bound (1-α)", "drop", "n", "discordance", "items needed",
              "over the best lossless: modelled / measured", "modelled speedup / token", "measured speedup / token",
              "modelled / answer", "measured / answer"]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    for c in choices:
        cert = c.get("certification") or {}
        confirm = c.get("confirm") or {}
        rule = (f"{c['policy']} ({format_params(c['policy'], json.dumps(c.get('params') or {}), c.get('draft_len'))})"
                if c.get("policy") else "—")
        needed = cert.get("items_needed")
        p_value = cert.get("p_value")
        verdict = "**yes**" if c.get("certified") else "**refuted**" if cert.get("verdict") == "refuted" else "no"
        cells = [budget_label(float(c["budget"])), verdict, rule,
                 f"{p_value:.3g}" if isinstance(p_value, float) else "—", _pct_or_dash(cert.get("bound")), _pct_or_dash(cert.get("drop"), True), str(cert.get("n") or "—"),
                 f"{cert['discordance']:.3f}" if isinstance(cert.get("discordance"), float)
                 and math.isfinite(cert["discordance"]) else "—",
                 "—" if c.get("certified") or needed is None else f"{needed:,}", _over_lossless(c),
                 _speed(confirm, "modelled_per_token"), _speed(confirm, "measured_per_token"),
                 _speed(confirm, "modelled_per_answer"), _speed(confirm, "measured_per_answer")]
        lines.append("| " + " | ".join(_markdown_cell(x) for x in cells) + " |")
    for nf in noise_floors or []:
        cells = [f"noise floor (lossless L={nf.get('draft_len')})", "—",
                 f"lossless vs target-only (outputs differ on {_pct_or_dash(nf.get('output_divergence'))})",
                 "—",
                 (f"[{_pct_or_dash(nf['drop_lo'], True)}, {_pct_or_dash(nf['drop_hi'], True)}] (two-sided)"
                  if isinstance(nf.get("drop_lo"), float) and isinstance(nf.get("drop_hi"), float)
                  else _pct_or_dash(nf.get("bound.upper"))), _pct_or_dash(nf.get("bound.drop"), True),
                 str(nf.get("items", "—")),
                 f"{nf['bound.discordance']:.3f}" if isinstance(nf.get("bound.discordance"), float)
                 and math.isfinite(nf["bound.discordance"]) else "—",
                 "—", "—", "—", "—", "—", "—"]
        lines.append("| " + " | ".join(_markdown_cell(x) for x in cells) + " |")
    alpha = next((c["certification"]["alpha"] for c in choices if c.get("certification")), 0.05)
    lines.append("")
    lines.append(f"Certified = \"the paired accuracy drop vs target-only is at least the budget\" rejected at level "
                 f"{alpha:g} on confirmation items the search never saw (right/wrong scores: an exact test, its "
                 "p-value shown; bounded scores: a betting bound), per budget, fixed-sequence over candidates, safest "
                 f"first. The drop bound is the one-sided {100 * (1 - alpha):g}% bound the same test gives. Speed "
                 "intervals are paired bootstrap descriptions.")
    return "\n".join(lines) + "\n"
