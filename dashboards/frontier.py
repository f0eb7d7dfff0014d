"""The frontier as a page: ``report/frontier.md`` (and its numbers as ``frontier.json``) from what
``workers.metrics.frontier.summary`` computed. Knows the summary's fields; computes nothing. A page without its
lossless table (no lossless row at any L, or no best lossless) is refused (:func:`check`): every speed on it is
stated over the best lossless, and the ceiling is what bounds them."""

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
            "lossless here: that is what a rule that accepted every draft token would buy at this cost ratio.", ""]
    out += _source(data.get("lossless_source"))
    out += ["## The search (descriptive)", "",
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


def _source(src: Mapping[str, Any] | None) -> list[str]:
    """Where a lossless table recomputed after the study came from (``jobs.bench.frontier_lossless``), or nothing."""
    if not src:
        return []
    code, m, cal = src.get("code") or {}, src.get("machine") or {}, src.get("calibration") or {}
    here = src.get("this_machine") or {}
    best = here.get("best_lossless") or {}
    cm = here.get("cost_model") or {}
    vf = cm.get("verify_factor") or {}
    dirty = code.get("dirty_files") or []
    settings = src.get("settings") or {}
    study_code = src.get("study_code")
    return [
        "### Where this lossless table came from", "",
        f"Recomputed after the study, not by it (`python -m jobs.bench.frontier_lossless`, {src.get('at', '?')}): "
        f"target-only decoding on the study's {settings.get('items', '?')} search items, then lossless at every L by "
        f"replay, with code at commit `{str(code.get('commit', '?'))[:12]}`"
        + (f" ({len(dirty)} tracked file(s) differing from it in the working tree at the time: "
           "`lossless_source.code.dirty_files` in frontier.json)" if dirty else "")
        + f", the fast path's numerics FAST_NUMERICS {code.get('fast_numerics', '?')}, replay version "
        f"{code.get('replay_version', '?')}, {settings.get('actors', '?')} pair actor(s) at "
        f"{settings.get('threads_per_actor', '?')} thread(s) each, on {m.get('cpu', '?')} ({m.get('cpus', '?')} CPUs, "
        f"avx512_bf16 {'yes' if m.get('avx512_bf16') else 'no'}; {_loads(m)}). The token counts, and so the table, "
        "do not depend on the load. The study itself ran on older code"
        + (f" ({study_code})" if study_code else "") + ": its trials and certificates below are its own, "
        "and the table above is priced with its cost model (c and v(L) as its trials were), so the columns compare.",
        "",
        f"Priced with this machine's calibration instead (c = {_f(cm.get('cost_ratio'), '.3f')}, timed at "
        f"{cal.get('context', '?')} positions, load {_f(cal.get('load_1m'))}"
        + (" on a machine busy with other work: it timed the contention as much as the models, so these figures "
           "are not ones to quote" if src.get("calibration_under_load") else "") + "; v(L): "
        + ", ".join(f"{k}: {_f(v)}" for k, v in vf.items() if str(k) != "0")
        + f"): the best lossless is L {best.get('draft_len', '?')} at {_x(best.get('tokens_per_cost'))} target-only, "
        f"and the ceiling {_x(here.get('ceiling_best'))} the best lossless.", ""]


def _loads(m: Mapping[str, Any]) -> str:
    """The machine's load at the start and the end, as ``uptime`` put it (1, 5 and 15 minutes) where it did."""
    def avg(text: Any, fallback: Any) -> str:
        got = str(text or "").rpartition("load average:")[2].strip()
        return f"{got} (1 / 5 / 15 min)" if got else _f(fallback)

    return f"load average {avg(m.get('uptime'), m.get('load_1m'))} at the start, " \
           f"{avg(m.get('uptime_after'), m.get('load_1m_after'))} at the end"


def check(data: Mapping[str, Any]) -> None:
    """ValueError unless the page has its lossless table: a lossless row at some L and a finite best lossless."""
    rows = data.get("lossless") or []
    best = (data.get("best_lossless") or {}).get("tokens_per_cost")
    if not rows or not any(r.get("items") for r in rows):
        raise ValueError("the frontier page has no lossless row at any L (no lossless records were held when it was "
                         "computed): every speed on it is stated over the best lossless, so it is not written")
    if not isinstance(best, int | float) or not math.isfinite(best):
        raise ValueError(f"the frontier page's best lossless is {best!r}, not a number (no L's lossless records could "
                         "be priced): every speed on it is stated over the best lossless, so it is not written")


def write(data: Mapping[str, Any], out: Path, title: str = "") -> None:
    """``frontier.json`` and ``frontier.md`` under ``out``; nothing is written for a page :func:`check` refuses."""
    check(data)
    out.mkdir(parents=True, exist_ok=True)
    (out / "frontier.json").write_text(json.dumps(data, indent=1, default=str, allow_nan=True) + "\n")
    (out / "frontier.md").write_text(render(data, title))
