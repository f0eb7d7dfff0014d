"""`python -m jobs.ledger`: a family's attempts in order with the next one's level, and rows imported once."""

from __future__ import annotations

import json

from jobs.ledger import main


def test_show_lists_the_shipped_family_and_the_next_attempts_level(tmp_path, capsys):
    assert main(["show", "--benchmark", "gsm8k", "--pair-id", "x", "--ledger", str(tmp_path)]) == 0
    assert "0 attempt(s)" in capsys.readouterr().out
    from workers.results.ledger import AttemptLedger

    shipped = AttemptLedger("gsm8k", "pair:160a47d7a09bd32b511d1dfcb7c21692", tmp_path)
    assert len(shipped.attempts()) == 4


def test_import_adds_rows_once_and_names_a_missing_source(tmp_path, capsys):
    old = tmp_path / "old.jsonl"
    old.write_text(json.dumps({"event": "opened", "attempt": "x1", "benchmark": "gsm8k", "pair_id": "endpoint:x",
                               "budgets": [0.05], "items": ["a", "b"], "search_items": []}) + "\n")
    into = str(tmp_path / "team")
    assert main(["import", str(old), "--ledger", into]) == 0
    assert main(["import", str(old), "--ledger", into]) == 0
    out = capsys.readouterr().out
    assert "1 row(s) added" in out and out.count("0 row(s) added") >= 1
    assert main(["show", "--benchmark", "gsm8k", "--pair-id", "x", "--ledger", into]) == 0
    shown = capsys.readouterr().out
    assert "#1 x1" in shown and "the next attempt is #2: each budget tested at 0.05 x 2^-2 = 0.0125" in shown
    assert main(["import", str(tmp_path / "missing"), "--ledger", into]) == 2
    assert "no such file, folder or URL" in capsys.readouterr().err
