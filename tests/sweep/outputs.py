"""What a tiny-pair sweep leaves in ``report/``, with what legitimately differs between two runs taken out.

A refactor of the sweep must leave its outputs field for field the same. :data:`ARGS` fix c and v
(``--cost-ratio``, ``--verify-factor``): with a calibrated v(L), the modelled speeds, and with them which of two
equally safe candidates is confirmed first, follow the machine's load. They run one actor: with two, which actor
decoded an item (and so what its prefix cache held, which moves fp32 logits in the last bits: the tiny pair's
near-ties flip) followed the load too, and once confirmed the other of two equally safe candidates. Two runs of one command then differ only
in times (seconds, timed speeds), run ids, attempt ids, dates and the temporary paths; ``normalized`` masks exactly those and keeps every other
field: the decisions, p-values, bounds, n, lost / won, the per-item evidence, the trials' knobs and search
figures that do not depend on timing, and the set of files written.

    .venv/bin/python -m tests.sweep.outputs capture tests/sweep/golden/tiny-sweep.json   # rewrite the golden

``tests/sweep/test_outputs.py`` runs :data:`ARGS` and compares with the golden file.
"""

from __future__ import annotations

import csv
import json
import math
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

ARGS = ["--benchmark", "gsm8k", "--pair", "tiny-random", "--dtype", "fp32", "--items", "6", "--max-new-tokens", "8",
        "--actors", "1", "--budgets", "0.05,0.2", "--policies", "kl_judge,top_k", "--draft-len", "2,4",
        "--cost-ratio", "0.4", "--verify-factor", "1.2", "--min-items-to-prune", "4", "--trials", "3", "--speed-items", "1"]
GOLDEN = Path(__file__).with_name("golden") / "tiny-sweep.json"
MASK = "<varies>"

# keys whose values come from clocks (seconds, timed runs, the calibrated verify cost a modelled speed uses),
# ids or dates: two runs of one command differ there and nowhere else
TIMED = re.compile(r"time|wall|_s$|speed|measured|modelled|stated|model_|tokens_per|load|cost|verify|run_id|"
                   r"^when$|^attempt$|parent|run_dir|machine|^vs_|best_lossless|ceiling|pareto|per_draft_len|"
                   r"^study$|^sweep$|mlflow|calibrat|tok_s|items_per|^earlier_attempts$")


# inside a speed figure's subtree (``vs_lossless``, the frontier's cost model...) every leaf is timed but these
KEPT = re.compile(r"items$|^concurrency$|^interleaved$|^acceptance_length$|^accepted_share$")
TIMED_TREE = re.compile(r"^vs_|best_lossless|^ceiling|^cost_model$")


def _mask(value: Any, key: str = "", timed: bool = False) -> Any:
    """``value`` with every timed leaf replaced by :data:`MASK` (dicts keep their keys: the shape is compared)."""
    timed = timed or bool(key and TIMED_TREE.search(key))
    if isinstance(value, dict):
        return {k: _mask(v, str(k), timed) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, list):
        return MASK if key and TIMED.search(key) and not timed else [_mask(v, "", timed) for v in value]
    if key and KEPT.search(key):
        pass
    elif timed or (key and TIMED.search(key)):
        return MASK
    if isinstance(value, float):
        return None if math.isnan(value) else round(value, 9)
    return value


def _frontier(data: dict[str, Any]) -> dict[str, Any]:
    """The frontier, its trial rows in trial order (their order is by modelled speed, which is timed)."""
    data = dict(data)
    data["trials"] = sorted(data.get("trials", []), key=lambda r: r["trial"])
    return _mask(data)


def normalized(run_dir: Path) -> dict[str, Any]:
    """Everything under ``run_dir/report`` that two runs of one command share."""
    report = Path(run_dir) / "report"
    out: dict[str, Any] = {"files": sorted(p.relative_to(report).as_posix() for p in report.rglob("*") if p.is_file())}
    for name in ["certification.json", "noise_floor.json", "acceptance.json",
                 *sorted(p.name for p in report.glob("chosen-budget-*.json"))]:
        out[name] = _mask(json.loads((report / name).read_text()))
    if (report / "frontier.json").is_file():
        out["frontier.json"] = _frontier(json.loads((report / "frontier.json").read_text()))
    for path in sorted((report / "evidence").glob("*.csv")):
        with path.open() as f:
            out[f"evidence/{path.name}"] = list(csv.DictReader(f))
    for path in sorted(report.glob("*.md")):  # the pages' text, numbers masked, lines as a multiset (rows by speed)
        out[path.name] = sorted(re.sub(r"[+-]?\d+(\.\d+)?", "#", line) for line in path.read_text().splitlines())
    if (report / "trials.parquet").is_file():
        import polars as pl

        frame = pl.read_parquet(report / "trials.parquet").sort("trial")
        out["trials.parquet"] = {"columns": sorted(frame.columns),
                                 "rows": [_mask(row) for row in frame.to_dicts()]}
    return out


def run_sweep(root: Path) -> Path:
    from jobs import sweep as sweep_job

    run_dir = root / "sweep"
    rc = sweep_job.main([*ARGS, "--runs-root", str(root), "--run-dir", str(run_dir)])
    if rc != 0:
        raise SystemExit(f"the sweep exited {rc}")
    return run_dir


def differences(a: Any, b: Any, where: str = "") -> list[str]:
    """Where two normalized outputs differ, one line each (empty: the same)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{where}/{k}: only in the first" for k in a if k not in b]
        out += [f"{where}/{k}: only in the second" for k in b if k not in a]
        for k in a:
            if k in b:
                out += differences(a[k], b[k], f"{where}/{k}")
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {json.dumps(a, default=str)[:200]} != {json.dumps(b, default=str)[:200]}"]


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("capture", "compare"):
        print("usage: python -m tests.sweep.outputs capture|compare GOLDEN.json", file=sys.stderr)
        return 2
    import os

    with tempfile.TemporaryDirectory() as tmp:
        os.environ["SPECTUNE_LEDGER"] = str(Path(tmp) / "ledger")  # a fresh ledger: the attempt is always new
        got = normalized(run_sweep(Path(tmp)))
    path = Path(argv[1])
    if argv[0] == "capture":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(got, indent=1, sort_keys=True, default=str) + "\n")
        print(f"wrote {path}")
        return 0
    diff = differences(json.loads(path.read_text()), json.loads(json.dumps(got, default=str)))
    print("\n".join(diff) or "the same")
    return 1 if diff else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
