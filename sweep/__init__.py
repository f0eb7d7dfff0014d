"""The sweep library: search each rule's knobs for the best speedup under quality budgets, then certify each
budget on items the search never saw. The only floor besides the commands that talks to Optuna and MLflow.

    from sweep import run
    from sweep.settings import parse_settings
    result = run(parse_settings(args), config_yaml)     # jobs/sweep.py is this, with its parser

Its rooms, one phase each, every phase taking the state and returning values:

- ``settings``: the arguments validated and resolved (:class:`~sweep.settings.Settings`), the study's identity;
- ``state``: :func:`~sweep.state.open_sweep` makes the frozen :class:`~sweep.state.SweepState` (the run
  directory, the search sample and the confirmation pool, the pair actors, the study, the tracker);
- ``references``: target-only and lossless on the same items, typed keys, the resumable record runner;
- ``search``: ask / run / prune / tell per trial, the trials frame;
- ``confirm`` (with ``certificates``): each budget certified or not; ``attempt``: the attempt the ledger opens
  and the level its family gives it;
- ``server``: a fixed server configuration (``--server-config``) certified as one candidate, no search;
- ``report``: the report, the flips page and the frontier; ``progress``: the log and progress lines;
  ``tracking``: MLflow; ``carry``: a study moved to another machine;
- ``recheck``: an exported results folder re-decided from its evidence and the ledger history (what
  ``python -m jobs.results check`` runs).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sweep.settings import Settings


@dataclass(frozen=True)
class SweepResult:
    """What a sweep ends with: its run directory, the MLflow parent run and the chosen rule per budget."""

    run_dir: Path
    parent_run_id: str | None
    chosen: dict[str, Any]


def run(settings: Settings, config_yaml: str) -> SweepResult:
    """The whole sweep: the target-only reference, the trials up to ``--trials`` (a resumed study continues),
    the report every 4 trials, then (unless ``--search-only``) the confirmation and the final report. The
    actors are released however it ends (Ctrl-C and SIGTERM too)."""
    from cluster.pair_actor import release
    from sweep.progress import log
    from sweep.report import report
    from sweep.search import best_text, finished, resume_stale, run_trial, search_cost, trial_line
    from sweep.state import open_sweep

    state = open_sweep(settings, config_yaml)
    args = settings.args
    log(f"run directory: {Path(state.dir).resolve()}")
    try:
        state.refs.target_only()
        resume_stale(state.study)
        for params in settings.enqueue:
            state.study.enqueue_trial(params, skip_if_exists=True)
        if finished(state.study) >= args.trials:
            log(f"study {state.name} already has {finished(state.study)} finished trials: reporting only")
        elapsed: list[float] = []
        while finished(state.study) < args.trials:
            outcome = run_trial(state)
            elapsed.append(outcome.wall_s)
            done = finished(state.study)
            eta = sum(elapsed) / len(elapsed) * max(0, args.trials - done)
            trial_line(outcome, state.study.trials[outcome.number].user_attrs, done, args.trials, eta,
                       best_text(state))
            if done % 4 == 0:
                report(state)
        search_cost(state.study)
        chosen = report(state, final=not args.search_only)
        if args.search_only:
            log("--search-only: the search is done; the same command without it confirms")
        state.tracker.end()
    finally:  # Ctrl-C or SIGTERM too: the engines' processes go with the actors
        release(state.workers)
    return SweepResult(Path(state.dir).resolve(), state.tracker.parent_id, chosen)
