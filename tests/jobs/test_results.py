"""Results folders: ``jobs.results check`` re-decides every certificate from its folder and the ledger history,
on small made-up folders here (every check, and each caught when its input is edited); the committed folders
under docs/results/ and doctored copies of them are in ``test_results_committed.py``."""

from __future__ import annotations

import json
from pathlib import Path

from jobs.results import main, recompute, verify
from workers.certify.decide import certifies, sequential_bound
from workers.certify.sequential import look_plan
from workers.results.evidence import write_evidence

ATTEMPT = "att-0000test"


def _scores(lost: int, n: int) -> list[float]:
    return [0.0 if k < lost else 1.0 for k in range(n)]


def _evidence(folder: Path, key: str, ids: list[str], cand: list[float], made: str = "") -> None:
    rows = [{"item_id": i, "reference_score": 1.0, "candidate_score": s, "reference": "ok", "candidate": "ok",
             "divergence": None, "candidate_made": made} for i, s in zip(ids, cand, strict=True)]
    write_evidence(folder / "evidence" / f"{key}.csv", rows)


def _step(key: str, cand: list[float], plan, budget: float) -> tuple[dict, object]:
    got = sequential_bound([1.0] * len(cand), cand, plan, budget)
    return {"candidate": key, "passed": certifies(got), "losses": got.losses, "wins": got.wins, "n": got.n,
            "look": got.look, "p_value": got.p_value}, got


def _history(folder: Path, items: list[str], search: list[str] = (), earlier: list[dict] = ()) -> Path:
    """A ledger history holding the folder's attempt (after ``earlier``'s rows): opened on ``items``, decided as its
    certificates say."""
    cert = json.loads((folder / "certification.json").read_text())
    rows = list(earlier)
    rows.append({"event": "opened", "attempt": ATTEMPT, "benchmark": "gsm8k", "pair_id": "pair:test", "pair": "p",
                 "dtype": "fp32", "study": "s", "budgets": [0.1], "items": items, "search_items": list(search),
                 "earlier": [r["attempt"] for r in earlier if r["event"] == "opened"]})
    rows += [{"event": "decided", "attempt": ATTEMPT, "benchmark": "gsm8k", "pair_id": "pair:test",
              "budget": float(c["budget"]), "certified": c["certified"], "items_used": len(items)}
             for c in cert["budgets"].values()]
    path = folder.parent / f"{folder.name}-history.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _folder(tmp_path: Path, lost: int = 1, n: int = 80, ids: list[str] | None = None) -> Path:
    """A one-budget folder (10%, two looks over n items) whose candidate trial-0 lost ``lost`` items."""
    ids = ids or [f"i{k}" for k in range(n)]
    folder = tmp_path
    cand = _scores(lost, n)
    _evidence(folder, "trial-0", ids, cand)
    plan = look_plan(n, 2, 0.05, budget=0.1)
    step, got = _step("trial-0", cand, plan, 0.1)
    seq = {**plan.to_dict(), "look": got.look, "stopped_at": None}
    cert = {"certified": certifies(got), "alpha": 0.05, "n": got.n, "p_value": got.p_value, "bound": got.upper,
            "discordance": got.discordance, "evidence": "evidence/trial-0.csv", "candidate": "trial-0",
            "sequential": seq, "confirm_items": n, "steps": [step], "attempt": ATTEMPT}
    choice = {"budget": 0.1, "certified": cert["certified"], "policy": "kl_judge", "params": {"threshold": 0.1},
              "draft_len": 5, "certification": cert, "confirm": {"speed.modelled_per_token": 1.5},
              "benchmark": "gsm8k", "pair": "p", "dtype": "fp32", "pair_fingerprint": "pair:test", "sweep": "s",
              "trial": 0, "search": {"speedup": 1.2, "accuracy_drop": 0.0, "accuracy_drop_upper": 0.05}}
    (folder / "certification.json").write_text(json.dumps({"budgets": {"0.1": choice}}))
    _history(folder, ids)
    return folder


def _check(folder: Path, capsys, history: Path | None = None) -> tuple[int, str]:
    history = history or folder.parent / f"{folder.name}-history.jsonl"
    code = main(["check", str(folder), "--history", str(history)])
    return code, capsys.readouterr().out


