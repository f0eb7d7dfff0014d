"""Sample-size planner: how many paired items a certificate of an accuracy budget needs.

    python -m jobs.plan --discordance 0.1 --budget 0.02
    python -m jobs.plan --records runs/.../trial --reference runs/.../target-only --budget 0.01,0.02,0.05
    python -m jobs.plan --discordance 0.3 --budget 0.02,0.05 --pools gsm8k,humaneval+math500

From numbers, or from a pilot: two record directories (a trial run and its reference, as written
by ``workers.results.store.RecordStore``), paired by item id; a failed item scores 0 in its arm. For right/wrong
scores the plan is exact (``workers.certify.exact.exact_plan``): the smallest n at which the exact test
that certifies reaches the wanted power, by summing over every outcome (the normal approximation, about
6.2 d / (b - drop)^2 at alpha = .05, under-plans: 0.67-0.79 power where it promises 0.80,
``python -m jobs.bench.certify_level``). For bounded
scores (a pilot whose scores are not all 0/1) it stays the normal approximation, and the betting bound
that certifies them needs roughly twice that. The power is that of one candidate tested alone: the first
of a fixed sequence. ``--looks K`` also plans a group-sequential confirmation (the sweep's ``--looks``): the
smallest largest-N whose K looks reach the power, and the items it expects to use (exact enumeration,
``workers.certify.sequential``). ``--pools`` says, per benchmark pool, which budgets it can reach: the pool is
every item a sweep can confirm on (both splits, less the search sample of ``--search-items``; ``a+b`` pools
several benchmarks), and the smallest budget it can certify at the same discordance and power. Where the pool is
smaller than the plan, the limit is data, not compute. Knows nothing about models, Ray or MLflow.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from workers.certify.decide import ALPHA, DropBound, certifies, drop_bound, items_needed, passes
from workers.certify.exact import METHOD as EXACT
from workers.certify.exact import exact_plan
from workers.certify.sequential import sequential_plan
from workers.cli import one_line_errors


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description="Items a certified accuracy-drop budget needs (exact power of the test that certifies).")
    ap.add_argument("--discordance", type=float, default=None,
                    help="share of items whose correctness differs between the arms (bounded scores: mean squared difference)")
    ap.add_argument("--drop", type=float, default=0.0, help="assumed true drop with --discordance (default 0)")
    ap.add_argument("--records", default=None, help="pilot: the trial's record directory")
    ap.add_argument("--reference", default=None, help="pilot: the reference (target-only) record directory")
    ap.add_argument("--budget", required=True, help="budget(s) as fractions, comma-separated: 0.01,0.02,0.05")
    ap.add_argument("--alpha", type=float, default=ALPHA, help="one-sided error of the certificate (default 0.05)")
    ap.add_argument("--power", type=float, default=0.8, help="wanted probability of certifying (default 0.8)")
    ap.add_argument("--looks", type=int, default=1,
                    help="also plan a group-sequential confirmation with this many looks (the sweep's --looks): its "
                         "largest N and the items it expects to use (right/wrong scores)")
    ap.add_argument("--attempt", type=int, default=None,
                    help="plan for the K-th confirmation attempt on its benchmark and pair: it is tested at "
                         "alpha x 2^-K, the family's share (workers.certify.family)")
    ap.add_argument("--benchmark", default=None, help="with --pair: plan for the next attempt the ledger would open")
    ap.add_argument("--pair", default=None, help="with --benchmark: the model pair (a name or draft,target dirs)")
    ap.add_argument("--pair-id", default=None, help="with --benchmark: an endpoint's pair id instead of --pair")
    ap.add_argument("--ledger", default=None,
                    help="the ledger's SQLAlchemy URL or folder (default: $SPECTUNE_LEDGER, else the asset cache's)")
    ap.add_argument("--pools", default=None,
                    help="benchmarks whose confirmation pools to check against the plan, comma-separated ('all' for "
                         "every registered one; 'a+b' pools benchmarks together): which budgets each can reach")
    ap.add_argument("--search-items", type=int, default=64,
                    help="with --pools: the search sample a sweep takes out of the pool first (default 64)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return ap


POOL_MARGIN = 1.5  # --pools: a budget whose approximate plan needs this many times the largest pool is not planned exactly
EXACT_LIMIT = 2_000  # items: a larger plan is the normal approximation (the exact one takes many minutes there)


def pool_sizes(spec: str, search_items: int) -> dict[str, int]:
    """{pool name: items a sweep could confirm on}: each benchmark's items in both splits (few-shot exemplars are in
    neither), less the search sample (``--search-items``, at most the search split); ``a+b`` adds the pools."""
    from workers.benchmarks import BENCHMARKS, get_benchmark
    from workers.benchmarks.base import load_entry_points

    if search_items < 0:
        raise ValueError(f"--search-items must be >= 0, got {search_items}")
    load_entry_points()
    names = sorted(BENCHMARKS) if spec.strip() == "all" else [p.strip() for p in spec.split(",") if p.strip()]
    if not names:
        raise ValueError(f"--pools names no benchmark: {spec!r}")
    sizes: dict[str, int] = {}
    for pool in names:
        total = 0
        for name in pool.split("+"):
            bench = get_benchmark(name.strip())
            search = len(bench.items(split="search"))
            total += search - min(search_items, search) + len(bench.items(split="confirm"))
        sizes[pool] = total
    return sizes


def smallest_budget(d: float, drop: float, alpha: float, power: float, pool: int) -> float | None:
    """The smallest budget whose plan (normal approximation) fits in ``pool`` items, to 0.01%; None if none under
    100% does. The exact plan is within a few percent of it in items; the budgets asked are planned exactly."""
    lo, hi = max(drop, 0.0), 1.0
    if (items_needed(d, hi, drop, alpha, power) or pool + 1) > pool:
        return None
    while hi - lo > 1e-4:
        mid = (lo + hi) / 2
        need = items_needed(d, mid, drop, alpha, power) if mid > drop else None
        lo, hi = (lo, mid) if need is not None and need <= pool else (mid, hi)
    return hi


def family_level(args: argparse.Namespace) -> tuple[float, dict[str, Any] | None]:
    """The level the planned attempt is tested at, and what its family says (None: --alpha as given, no family
    named)."""
    from workers.certify.family import SPENDING, family_alpha

    if (args.benchmark is None) != (args.pair is None and args.pair_id is None):
        raise ValueError("--benchmark needs --pair (or --pair-id), and --pair needs --benchmark")
    number, where = args.attempt, None
    if args.benchmark is not None:
        from workers.benchmarks import get_benchmark
        from workers.results.ledger import ledger_for

        ledger = ledger_for(get_benchmark(args.benchmark), args.pair, args.pair_id, args.ledger)
        found = ledger.next_number()
        if number is not None and number != found:
            raise ValueError(f"--attempt {number}: the ledger at {ledger.path} would open attempt #{found} next")
        number, where = found, ledger.path
    if number is None:
        return args.alpha, None
    if number < 1:
        raise ValueError(f"--attempt must be >= 1, got {number}")
    level = family_alpha(args.alpha, number)
    return level, {"number": number, "spending": SPENDING, "alpha": args.alpha, "level": level, "ledger": where}


def parse_budgets(text: str) -> list[float]:
    try:
        budgets = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--budget must be numbers separated by commas, got {text!r}") from None
    if not budgets or any(not 0.0 < b <= 1.0 for b in budgets):
        raise ValueError(f"--budget values must be fractions in (0, 1] (2% is 0.02), got {text!r}")
    return budgets


def load_scores(directory: str, flag: str) -> dict[str, float]:
    from workers.results.store import RecordStore  # polars and the engine's imports: only for a pilot

    records = RecordStore(directory).load()
    if not records:
        raise ValueError(f"{flag} {directory} holds no records (expected records.jsonl from a run)")
    return {item: 0.0 if rec.failed else float(rec.score) for item, rec in records.items()}


def pilot(args: argparse.Namespace) -> tuple[dict[str, Any], DropBound]:
    trial = load_scores(args.records, "--records")
    reference = load_scores(args.reference, "--reference")
    items = sorted(trial.keys() & reference.keys())
    if not items:
        raise ValueError("--records and --reference share no item ids: they are not runs of the same items")
    bound = drop_bound([reference[i] for i in items], [trial[i] for i in items], args.alpha)
    return {"items": len(items), "only_in_records": len(trial.keys() - reference.keys()),
            "only_in_reference": len(reference.keys() - trial.keys()), "bound": bound.to_dict(),
            "discordance": bound.discordance, "drop": bound.drop, "plan_d": bound.mean_sq}, bound


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    budgets = parse_budgets(args.budget)
    if args.looks < 1:
        raise ValueError(f"--looks must be >= 1, got {args.looks}")
    for flag, value in (("--alpha", args.alpha), ("--power", args.power)):
        if not 0.0 < value < 1.0:
            raise ValueError(f"{flag} must be in (0, 1), got {value}")
    from_pilot = args.records is not None or args.reference is not None
    if from_pilot == (args.discordance is not None):
        raise ValueError("give either --discordance D, or --records DIR with --reference DIR")
    if from_pilot:
        if args.records is None or args.reference is None:
            raise ValueError("a pilot needs both --records DIR and --reference DIR")
        observed, pilot_bound = pilot(args)
        d, drop = observed["plan_d"], observed["drop"]
    else:
        if not 0.0 <= args.discordance <= 1.0:
            raise ValueError(f"--discordance must be in [0, 1], got {args.discordance}")
        if not abs(args.drop) <= args.discordance:
            raise ValueError(f"--drop must be within +-discordance ({args.discordance}), got {args.drop}")
        observed, d, drop = None, args.discordance, args.drop
    level, family = family_level(args)
    stated = args.alpha
    args = argparse.Namespace(**{**vars(args), "alpha": level})  # every figure below at the attempt's level
    rows = []
    exact = observed is None or observed["bound"]["method"] == EXACT
    sizes = pool_sizes(args.pools, args.search_items) if args.pools is not None else {}
    for b in budgets:
        normal = items_needed(d, b, drop, args.alpha, args.power)
        # an exact plan far beyond every pool asked about decides nothing, and one of thousands of items costs many
        # minutes (the enumeration grows with n^2): the approximation, which under-plans by a few percent, says so
        beyond = bool(sizes) and normal is not None and normal > POOL_MARGIN * max(sizes.values())
        huge = normal is not None and normal > EXACT_LIMIT
        need = exact_plan(d, b, drop, args.alpha, args.power) if exact and normal is not None and not (beyond or huge) \
            else normal
        how = ("normal approximation, far beyond every pool" if beyond else
               f"normal approximation, over {EXACT_LIMIT:,} items (the exact plan is a few percent more)" if huge and exact
               else "exact power" if exact else "normal approximation")
        row: dict[str, Any] = {"budget": b, "items_needed": need, "plan": how}
        if observed is not None:
            tested = passes(pilot_bound, b)
            row["certified_by_pilot"] = certifies(tested)
            row["p_value"] = None if math.isnan(tested.p_value) else tested.p_value
        if args.looks > 1 and exact and normal is not None and how == "exact power":
            seq = sequential_plan(d, b, args.looks, drop, args.alpha, args.power)
            if seq is not None:
                plan, got, expected = seq
                row["sequential"] = {"looks": list(plan.sizes), "levels": list(plan.alphas), "power": got,
                                     "expected_items": expected, "max_items": plan.n,
                                     "fixed_items_same_power": exact_plan(d, b, drop, args.alpha, min(got, 0.999))}
        rows.append(row)
    pools = None
    if args.pools is not None:
        pools = []
        for name, size in sizes.items():
            reach = {f"{row['budget']:g}": row["items_needed"] is not None and row["items_needed"] <= size
                     for row in rows}
            pools.append({"pool": name, "items": size, "reaches": reach,
                          "smallest_budget": smallest_budget(d, drop, args.alpha, args.power, size)})
    out = {"alpha": args.alpha, "stated_alpha": stated, "pools": pools, "family": family, "power": args.power, "discordance": d if observed is None else observed["discordance"],
           "drop": drop, "pilot": observed, "budgets": rows}
    print(json.dumps(out, indent=2) if args.json else render(out))
    return 0


def render(out: dict[str, Any]) -> str:
    lines = []
    fam = out.get("family")
    if fam:
        lines.append(f"attempt #{fam['number']} of its family"
                     + (f" (the next the ledger at {fam['ledger']} opens)" if fam.get("ledger") else "")
                     + f": tested at {fam['alpha']:g} x 2^-{fam['number']} = {fam['level']:.4g}")
    p = out["pilot"]
    if p is not None:
        b = p["bound"]
        extra = f" ({p['only_in_records']} only in --records, {p['only_in_reference']} only in --reference, ignored)" \
            if p["only_in_records"] or p["only_in_reference"] else ""
        lines.append(f"pilot: {p['items']} paired items{extra}: drop {b['drop']:.4f}, discordance {b['discordance']:.3f}, "
                     f"upper bound {b['upper']:.4f} ({b['method']}, alpha {out['alpha']:g})")
    rows = out["budgets"]
    if p is None and len(rows) == 1:
        need = rows[0]["items_needed"]
        lines.append(f"{'never' if need is None else need} items needed for budget {rows[0]['budget']:g}")
    else:
        lines.append(f"{'budget':>8}  {'items needed':>12}" + ("  certified by the pilot" if p else ""))
        for row in rows:
            need = "never" if row["items_needed"] is None else f"{row['items_needed']:,}"
            lines.append(f"{row['budget']:>8g}  {need:>12}"
                         + (f"  {'yes' if row['certified_by_pilot'] else 'no'}" if p else "")
                         + (f"  ({row['plan']})" if row["plan"].startswith("normal approximation,") else ""))
    for row in rows:
        seq = row.get("sequential")
        if seq:
            lines.append(f"  {row['budget']:g} with {len(seq['looks'])} looks (at {', '.join(f'{n:,}' for n in seq['looks'])} "
                         f"items): {seq['power']:.0%} power, {seq['expected_items']:,.1f} items expected; a fixed-n "
                         f"design with that power needs {seq['fixed_items_same_power']:,}: "
                         + ("the looks save items on average" if seq["expected_items"] < seq["fixed_items_same_power"]
                            else "the looks save nothing here"))
    if out.get("pools"):
        budgets = [f"{row['budget']:g}" for row in rows]
        lines.append(f"{'pool':>24}  {'items':>7}  " + "  ".join(f"{b:>6}" for b in budgets) + "  smallest budget")
        for pool in out["pools"]:
            low = pool["smallest_budget"]
            lines.append(f"{pool['pool']:>24}  {pool['items']:>7,}  "
                         + "  ".join(f"{'yes' if pool['reaches'][b] else 'no':>6}" for b in budgets)
                         + f"  {'none' if low is None else f'~{low:.2%}'}")
        lines.append("A pool reaches a budget when it holds the items the plan needs (both splits, less the search "
                     "sample); where it does not, the limit is data, not compute.")
    drop = out["drop"]
    plans = {row["plan"] for row in rows}
    how = plans.pop() if len(plans) == 1 else "exact power unless its row says otherwise"
    lines.append(f"Paired items for a certificate at alpha {out['alpha']:.4g} with {out['power']:.0%} power at true drop "
                 f"{drop:.4f} and discordance {out['discordance']:.3f}, one candidate tested alone ({how}); "
                 f"'never' where the drop is at or above the budget."
                 + ("" if fam else " An attempt is tested at its family's share: the k-th on a benchmark and pair at "
                    "alpha x 2^-k (--attempt K, or --benchmark and --pair for the ledger's next)."))
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main(None))
