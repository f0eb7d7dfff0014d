"""The frontier as a page: ``report/frontier.md`` (and its numbers as ``frontier.json``) from what
``workers.metrics.frontier.summary`` computed. Knows the summary's fields; computes nothing."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def _x(v: Any) -> str:
    return "—" if v is None or not isinstance(v, int | float) or not math.isfinite(v) else f"{v:.2f}x"


def _f(v: Any, fmt: str = ".2f") -> str:
    return "—" if v is None or not isinstance(v, int | float) or not math.isfinite(v) else format(v, fmt)


def render(data: Mapping[str, Any], title: str = "") -> str:
    cm = data["cost_model"]
    out = [f"# The frontier{': ' + title if title else ''}", "",
           f"Modelled costs in target-step units: a draft forward costs c = {_f(cm['cost_ratio'], '.3f')}, a verify "
           f"pass over L + 1 positions v(L) target steps (calibrated at load {_f(cm.get('calibration_load_1m'))}). "
           "Speeds are tokens per modelled cost over the best lossless's on the same items; the search's figures "
           "are descriptions (the certificates below decide, on items the search never saw).", "",
           "## Lossless at every L, and the ceiling", "",
           "| L | lossless: acceptance length | accepted share | over target-only | over the best lossless | "
           "ceiling (accept every draft): acceptance length | ceiling over the best lossless |",
           "|---:|---:|---:|---:|---:|---:|---:|"]
    for r, c in zip(data["lossless"], data["ceiling"], strict=True):
        best = " **(best)**" if r["draft_len"] == data["best_lossless"]["draft_len"] else ""
        name = "0 (target-only)" if r["draft_len"] == 0 else r["draft_len"]
        out.append(f"| {name}{best} | {_f(r['acceptance_length'])} | {_f(r['accepted_share'], '.1%')} | "
                   f"{_x(r['vs_target_only'])} | {_x(r['vs_best_lossless'])} | {c['acceptance_length']} | "
                   f"{_x(c['vs_best_lossless'])} |")
    n = data["lossless"][0]["items"] if data["lossless"] else 0
    out += ["", f"n = {n} search items. No acceptance rule at any L can exceed **{_x(data['ceiling_best'])}** the best "
            "lossless here: that is what a rule that accepted every draft token would buy at this cost ratio.", "",
            "## The search (descriptive)", "",
            "| trial | rule | L | state | n | lost / won | drop | discordance | acceptance length | over the best lossless "
            "| over target-only | Pareto |", "|---:|---|---:|---|---:|---|---:|---:|---:|---:|---:|---|"]
    front = set(data["pareto"])
    for r in data["trials"]:
        out.append(f"| {r['trial']} | {r['rule']} | {r['draft_len']} | {r['state'].lower()} | {r['items']} | "
                   f"{r['lost']} / {r['won']} | {_f(r['drop'] * 100 if math.isfinite(r['drop']) else None, '+.1f')}% | "
                   f"{_f(r['discordance'], '.3f')} | {_f(r['acceptance_length'])} | {_x(r['vs_best_lossless'])} | "
                   f"{_x(r['vs_target_only'])} | {'yes' if r['trial'] in front else ''} |")
    out += ["", "## The budgets", "",
            "| budget | certified | rule | p-value | bound | n | lost / won | over the best lossless (L): modelled / "
            "measured (model error) | over target-only: modelled / measured |", "|---|---|---|---|---|---|---|---|---|"]
    for b in data["budgets"]:
        vl, va = b.get("vs_lossless") or {}, b.get("vs_target_only") or {}
        rule = "—" if not b["rule"] else f"{b['rule']} ({', '.join(f'{k}={v}' for k, v in (b['params'] or {}).items())}, " \
                                         f"L={b['draft_len']})"
        err = vl.get("model_error")
        timed = (vl.get("timed") or {}).get("items")
        speed = (f"L {vl.get('draft_len')}: {_x(vl.get('modelled'))} / {_x(vl.get('measured'))}"
                 + (f" ({_f(err * 100 if isinstance(err, float) else None, '+.0f')}%, timed n = {timed})" if timed else "")
                 if vl else "—")
        out.append(f"| {b['budget'] * 100:g}% | {'**yes**' if b['certified'] else 'no'} | {rule} | "
                   f"{_f(b['p_value'], '.3g')} | {_f(b['bound'] * 100 if b['bound'] is not None else None)}% | "
                   f"{b['n'] or '—'} | {b['lost']} / {b['won']} | {speed} | "
                   f"{_x(va.get('modelled'))} / {_x(va.get('measured'))} |")
    lost = data.get("lost_items") or {}
    if lost:
        out += ["", "## Where the lost items are (confirmation)", ""]
        for label, items in lost.items():
            where = ", ".join(f"{i['item']} ({i['how']})" for i in items) or "none"
            out.append(f"- {label}: {len(items)} lost: {where}")
    return "\n".join(out) + "\n"


def write(data: Mapping[str, Any], out: Path, title: str = "") -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "frontier.json").write_text(json.dumps(data, indent=1, default=str, allow_nan=True) + "\n")
    (out / "frontier.md").write_text(render(data, title))