def _line(out: str, prefix: str) -> str:
    found = [line for line in out.splitlines() if line.startswith(prefix)]
    assert len(found) == 1, (prefix, out)
    return found[0]


def test_a_folder_recomputes_and_an_edited_one_is_caught(tmp_path, capsys):
    folder = _folder(tmp_path / "f")
    assert [r["matches"] for r in recompute(folder, folder.parent / "f-history.jsonl")] == [True]
    code, out = _check(folder, capsys)
    assert code == 0 and "matches the certificate" in out, out
    assert _line(out, "budget 10%: steps:").startswith("budget 10%: steps: ok: recomputed from the evidence")
    # what the folder cannot tell is said, never passed silently
    assert _line(out, "budget 10%: order:").startswith("budget 10%: order: not checked: no sweep.json")
    assert _line(out, "budget 10%: pool:").startswith("budget 10%: pool: not checked")
    assert out.splitlines()[-1].endswith(": ok")
    csv = folder / "evidence" / "trial-0.csv"
    csv.write_text(csv.read_text().replace("i5,1.0,1.0", "i5,1.0,0.0"))  # one more item lost
    code, out = _check(folder, capsys)
    assert code == 1 and "DOES NOT MATCH" in out
    assert _line(out, "budget 10%: steps:").startswith("budget 10%: steps: FAILED")
    assert "FAILED: budget 10% steps" in out.splitlines()[-1]


def test_every_step_is_redecided_not_only_the_chosen_one(tmp_path, capsys):
    """A gate (a step that passed before the chosen one) is re-decided from its own evidence: edit it and the
    check fails even though the chosen candidate's evidence is untouched."""
    folder = _folder(tmp_path / "f", lost=0)
    ids = [f"i{k}" for k in range(80)]
    gate = _scores(1, 80)
    _evidence(folder, "trial-9", ids, gate)
    cert = json.loads((folder / "certification.json").read_text())
    c = cert["budgets"]["0.1"]["certification"]
    step, _ = _step("trial-9", gate, look_plan(80, 2, 0.05, budget=0.1), 0.1)
    assert step["passed"] and step["losses"] == 1
    c["steps"] = [step, *c["steps"]]
    (folder / "certification.json").write_text(json.dumps(cert))
    # two passed: which is chosen needs both search speeds; the folder has only the chosen one's
    code, out = _check(folder, capsys)
    assert code == 0 and "trial-9 passed" in out and "needs their search speeds" in out, out
    csv = folder / "evidence" / "trial-9.csv"
    csv.write_text(csv.read_text().replace("i0,1.0,0.0", "i0,1.0,1.0"))  # the gate lost one fewer: still passes
    code, out = _check(folder, capsys)
    line = _line(out, "budget 10%: steps: FAILED")
    assert code == 1 and "trial-9: recomputed trial-9 passed" in line and "differs in lost" in line, line
    # a step the evidence would fail, recorded as passed, stops the sequence there: the chosen one was never reached
    csv.write_text(csv.read_text().replace(",1.0,1.0,", ",1.0,0.0,", 20))
    code, out = _check(folder, capsys)
    line = _line(out, "budget 10%: steps: FAILED")
    assert code == 1 and "tests trial-9, the certificate lists trial-9, trial-0" in line, line


def test_a_fixed_sequence_that_certifies_two_candidates_is_shown_by_the_chosen_one(tmp_path):
    """The chosen candidate of a fixed sequence that passed twice is the last; its evidence is what the certificate
    names, so the tables read its step, not the first one's (a frontier once showed the first's 3 lost beside the
    chosen's 0)."""
    from jobs.results import table
    from workers.metrics.frontier import budget_rows

    folder = _folder(tmp_path, lost=0)
    cert = json.loads((folder / "certification.json").read_text())
    cert_fields = cert["budgets"]["0.1"]["certification"]
    first = {"candidate": "trial-9", "losses": 3, "wins": 0, "look": 1}
    cert_fields["steps"] = [first, *cert_fields["steps"]]
    (folder / "certification.json").write_text(json.dumps(cert))
    assert "| 0 / 0 |" in table(folder) and "| 3 / 0 |" not in table(folder)
    assert budget_rows(cert["budgets"])[0]["lost"] == 0
    cert_fields["candidate"] = "trial-9"  # a certificate that names the other candidate reads its step
    assert budget_rows(cert["budgets"])[0]["lost"] == 3


