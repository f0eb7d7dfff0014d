"""The certificate ledger from the command line: what a family of attempts holds, and moving rows between ledgers.

    python -m jobs.ledger show --benchmark gsm8k --pair qwen2.5-coder-0.5b+1.5b
    python -m jobs.ledger import OLD --ledger postgresql+psycopg://postgres@127.0.0.1:5432/spectune_ledger

``show`` lists the attempts on a benchmark and pair in their family's order: number, attempt id, study, when,
the level the family gives it, items used and each budget's decision, then what the next attempt would get.
``import`` adds to a ledger (``--ledger``, default ``$SPECTUNE_LEDGER``, else the asset cache's) the rows of
other ledgers: a ledger's URL or folder, or JSON-lines files (a carried archive's, an older version's); rows
are kept once, never replaced, and every imported attempt claims the items it used where no attempt holds them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from workers.cli import one_line_errors


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description="Show a family of confirmation attempts, or import ledger rows.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sh = sub.add_parser("show", help="the attempts on a benchmark and pair, and what the next one gets")
    sh.add_argument("--benchmark", required=True, help="a benchmark name (gsm8k, humaneval, ...) or task file")
    sh.add_argument("--pair", default=None, help="the model pair (a name or draft,target directories)")
    sh.add_argument("--pair-id", default=None, help="an endpoint's pair id instead of --pair")
    sh.add_argument("--alpha", type=float, default=0.05, help="the family's alpha, stated per budget (default 0.05)")
    im = sub.add_parser("import", help="add other ledgers' rows to this one (each row once)")
    im.add_argument("sources", nargs="+", help="ledger URLs or folders, or JSON-lines files of ledger rows")
    for p in (sh, im):
        p.add_argument("--ledger", default=None,
                       help="the ledger's SQLAlchemy URL or folder (default: $SPECTUNE_LEDGER, else the asset cache's)")
    return ap


def show(args: argparse.Namespace) -> None:
    from workers.benchmarks import get_benchmark
    from workers.certify.family import family_alpha
    from workers.results.ledger import ledger_for

    bench = get_benchmark(args.benchmark)
    ledger = ledger_for(bench, args.pair, args.pair_id, args.ledger)
    attempts = sorted(ledger.attempts().values(), key=lambda a: a.get("number") or 0)
    print(f"ledger {ledger.path}: {len(attempts)} attempt(s) on {bench.name}, pair {ledger.pair_id}")
    for a in attempts:
        k = a.get("number")
        level = f"{family_alpha(args.alpha, k):.4g}" if k else "?"
        decided = ", ".join(f"{float(b) * 100:g}% {'certified' if r.get('certified') else 'not certified'}"
                            for b, r in sorted(a["decided"].items(), key=lambda kv: float(kv[0]))) or "never decided"
        print(f"  #{k} {a['attempt']} ({a.get('when') or 'time not recorded'}{', reconstructed' if a.get('reconstructed') else ''}): "
              f"level {level}; {len(a['used'])} items used; {decided}; study {a.get('study')}")
    k = ledger.next_number()
    print(f"the next attempt is #{k}: each budget tested at {args.alpha:g} x 2^-{k} = {family_alpha(args.alpha, k):.4g}")


def import_rows(args: argparse.Namespace) -> None:
    from workers.results.ledger_store import ledger_url, shown, store

    into = store(ledger_url(args.ledger))
    total = 0
    for source in args.sources:
        path = Path(source)
        if path.is_file():
            added = into.import_file(path, f"import:{path.name}")
        elif "://" in source or path.is_dir():
            url = ledger_url(source)
            if url == into.url:
                raise ValueError(f"{source} is the ledger being imported into")
            added = into.import_rows(store(url).all_rows(), f"import:{shown(url)}")
        else:
            raise ValueError(f"{source}: no such file, folder or URL")
        print(f"{source}: {added} row(s) added")
        total += added
    print(f"{total} row(s) added to the ledger at {shown(into.url)}")


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cmd == "show":
        show(args)
    else:
        import_rows(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
