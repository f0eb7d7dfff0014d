"""The sweep command: search each rule's knobs for the best speedup under quality budgets, on Ray, and
certify each budget on items the search never saw.

    ray job submit --working-dir . -- python jobs/sweep.py --benchmark gsm8k \\
        --pair qwen2.5-coder-0.5b+1.5b --budgets 0.01,0.02,0.05 --items 40 --trials 16

Optuna (sqlite under the run directory; rerunning the same command resumes it) asks for a rule family, its
knobs and a draft length; long-lived pair actors evaluate the trial's search items; trials are pruned once an
anytime-valid bound puts their drop beyond the largest budget; MLflow logs a nested run per trial; then each
budget is CERTIFIED, or not, on the confirmation split. This module parses (``jobs.sweep_args``), hands the
settings to the library (``sweep.run``) and prints the result; the sweep itself is ``sweep/``.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # `python jobs/sweep.py` (as `ray job submit` runs it): repo root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import json  # noqa: E402
import shlex  # noqa: E402

from jobs.sweep_args import build_parser, effective_config, parse_args  # noqa: E402, F401  (build_parser: the CLI)
from sweep.progress import log  # noqa: E402
from workers.engine_registry import engine_traits  # noqa: E402


def _exit_on_sigterm() -> None:
    """SIGTERM (``kill``, ``ray job stop``) unwinds like Ctrl-C, so the actors release their engines."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def main(argv: list[str] | None = None) -> int:
    from sweep import run
    from sweep.settings import parse_settings
    from workers.results.store import persistent_dir, runs_root

    _exit_on_sigterm()
    try:
        settings = parse_settings(parse_args(argv))
        runs_root(settings.args.runs_root)  # a root inside a Ray job's temporary working_dir copy fails now, not at the end
        if settings.args.run_dir:
            persistent_dir(settings.args.run_dir, "--run-dir")
        # the server answers, takes the key, serves the model: else one line
        if engine_traits(settings.args.engine).needs_server:
            from sweep.settings import endpoint_options
            from workers.endpoint import Endpoint, check

            check(Endpoint(**endpoint_options(settings.args)))
    except ValueError as err:  # workers.endpoint.EndpointError is one too
        print(f"error: {err}", file=sys.stderr)
        return 2
    if settings.args.server_config is not None:  # a fixed server configuration: no search, one candidate
        from sweep.server import certify_server

        try:
            result = certify_server(settings, effective_config(settings.args))
        except ValueError as err:  # a side unreachable, the same configuration twice: one line
            print(f"error: {err}", file=sys.stderr)
            return 2
    else:
        result = run(settings, effective_config(settings.args))
    summary = {b: {k: c.get(k) for k in ("policy", "params", "draft_len", "trial", "certified")}
               | {k: (c.get("certification") or {}).get(k) for k in ("bound", "n", "discordance", "items_needed")}
               for b, c in result.chosen.items()}
    print(json.dumps({"run_dir": str(result.run_dir), "parent_run_id": result.parent_run_id,
                      "report": None if settings.args.server_config is not None
                      else str(result.run_dir / "report" / "report.md"),
                      "certification": str(result.run_dir / "report" / "certification.md"), "chosen": summary},
                     indent=1, default=str), flush=True)
    log(f"run directory: {result.run_dir} (rerunning the same command resumes it)")
    refused = {(c.get("screen") or {}).get("knob_check") for c in result.chosen.values()} - {None, "applied"}
    refused |= {c["certification"]["reason"] for c in result.chosen.values()
                if c.get("mode") == "server-config" and c["certification"]["reason"].startswith("refused: acceptance")}
    if refused:  # a fixed server configuration whose settings showed no effect: never certified, said in one line
        print(sorted(refused)[0], file=sys.stderr)
        return 3
    log(f"MLflow UI, from the checkout: .venv/bin/python -m jobs.tracking ui --run-dir "
        f"{shlex.quote(str(result.run_dir))}")
    return _gate(settings, result.chosen)


def _gate(settings, chosen: dict) -> int:
    """``--gate BUDGET``: that budget's verdict as the exit code (0 certified, 10 refuted, 11 undecided)."""
    from workers.certify.verdict import GATE_EXIT, UNDECIDED

    gate = getattr(settings.args, "gate", None)
    if gate is None:
        return 0
    choice = next((c for b, c in chosen.items() if abs(float(b) - gate) < 1e-12), {})
    verdict = choice.get("verdict") or UNDECIDED
    log(f"gate {gate * 100:g}%: {verdict} (exit {GATE_EXIT[verdict]})")
    return GATE_EXIT[verdict]


if __name__ == "__main__":
    raise SystemExit(main())