def _gsm8k_folder(tmp_path: Path, ids: list[str], search: list[str], earlier: list[dict] = ()) -> Path:
    folder = _folder(tmp_path, n=len(ids), ids=ids)
    (folder / "sweep.json").write_text(json.dumps({"study": "s", "args": {"benchmark": "gsm8k"}}))
    (folder / "search_items.txt").write_text("".join(f"{i}\n" for i in search))
    _history(folder, ids, search, earlier)
    return folder


def test_check_recomputes_the_design_and_the_pool_front_from_the_ledger(tmp_path, capsys):
    """The check once trusted the recorded thresholds and the recorded skips: it now recomputes the design, and checks
    the items are the pool's first N in its fixed order, none searched, less what the LEDGER says earlier attempts
    used (certification.json's ``pool.skipped`` must agree, and is never what the front is computed from)."""
    from workers.benchmarks import get_benchmark

    bench = get_benchmark("gsm8k")
    search = bench.items(limit=6, seed=0, split="search")
    pool = [it.id for it in bench.confirmation_pool(search)[0]]
    searched = [it.id for it in search]
    folder = _gsm8k_folder(tmp_path / "ok", pool[:80], searched)
    history = tmp_path / "ok-history.jsonl"
    assert [(r["matches"], r["design_matches"], r["pool_front"], r["disjoint"]) for r in recompute(folder, history)] == \
        [(True, True, True, True)]
    code, out = _check(folder, capsys)
    assert code == 0 and "are the pool front in its fixed order" in out, out
    # items picked out of order (the pool's 2nd..81st), or with a search item among them: caught
    shifted = _gsm8k_folder(tmp_path / "shifted", pool[1:81], searched)
    code, out = _check(shifted, capsys)
    assert code == 1 and "are NOT the pool front" in _line(out, "budget 10%: pool: FAILED")
    leaked = _gsm8k_folder(tmp_path / "leaked", pool[:79] + searched[:1], searched)
    code, out = _check(leaked, capsys)
    assert code == 1 and "SHARED WITH THE SEARCH" in _line(out, "budget 10%: disjoint: FAILED")
    # items an earlier attempt used are skipped in the front, as the ledger history records them
    earlier = [{"event": "opened", "attempt": "before", "benchmark": "gsm8k", "pair_id": "pair:test", "budgets": [0.1],
                "items": pool[:3], "search_items": []},
               {"event": "decided", "attempt": "before", "benchmark": "gsm8k", "pair_id": "pair:test", "budget": 0.1,
                "certified": False, "items_used": 3}]
    skipping = _gsm8k_folder(tmp_path / "skipping", pool[3:83], searched, earlier)
    assert [r["pool_front"] for r in recompute(skipping, tmp_path / "skipping-history.jsonl")] == [True]
    # ... and only from there: the same skips stated in certification.json, with no earlier attempt in the ledger, fail
    cert = json.loads((skipping / "certification.json").read_text())
    (skipping / "certification.json").write_text(json.dumps({**cert, "pool": {"skipped": pool[:3]}}))
    assert [r["pool_front"] for r in recompute(skipping, tmp_path / "skipping-history.jsonl")] == [True]
    _history(skipping, pool[3:83], searched)  # the earlier attempt dropped from the history
    code, out = _check(skipping, capsys)
    assert code == 1 and "NOT the pool front" in _line(out, "budget 10%: pool: FAILED"), out
    # an edited threshold no longer recomputes, even where the decision happens not to change
    cert = json.loads((folder / "certification.json").read_text())
    design = cert["budgets"]["0.1"]["certification"]["sequential"]
    design["thresholds"] = [z - 0.5 if z is not None else None for z in design["thresholds"]]
    (folder / "certification.json").write_text(json.dumps(cert))
    assert [r["design_matches"] for r in recompute(folder, history)] == [False]


