"""Benchmark: the level of the certification decision and the planner's power, by exact enumeration.

    python -m jobs.bench.certify_level [--n 31,50,100,200,500,1319] [--budgets 0.05,0.1,0.2] [--grid 2001]

For each n and budget b, the worst type-I error at the budget boundary (true drop = b) over a grid of the
nuisance P(won), summed exactly over every outcome, of two decisions:

- the exact test (``workers.certify.exact.certify_paired``, what certifies today);
- a score-bound decision, certified when Tango's one-sided score bound is <= b, i.e. Z_b <= -z_{1-alpha}
  (what certified above n = 30 before the exact test).

Then the planner: at each (discordance, budget) the normal-approximation n and its exact power, next to
the exact plan's n and its power. No timing: every figure is a probability, exact up to float error.
"""

from __future__ import annotations

import argparse
import os
import time
from statistics import NormalDist

from workers.cli import one_line_errors


def parse_list(text: str, kind: type, flag: str) -> list:
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag} must be a comma-separated list of numbers, got {text!r}") from None
    if not values:
        raise ValueError(f"{flag} is empty")
    return values


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Exact type-I error of the certification decision, and planner power.")
    ap.add_argument("--n", default="31,50,100,200,500,1319", help="paired item counts")
    ap.add_argument("--budgets", default="0.05,0.1,0.2", help="budgets (fractions)")
    ap.add_argument("--alpha", type=float, default=0.05)
    ap.add_argument("--grid", type=int, default=2001, help="nuisance grid points")
    ap.add_argument("--plans", default="0.1:0.02,0.1:0.05,0.05:0.05", help="discordance:budget pairs to plan")
    args = ap.parse_args(argv)
    ns = parse_list(args.n, int, "--n")
    budgets = parse_list(args.budgets, float, "--budgets")
    if any(n < 1 for n in ns) or any(not 0 < b < 1 for b in budgets) or not 0 < args.alpha < 1 or args.grid < 2:
        raise ValueError("--n must be >= 1, --budgets and --alpha in (0, 1), --grid >= 2")
    plans = []
    for pair in args.plans.split(","):
        d, _, b = pair.partition(":")
        try:
            plans.append((float(d), float(b)))
        except ValueError:
            raise ValueError(f"--plans must be discordance:budget pairs, got {pair!r}") from None

    import numpy as np

    from workers.certify.decide import items_needed
    from workers.certify.exact import _lost_limits, _tail, critical_z, exact_plan, exact_power

    load0, t0 = os.getloadavg()[0], time.strftime("%Y-%m-%d %H:%M")
    z_score = -NormalDist().inv_cdf(1 - args.alpha)
    print(f"worst P(certified | drop = b) over {args.grid} nuisance points, alpha {args.alpha:g} (exact sums)")
    print("| n | budget | score-bound decision | exact test |\n|---:|---:|---:|---:|")
    for n in ns:
        for b in budgets:
            grid = np.linspace(0.0, (1 - b) / 2, args.grid)
            old = _tail(n, b, _lost_limits(n, b, z_score), grid).max()
            new = _tail(n, b, _lost_limits(n, b, critical_z(n, b, args.alpha)), grid).max()
            print(f"| {n} | {b:g} | {old:.4f} | {new:.4f} |", flush=True)
    print("\nplanner, 80% power, true drop 0")
    print("| discordance | budget | normal n | its exact power | exact n | its exact power |\n|---:|---:|---:|---:|---:|---:|")
    for d, b in plans:
        normal = items_needed(d, b, 0.0, args.alpha)
        exact = exact_plan(d, b, 0.0, args.alpha)
        print(f"| {d:g} | {b:g} | {normal} | {exact_power(normal, b, args.alpha, d):.3f} | {exact} | "
              f"{exact_power(exact, b, args.alpha, d):.3f} |", flush=True)
    print(f"\n{t0} -> {time.strftime('%H:%M')}, load(1m) {load0:.2f} before, {os.getloadavg()[0]:.2f} after, "
          f"{os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
