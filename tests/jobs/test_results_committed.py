"""The committed results under docs/results/: ``jobs.results check docs/results`` (the results page's command) passes
on each folder the page lists (or reports it superseded where its row says so), against the shipped ledger history, and fails, naming the check, on a copy where one thing a sceptic could edit was edited.
Uses the repo's GSM8K data (the confirmation pool's order), no model."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from jobs.results import main, verify
from workers.results.history import KNOWN

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = sorted(p.parent for p in (ROOT / "docs" / "results").glob("*/certification.json"))

# What check must say of each committed folder. A new folder under docs/results/ is expected to pass.
EXPECTED = {
    "gsm8k-int4-frontier": "pass",  # the 2026-12-05 frontier: 5% certified (trial-27 a gate, trial-15 chosen)
    "gsm8k-real-frontier": "pass",  # the 2026-12-02 bf16 frontier: nothing certified
    "gsm8k-real-kl-judge": "superseded",  # SUPERSEDED.md: a second attempt on items an earlier attempt used
}
INT4 = ROOT / "docs" / "results" / "gsm8k-int4-frontier"
INT4_ATTEMPT = "62cf91379d51"


def _run(folder: Path, capsys, history: Path | None = None) -> tuple[int, str]:
    argv = ["check", str(folder)] + ([] if history is None else ["--history", str(history)])
    code = main(argv)
    return code, capsys.readouterr().out


def _status(out: str, budget: str, check: str) -> str:
    """The status word of one check's line (``ok``, ``FAILED``, ``not checked``) and its text."""
    prefix = f"budget {budget}: {check}: " if budget else f"{check}: "
    lines = [line for line in out.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, (prefix, out)
    return lines[0][len(prefix):]


def test_the_results_pages_command_as_written_rechecks_every_committed_folder():
    """``python -m jobs.results check docs/results``, as docs/results/README.md shows it: every folder passes (a
    superseded one only where its row says so), and each certificate folder's checks pass or it is superseded."""
    from sweep.recheck.index import listed

    rows = listed(ROOT / "docs" / "results")
    for folder in FOLDERS:
        expected = EXPECTED.get(folder.name, "pass")
        assert (expected == "superseded") == (folder / "SUPERSEDED.md").is_file(), \
            f"{folder.name}: SUPERSEDED.md and EXPECTED disagree"
        assert (expected == "superseded") == ("superseded" in rows[folder.name].lower()), folder.name
    got = subprocess.run([sys.executable, "-m", "jobs.results", "check", "docs/results"], cwd=ROOT,
                         capture_output=True, text=True, timeout=900)
    out = got.stdout
    assert got.returncode == 0, out[-3000:] + got.stderr[-2000:]
    for folder in FOLDERS:
        status = _status(out, "", folder.name)
        assert status.startswith("ok (superseded" if EXPECTED.get(folder.name) == "superseded"
                                 else "ok (certificates re-decided"), status
        if EXPECTED.get(folder.name, "pass") == "pass":
            assert f"  {folder.name}: check: " in out and \
                [line for line in out.splitlines() if line.startswith(f"  {folder.name}: check: ")][0].endswith(": ok")
    assert out.splitlines()[-1] == f"{len(rows)} folder(s) listed, 0 failed"


@pytest.fixture(scope="module")
def int4(tmp_path_factory) -> tuple[Path, Path]:
    """A pristine copy of the int4 frontier (its name kept) and of the shipped history, to doctor."""
    root = tmp_path_factory.mktemp("int4")
    history = root / "known_attempts.jsonl"
    shutil.copy2(KNOWN, history)
    return root, history


def _copy(int4: tuple[Path, Path], where: str, name: str = "gsm8k-int4-frontier") -> tuple[Path, Path]:
    src = INT4.parent / name
    dst = int4[0] / where / name
    shutil.copytree(src, dst)
    history = int4[0] / where / "history.jsonl"
    shutil.copy2(int4[1], history)
    return dst, history


@pytest.fixture(scope="module")
def pristine(int4) -> str:
    """check's output on the undoctored copy: every doctored check below passes there."""
    folder, history = _copy(int4, "pristine")
    found = verify(folder, history)
    return "\n".join(found.lines())


def _flip(csv: Path, row: int) -> str:
    """Flip the candidate score of data row ``row`` (0-based) of an evidence CSV; returns its item id."""
    lines = csv.read_text().splitlines()
    cells = lines[row + 1].split(",")
    cells[2] = "0.0" if float(cells[2]) == 1.0 else "1.0"
    lines[row + 1] = ",".join(cells)
    csv.write_text("\n".join(lines) + "\n")
    return cells[0]


def test_pristine_copy_passes_the_checks_the_doctored_ones_fail(pristine):
    for budget in ("1%", "2%", "5%"):
        for check in ("steps", "order", "design", "pool", "disjoint", "audit", "ledger", "family", "chosen"):
            assert _status(pristine, budget, check).startswith("ok: "), (budget, check, pristine)


def test_attempt_dropped_from_the_history_fails_the_ledger_check(int4, pristine, capsys):
    folder, history = _copy(int4, "no-attempt")
    rows = [line for line in history.read_text().splitlines() if json.loads(line).get("attempt") != INT4_ATTEMPT]
    assert len(rows) < len(history.read_text().splitlines())
    history.write_text("\n".join(rows) + "\n")
    code, out = _run(folder, capsys, history)
    assert code == 1
    for budget in ("1%", "2%", "5%"):
        said = _status(out, budget, "ledger")
        assert said.startswith("FAILED: ") and f"attempt {INT4_ATTEMPT} is not in the ledger history" in said, said
        assert _status(out, budget, "pool").startswith("not checked: ")  # the earlier attempts are unknown without it


def test_a_flipped_row_of_the_chosen_candidates_evidence_fails_the_steps_check(int4, pristine, capsys):
    folder, history = _copy(int4, "chosen-flipped")
    item = _flip(folder / "evidence" / "trial-15.csv", 50)  # within the 214 items of the deciding look
    code, out = _run(folder, capsys, history)
    said = _status(out, "5%", "steps")
    assert code == 1 and said.startswith("FAILED: ") and "DOES NOT MATCH the certificate" in said, said
    assert "trial-15: recomputed" in said, (item, said)
    assert _status(out, "1%", "steps").startswith("ok: ")  # trial-15 is tested at 5% only


def test_a_changed_gate_fails_the_steps_check(int4, pristine, capsys):
    """trial-27 passed the 5% sequence as a gate before trial-15 was chosen: its evidence is re-decided too."""
    folder, history = _copy(int4, "gate-changed")
    csv = folder / "evidence" / "trial-27.csv"
    lines = csv.read_text().splitlines()
    row = next(k for k, line in enumerate(lines[1:]) if line.split(",")[1:3] == ["1.0", "1.0"])
    _flip(csv, row)  # one more item lost, early in the order
    code, out = _run(folder, capsys, history)
    said = _status(out, "5%", "steps")
    assert code == 1 and said.startswith("FAILED: ") and "trial-27: recomputed" in said, said
    assert _status(out, "5%", "ledger").startswith("ok: ")  # the items are the same: only the decision moved


def test_a_step_left_out_of_the_sequence_fails_the_order_check(int4, pristine, capsys):
    """A certificate that lists only trial-15 at 5% re-decides on its own evidence, but the search's safest-first
    order puts trial-27 first: the order check catches the gate left out."""
    folder, history = _copy(int4, "gate-dropped")
    path = folder / "certification.json"
    cert = json.loads(path.read_text())
    steps = cert["budgets"]["0.05"]["certification"]["steps"]
    cert["budgets"]["0.05"]["certification"]["steps"] = [s for s in steps if s["candidate"] != "trial-27"]
    path.write_text(json.dumps(cert))
    code, out = _run(folder, capsys, history)
    said = _status(out, "5%", "order")
    assert code == 1 and said.startswith("FAILED: ") and "tests trial-27, trial-15" in said, said
    assert _status(out, "5%", "steps").startswith("ok: ")


def test_an_audit_that_found_a_replayed_record_differing_fails_a_certified_budget(int4, pristine, capsys):
    folder, history = _copy(int4, "audit-differs")
    path = folder / "chosen-budget-0.05.json"
    choice = json.loads(path.read_text())
    check = choice["replay_check"]
    check.update(replayed_differ=[f"candidate:{check['candidate_items'][0]}"], status="replay differs", identical=False)
    path.write_text(json.dumps(choice))
    cert = json.loads((folder / "certification.json").read_text())
    cert["budgets"]["0.05"]["replay_check"] = check
    (folder / "certification.json").write_text(json.dumps(cert))
    code, out = _run(folder, capsys, history)
    said = _status(out, "5%", "audit")
    assert code == 1 and said.startswith("FAILED: ") and "differs from its full decode" in said, said


def test_an_empty_lossless_table_fails_the_frontier_check(int4, capsys):
    """On the bf16 frontier, which passes every check: empty its lossless table and only the frontier fails."""
    folder, history = _copy(int4, "no-lossless", "gsm8k-real-frontier")
    code, out = _run(folder, capsys, history)
    assert code == 0 and _status(out, "", "frontier").startswith("ok: "), out
    path = folder / "frontier.json"
    data = json.loads(path.read_text())
    data.update(lossless=[], best_lossless={"draft_len": None, "tokens_per_cost": float("nan")})
    path.write_text(json.dumps(data))
    code, out = _run(folder, capsys, history)
    said = _status(out, "", "frontier")
    assert code == 1 and said.startswith("FAILED: ") and "lossless table is empty" in said, said
    assert [line for line in out.splitlines() if ": FAILED: " in line and not line.startswith("check: ")] == \
        [f"frontier: {said}"]