def test_a_result_whose_attempt_is_not_in_the_history_fails(tmp_path, capsys):
    folder = _folder(tmp_path / "f")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    code, out = _check(folder, capsys, empty)
    assert code == 1 and f"attempt {ATTEMPT} is not in the ledger history" in _line(out, "budget 10%: ledger: FAILED")
    # a decided row that says otherwise than the certificate fails too
    history = folder.parent / "f-history.jsonl"
    rows = [json.loads(line) for line in history.read_text().splitlines()]
    for r in rows:
        if r["event"] == "decided":
            r["certified"] = not r["certified"]
    history.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, out = _check(folder, capsys)
    assert code == 1 and "decided row at 10% says certified" in _line(out, "budget 10%: ledger: FAILED")


def test_a_certificate_made_before_the_family_is_redecided_at_its_level(tmp_path, capsys):
    """The k-th attempt on a benchmark and pair is tested at alpha x 2^-k: a certificate made before the family,
    at 0.05, must still certify at the level its place in the history gives it."""
    def earlier(k: int) -> list[dict]:
        return [{"event": "opened", "attempt": f"before-{k}", "benchmark": "gsm8k", "pair_id": "pair:test",
                 "budgets": [0.1], "items": [f"other-{k}"], "search_items": []}]

    folder = _folder(tmp_path / "f", lost=0)
    code, out = _check(folder, capsys)
    assert code == 0 and "attempt #1 of its benchmark and pair" in _line(out, "budget 10%: family: ok"), out
    weak = _folder(tmp_path / "weak", lost=3)  # p 0.035 at look 2: certified at 0.05, not at 0.0125
    _history(weak, [f"i{k}" for k in range(80)], earlier=earlier(1) + earlier(2))
    code, out = _check(weak, capsys)
    said = _line(out, "budget 10%: family:")
    assert code == 1 and said.startswith("budget 10%: family: FAILED") and "0.05 x 2^-3 = 0.00625" in said, said
    assert _line(out, "budget 10%: steps:").startswith("budget 10%: steps: ok")


def test_the_replay_audit_of_a_certified_budget_must_hold(tmp_path, capsys):
    """A certified budget whose replayed records were never audited, whose audit found one differing, or that audited
    fewer than sweep.audit owes, fails; so do counts that do not add up."""
    folder = _folder(tmp_path / "f", lost=0)
    _evidence(folder, "trial-0", [f"i{k}" for k in range(80)], _scores(0, 80), made="replayed: exact")
    cert = json.loads((folder / "certification.json").read_text())
    assert cert["budgets"]["0.1"]["certified"]

    def with_check(check: dict | None) -> tuple[int, str]:
        cert["budgets"]["0.1"]["replay_check"] = check
        (folder / "certification.json").write_text(json.dumps(cert))
        return _check(folder, capsys)

    code, out = with_check(None)
    assert code == 1 and "no full decode audited them" in _line(out, "budget 10%: audit: FAILED"), out
    audited = [f"i{k}" for k in range(30)]
    good = {"items": 30, "replayed": 30, "replayed_differ": [], "full_differ": [], "candidate_items": audited,
            "status": "identical", "identical": True, "audit_wanted": 30, "audit_done": 30, "extra_items": 30}
    code, out = with_check(good)
    assert code == 0 and _line(out, "budget 10%: audit:").startswith("budget 10%: audit: ok"), out
    code, out = with_check({**good, "replayed_differ": ["candidate:i3"], "status": "replay differs", "identical": False})
    assert code == 1 and "differs from its full decode" in _line(out, "budget 10%: audit: FAILED")
    code, out = with_check({**good, "audit_done": 20, "candidate_items": audited[:20], "items": 20, "replayed": 20,
                            "extra_items": 20})
    assert code == 1 and "audited 20 of the 30" in _line(out, "budget 10%: audit: FAILED")
    code, out = with_check({**good, "audit_wanted": 12})
    assert code == 1 and "sweep.audit owes" in _line(out, "budget 10%: audit: FAILED")
    code, out = with_check({**good, "status": "unchecked"})
    assert code == 1 and "is not what its counts give" in _line(out, "budget 10%: audit: FAILED")
    code, out = with_check({**good, "power": 0.9})  # a field of a newer audit: said, not recomputed
    assert code == 0 and "not recomputed here: power=0.9" in out


