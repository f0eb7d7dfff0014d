"""The sweep's report: the search split's figures every few trials, and with the confirmation the
certificates, the flips page and the frontier (``report/`` in the run directory, logged to MLflow).

Everything here reads the state and the search's trials; the confirmation's decisions come from
``sweep.confirm``. Point estimates on the search split are descriptions, never certificates.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sweep.search import spec_of, trial_dir, trials_frame
from workers.metrics.trial import noise_floor, score_of
from workers.results.store import write_text

if TYPE_CHECKING:
    from sweep.confirm import Certification
    from sweep.state import SweepState
    from workers.evaluation import Record


def report(state: SweepState, final: bool = False) -> dict[str, Any]:
    """The search split's report (every few trials); with ``final``, certify each budget on the
    confirmation split and write the chosen policies (``chosen/budget-<b>.json``). Returns them by budget."""
    from dashboards import frontier as frontier_page
    from dashboards.report import write_report
    from dashboards.tables import chosen_per_budget
    from sweep.confirm import certify

    frame = trials_frame(state)
    ar = state.refs.target_only()
    ref_acc = sum(score_of(r) for r in ar.values()) / max(1, len(ar))
    # lossless at every L, from the reference stores: a study resumed with its search done runs no trial in this
    # process, so nothing else loads them, and its frontier lost its lossless table (the int4+int8 frontier's did)
    state.refs.lossless_range()
    lossless = state.refs.first_lossless()
    floor = noise_floor(list(lossless.values()), list(ar.values())).__dict__ if lossless is not None else None
    winners = {}
    if len(frame):
        for budget, row in chosen_per_budget(frame, state.settings.budgets).items():
            if row is not None:
                winners[f"search ≤{budget * 100:g}%: {row['family']} (trial {row['trial']})"] = acceptance(state, row)
    out = state.dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    done: Certification | None = certify(state, frame, out) if final else None
    chosen = done.chosen if done is not None else {}
    write_report(frame, out, reference_accuracy=ref_acc, budgets=state.settings.budgets,
                 winners_acceptance=winners or None, noise_floor=floor, title=state.name,
                 certification=done.table if done is not None else None)
    write_flips_page(state, frame, out, done.flips if done is not None else [])
    try:
        frontier_page.write(frontier_of(state, frame, chosen, done.confirmed if done is not None else None), out,
                            state.name)  # what limits the speed
    except ValueError as err:  # refused (no lossless table): said, and no page, rather than an empty one
        from sweep.progress import log

        log(f"frontier page not written: {err}")
    state.tracker.log_report(out, chosen)
    return chosen


def write_flips_page(state: SweepState, frame: Any, out: Path, confirmed: list[tuple[str, Path]]) -> None:
    """``report/flips.md``: the confirmed candidates' flipped items (``confirmed``: heading, flips file; the
    confirmation split), then each finished trial's (search split), both outputs side by side; linked from
    report.md."""
    from dashboards.flips import flips_page

    sections = list(confirmed)
    for row in sorted(frame.iter_rows(named=True), key=lambda r: r["trial"]) if len(frame) else []:
        spec = spec_of(state.settings, row)
        sections.append((f"trial {row['trial']}: {spec.label()} (search split)",
                         trial_dir(state.dir, spec) / "flips.parquet"))
    write_text(out / "flips.md", flips_page(sections, state.name, per_section=10))
    page = out / "report.md"
    if page.is_file() and "flips.md" not in page.read_text():
        write_text(page, page.read_text().rstrip("\n") + "\n\nFlipped items, both outputs side by side, per "
                   "confirmed candidate and per trial: [flips.md](flips.md)\n")


def acceptance(state: SweepState, row: dict[str, Any]) -> tuple[int, list[int]]:
    """A trial's verify rounds and accepted draft tokens per position, over its unfailed search records."""
    from workers.results.store import RecordStore

    spec = spec_of(state.settings, row)
    recs = [r for r in RecordStore(trial_dir(state.dir, spec)).load().values() if not r.failed]
    counts = [0] * spec.draft_len
    for r in recs:
        counts = [a + b for a, b in zip(counts, r.accepted_per_position, strict=False)]
    return sum(r.num_drafts for r in recs), counts


def frontier_of(state: SweepState, frame: Any, chosen: Mapping[str, Mapping[str, Any]],
                confirmed: Mapping[str, Mapping[str, Record]] | None) -> dict[str, Any]:
    """The frontier from what the sweep holds: target-only (L 0) and lossless at every L of its range (replayed on
    the search items),
    its trials, its certificates and its confirmed candidates' records (``workers.metrics.frontier``)."""
    from sweep.references import CONFIRM, RefKey
    from workers.metrics.frontier import summary

    held = state.refs.lossless_range()  # L 0 (target-only, a lossless decoding too) and every L, from the stores
    confirm_reference = state.refs.get(RefKey.target_only(CONFIRM))
    return summary(lossless=held, cost_ratio=state.cost.cost_ratio,
                   verify_factor=state.cost.verify, frame=frame, chosen=chosen, profile=state.profile,
                   reference=confirm_reference or None, confirmed=confirmed)
