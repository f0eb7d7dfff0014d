"""Carry a sweep to another machine, and resume it there.

    python -m jobs.carry pack --run-dir ~/spectune_runs/sweeps/<study> --out <study>.tar.xz
    python -m jobs.carry unpack <study>.tar.xz        # then rerun the sweep's command: it resumes

The archive holds the run directory, the reference records of its pair and dtype and the ledger's attempts, each
file with its sha256 (``sweep.carry``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from workers.cli import one_line_errors


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description="Pack a sweep (run directory, references, ledger) into one verified "
                                             "archive, or unpack one where it was packed from.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    pk = sub.add_parser("pack", help="write the archive")
    pk.add_argument("--run-dir", required=True, help="the sweep's run directory")
    pk.add_argument("--out", required=True, help="the archive to write (.tar.xz)")
    pk.add_argument("--runs-root", default=None,
                    help="where the reference caches are (default: the runs root the study recorded in sweep.json)")
    pk.add_argument("--ledger", default=None, help="the certificate ledger: a SQLAlchemy URL or a folder (default: $SPECTUNE_LEDGER, else "
                                                   "<asset cache>/ledger)")
    up = sub.add_parser("unpack", help="restore an archive at the paths it was packed from")
    up.add_argument("archive")
    up.add_argument("--run-dir", default=None, help="check that the archive's run directory is this one")
    up.add_argument("--ledger", default=None, help="the ledger (URL or folder) to import its rows into (default: as for pack)")
    return ap


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    from sweep.carry import pack, unpack

    args = build_parser().parse_args(argv)
    if args.cmd == "pack":
        out = Path(args.out)
        manifest = pack(Path(args.run_dir), out, Path(args.runs_root) if args.runs_root else None,
                        args.ledger)
        by_part: dict[str, int] = {}
        for entry in manifest["files"]:
            by_part[entry["part"]] = by_part.get(entry["part"], 0) + 1
        print(f"packed study {manifest['study']} ({', '.join(f'{n} {k} files' for k, n in by_part.items())}; "
              f"{manifest['study_ledger_rows']} ledger rows of its own) into {out} ({out.stat().st_size / 2**20:.1f} MiB)"
              "; not packed: a --benchmark task file or --config file of your own, the assets (fetched again)")
        return 0
    got = unpack(Path(args.archive), ledger=args.ledger,
                 run_dir=Path(args.run_dir) if args.run_dir else None)
    print(f"unpacked study {got['study']} (packed {got['packed_at']}) into {got['run_dir']}: {got['run']} run files, "
          f"{got['references']} reference files written, {got['ledger rows']} ledger rows added; resume it with "
          f"{got['resume'] or 'the command that started it'} (its own settings, the dtype as resolved: "
          "--dtype auto may pick another on another machine)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