def test_a_certificates_powered_audit_is_made_again_from_the_evidence(tmp_path, capsys):
    """A certificate's audit with a stated power (``replay_check["audit"]``, sweep.audit.audit_plan): the risk-chosen
    and drawn ids, m, N and the seed again from the evidence CSV; an audit that owes other ids, or decoded fewer
    than it owes, fails."""
    import csv as csv_

    from sweep.audit import audit_plan

    folder = _folder(tmp_path / "f", lost=0)
    ids = [f"i{k}" for k in range(80)]
    _evidence(folder, "trial-0", ids, _scores(0, 80), made="replayed: exact")
    with (folder / "evidence" / "trial-0.csv").open() as fh:
        rows = list(csv_.DictReader(fh))
    owed_plan = audit_plan(rows, look_plan(80, 2, 0.05, budget=0.1), 0.1)
    owed = owed_plan["risk_ids"] + owed_plan["sample_ids"]
    assert owed and owed_plan["overturn"] is not None
    good = {"items": len(owed), "replayed": len(owed), "replayed_differ": [], "full_differ": [], "candidate_items": owed,
            "status": "identical", "identical": True, "audit_wanted": len(owed), "audit_done": len(owed),
            "extra_items": len(owed), "audit": {**owed_plan, "audited": len(owed), "achieved": owed_plan["power"]}}
    cert = json.loads((folder / "certification.json").read_text())

    def with_check(check: dict) -> tuple[int, str]:
        cert["budgets"]["0.1"]["replay_check"] = check
        (folder / "certification.json").write_text(json.dumps(cert))
        return _check(folder, capsys)

    code, out = with_check(good)
    said = _line(out, "budget 10%: audit:")
    assert code == 0 and said.startswith("budget 10%: audit: ok") and "powered audit" in said, out
    other = next(i for i in ids if i not in owed)
    code, out = with_check({**good, "candidate_items": [other, *owed[1:]],
                            "audit": {**good["audit"], "sample_ids": [other, *owed_plan["sample_ids"][1:]]}})
    assert code == 1 and "not the one the evidence gives" in _line(out, "budget 10%: audit: FAILED")
    short = owed[:-1]
    code, out = with_check({**good, "items": len(short), "replayed": len(short), "candidate_items": short,
                            "audit_done": len(short), "extra_items": len(short),
                            "audit": {**good["audit"], "audited": len(short)}})
    assert code == 1 and "not carried out in full" in _line(out, "budget 10%: audit: FAILED")


def test_an_empty_lossless_frontier_fails_check_and_export_refuses_it(tmp_path, capsys):
    import pytest

    from jobs.results import export

    folder = _folder(tmp_path / "f")
    (folder / "frontier.json").write_text(json.dumps({"lossless": [], "best_lossless": {"draft_len": None,
                                                                                        "tokens_per_cost": float("nan")},
                                                      "trials": [], "budgets": []}))
    code, out = _check(folder, capsys)
    assert code == 1 and "lossless table is empty" in _line(out, "frontier: FAILED")
    run = tmp_path / "run"
    (run / "report").mkdir(parents=True)
    (run / "report" / "certification.json").write_text((folder / "certification.json").read_text())
    (run / "report" / "frontier.json").write_text((folder / "frontier.json").read_text())
    with pytest.raises(ValueError, match="lossless table is empty"):
        export(run, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert main(["export", "--run-dir", str(run), "--out", str(tmp_path / "out")]) == 2


def test_a_superseded_folder_is_reported_as_such(tmp_path, capsys):
    folder = _folder(tmp_path / "f")
    (folder / "SUPERSEDED.md").write_text("# Superseded: made on reused items\n")
    code, out = _check(folder, capsys)
    assert code == 3 and out.splitlines()[0].startswith("superseded: Superseded: made on reused items")
    assert out.splitlines()[-1].endswith("SUPERSEDED") and verify(folder).superseded is not None


def test_check_names_a_folder_that_is_not_a_results_folder(tmp_path, capsys):
    assert main(["check", str(tmp_path / "missing")]) == 2
    assert "is not a results folder: it has no certification.json" in capsys.readouterr().err
