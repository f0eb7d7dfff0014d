"""The replay audit of a certificate through a tiny-pair sweep: on the int8 path confirmation replays, a budget
certifies, and its chosen file states the audit (m, N, s, the risk-chosen, the power, the seed and the ids), which
the evidence CSV alone recomputes and which every owed record's full decode carried out."""

from __future__ import annotations

import csv
import json

import pytest

pytestmark = pytest.mark.slow


def test_a_replayed_certificate_states_an_audit_its_evidence_recomputes(tmp_path, monkeypatch):
    from jobs import sweep as sweep_job
    from sweep.audit import POWER, audit_matches, could_hide_loss
    from workers.certify.sequential import look_plan

    # every output scores right (the empty reference is the match at its start): every replayed tie could hide a loss
    rows = [{"qid": f"q{i:02d}", "question": f"What is {i} plus {i % 7}?", "answer": ""} for i in range(48)]
    (tmp_path / "items.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = tmp_path / "always.yaml"
    task.write_text("name: always\ndata: items.jsonl\nid: qid\nprompt: \"Q: {question}\\nA:\"\nreference: answer\n"
                    "scorer: \"regex:^()\"\nmax_new_tokens: 4\n")
    monkeypatch.setenv("SPECTUNE_LEDGER", str(tmp_path / "ledger"))
    run_dir = tmp_path / "sweep"
    rc = sweep_job.main(["--benchmark", str(task), "--pair", "tiny-random", "--dtype", "int8", "--items", "6",
                         "--actors", "1", "--budgets", "0.4", "--policies", "kl_judge", "--draft-len", "3",
                         "--enqueue", "kl_judge:threshold=0.1,confidence=1,draft_len=3", "--cost-ratio", "0.4",
                         "--verify-factor", "1.2", "--trials", "1", "--confirm-items", "24", "--speed-items", "1",
                         "--replay", "auto", "--runs-root", str(tmp_path), "--run-dir", str(run_dir)])
    assert rc == 0
    report = run_dir / "report"
    chosen = json.loads((report / "chosen-budget-0.4.json").read_text())
    assert chosen["certified"], chosen["certification"]["reason"]
    check = chosen["replay_check"]
    stated = check["audit"]
    with (report / chosen["certification"]["evidence"]).open() as fh:
        evidence = list(csv.DictReader(fh))
    assert any(r["candidate_made"].startswith("replayed") for r in evidence), "confirmation replayed"
    n = stated["n"]
    assert stated["eligible"] == sum(could_hide_loss(r) for r in evidence[:n]) > 0
    assert stated["risk"] > 0 and 0 < stated["sample"] <= stated["eligible"], "both parts: risk-chosen and drawn"
    assert stated["overturn"] is not None and stated["power"] >= POWER and stated["achieved"] >= POWER
    assert stated["audited"] == stated["risk"] + stated["sample"] == check["audit_done"] == check["audit_wanted"]
    assert set(stated["risk_ids"] + stated["sample_ids"]) <= set(check["candidate_items"])
    assert check["identical"] and not check["replayed_differ"]
    c = chosen["certification"]
    assert not c.get("sequential") or len(c["sequential"]["sizes"]) == 1
    plan = look_plan(c["n"], 1, c["alpha"])
    assert audit_matches(stated, evidence, plan, 0.4), "the evidence CSV alone recomputes the audit"
