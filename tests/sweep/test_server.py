"""A fixed server configuration certified as one candidate (``jobs/sweep.py --engine openai --server-config``),
against two small fake OpenAI-compatible servers on 127.0.0.1 (a lossless reference and a lossy candidate, each
with vLLM-style speculative-decoding counters): the screen's knob check refuses a server whose acceptance did not
move before the ledger opens anything, an accepted one is decided per budget with its evidence, its scope and its
speed at the stated concurrency, and a rerun resumes from the records without sending a request."""

from __future__ import annotations

import csv
import json
from typing import Any

import pytest

from tests.workers.fake_openai import FakeServer


@pytest.fixture
def servers():
    with FakeServer() as reference, FakeServer() as candidate:
        for fake in (reference, candidate):
            fake.b.metrics = True
            fake.b.count_delay = 0.05  # drafts counted a moment after each stream ends, as vLLM's front end does
        candidate.b.accepted_per_request = 6  # the lossy mode accepts more of the same drafts
        yield reference, candidate


def argv(reference: FakeServer, candidate: FakeServer, tmp_path, *extra: str) -> list[str]:
    return ["--engine", "openai", "--base-url", candidate.url, "--model", candidate.model, "--pair-id", "fake-pair",
            "--reference-url", reference.url, "--server-config", '{"rejection_sample_method": "fly", "fly_window_size": 6}',
            "--reference-config", '{"rejection_sample_method": "standard"}',
            "--benchmark", "gsm8k", "--items", "6", "--confirm-items", "12", "--budgets", "0.4,0.5",
            "--max-new-tokens", "8", "--concurrency", "4,2", "--speed-items", "4",
            "--runs-root", str(tmp_path), "--run-dir", str(tmp_path / "run"), *extra]


def test_a_fixed_configuration_is_certified_with_its_scope_evidence_and_speed(servers, tmp_path, capsys):
    from jobs import sweep as sweep_job
    from workers.results.ledger import AttemptLedger

    reference, candidate = servers
    assert sweep_job.main(argv(reference, candidate, tmp_path)) == 0
    out = tmp_path / "run" / "report"
    chosen = json.loads((out / "chosen-budget-0.4.json").read_text())
    # same outputs on both sides: no item lost, so 12 items certify a 40% budget at the first attempt's level (0.025)
    assert chosen["certified"] is True and chosen["mode"] == "server-config", chosen["certification"]["reason"]
    assert chosen["endpoint"]["server_config"] == {"rejection_sample_method": "fly", "fly_window_size": 6}
    assert chosen["reference"]["base_url"] == reference.url and chosen["pair_fingerprint"] == "endpoint:fake-pair"
    assert chosen["concurrency"] == 4 and chosen["certification"]["evidence_concurrency"] == 4
    speed = chosen["speed"]
    assert speed["concurrency"] == 4 and speed["candidate"]["acceptance"] == pytest.approx(60 / 80)
    assert speed["reference"]["acceptance"] == pytest.approx(30 / 80) and speed["tokens_per_s_ratio"] > 0
    assert chosen["speed_at"]["2"]["items"] == 4
    assert chosen["screen"]["items"] == 6 and chosen["screen"]["knob_check"] == "applied"
    rows = list(csv.DictReader((out / chosen["certification"]["evidence"]).open()))
    assert len(rows) == chosen["certification"]["n"] and all(r["candidate"] == "ok" for r in rows)
    # the screen ran on search items, the evidence on confirmation items: the two never share one
    ledger = AttemptLedger("gsm8k", "endpoint:fake-pair")
    (attempt,) = ledger.attempts().values()
    assert not set(attempt["items"]) & set(attempt["search_items"]) and len(attempt["search_items"]) == 6
    assert set(attempt["decided"]) == {"0.4", "0.5"}
    assert attempt["endpoint"]["candidate"]["base_url"] == candidate.url  # what the servers said, for an audit
    assert attempt["endpoint"]["reference"]["model_card"]["id"] == reference.model
    assert "CERTIFIED" in (out / "certification.md").read_text()
    sent = reference.b.requests + candidate.b.requests
    # a rerun resumes from the records: nothing is sent again, the ledger adds nothing
    assert sweep_job.main(argv(reference, candidate, tmp_path)) == 0
    assert reference.b.requests + candidate.b.requests == sent
    assert len(AttemptLedger("gsm8k", "endpoint:fake-pair").attempts()) == 1


def test_a_server_whose_acceptance_did_not_move_is_refused_before_any_confirmation_item(servers, tmp_path, capsys):
    from jobs import sweep as sweep_job
    from workers.results.ledger import AttemptLedger

    reference, candidate = servers
    candidate.b.accepted_per_request = reference.b.accepted_per_request  # the server ignored its lossy settings
    assert sweep_job.main(argv(reference, candidate, tmp_path)) == 3
    err = capsys.readouterr().err
    # 6 screen items at concurrency 4: the same acceptance, too few drafted tokens to call it the same within a point
    assert "refused: knob check: cannot tell yet: acceptance 0.375 on 480 drafted tokens" in err, err[-600:]
    assert "drafted tokens a side would decide at these rates" in err
    chosen = json.loads((tmp_path / "run" / "report" / "chosen-budget-0.5.json").read_text())
    assert chosen["certified"] is False and chosen["certification"]["reason"].startswith("refused")
    assert not AttemptLedger("gsm8k", "endpoint:fake-pair").attempts()  # no confirmation item was spent
    assert reference.b.requests == 6 and candidate.b.requests == 6  # the screen only


def test_a_run_directory_of_another_configuration_is_refused_and_speed_items_0_times_nothing_more(servers, tmp_path,
                                                                                                 capsys):
    """Records resume only into the configuration that made them; ``--speed-items 0`` times no further concurrency
    (the evidence's own run still gives the certificate its speed)."""
    from jobs import sweep as sweep_job

    reference, candidate = servers
    assert sweep_job.main(argv(reference, candidate, tmp_path, "--speed-items", "0")) == 0
    chosen = json.loads((tmp_path / "run" / "report" / "chosen-budget-0.5.json").read_text())
    assert "speed_at" not in chosen and chosen["speed"]["items"] == chosen["certification"]["n"] == 12
    assert chosen["certification"]["statement"].startswith("per budget, alpha 0.05 each; across this benchmark")
    assert chosen["certification"]["family"] == {"number": 1, "spending": chosen["certification"]["family"]["spending"],
                                                 "alpha": 0.05, "level": 0.025}
    other = argv(reference, candidate, tmp_path, "--speed-items", "0", "--server-config", '{"fly_window_size": 2}')
    assert sweep_job.main(other) == 2
    assert "holds another configuration's records" in capsys.readouterr().err.strip().splitlines()[-1]


def test_a_benchmark_scored_against_the_reference_is_scored_whichever_side_ran_first(servers, tmp_path):
    """MT-bench scores the candidate's answer against the reference's (similarity): the sides run interleaved, the
    candidate first in every other chunk, so each chunk is scored after both ran, the reference first."""
    from jobs import sweep as sweep_job

    reference, candidate = servers
    extra = ["--benchmark", "mtbench", "--items", "4", "--confirm-items", "40", "--concurrency", "1", "--budgets", "0.5"]
    assert sweep_job.main(argv(reference, candidate, tmp_path, *extra)) == 0
    records = [json.loads(line) for p in (tmp_path / "run" / "confirm").rglob("records.jsonl")
               for line in p.read_text().splitlines()]
    assert len(records) == 80 and all(r["error"] is None and r["score"] > 0.99 for r in records), \
        [r["reason"] for r in records if r["error"]][:2]
    walls = [json.loads(line) for line in (tmp_path / "run" / "confirm" / "c1" / "candidate" / "walls.jsonl")
             .read_text().splitlines()]
    assert len(walls) >= 2, "more than one chunk: the candidate went first in one of them"


@pytest.mark.parametrize("extra, words", [
    (["--reference-url", "http://127.0.0.1:9/v1"], "cannot reach http://127.0.0.1:9/v1: Connection refused"),
    (["--server-config", "{}"], "--server-config: state the configuration's settings"),
    (["--reference-url", "SAME"], "the reference and the candidate are the same requests to the same server"),
])
def test_bad_fixed_configurations_get_one_line(servers, tmp_path, capsys, extra, words):
    from jobs import sweep as sweep_job

    reference, candidate = servers
    extra = [candidate.url if v == "SAME" else v for v in extra]
    assert sweep_job.main(argv(reference, candidate, tmp_path, *extra)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and words in err[-1], err


def test_the_fixed_configuration_flags_need_server_config(tmp_path, capsys):
    from jobs import sweep as sweep_job

    base = ["--engine", "openai", "--base-url", "http://127.0.0.1:9/v1", "--model", "m", "--pair-id", "p",
            "--cost-ratio", "0.4"]
    assert sweep_job.main([*base, "--reference-url", "http://127.0.0.1:8/v1"]) == 2
    assert "--reference-url: only with --server-config" in capsys.readouterr().err
    assert sweep_job.main([*base, "--concurrency", "4,8"]) == 2  # a sweep's speed phase: one concurrency
    assert "a sweep times its speed phase at one concurrency" in capsys.readouterr().err
    assert sweep_job.main(["--pair", "tiny-random", "--dtype", "bf16", "--concurrency", "4"]) == 2
    assert "the cpu engine times a concurrency as its batched rows, on the fast path only" in capsys.readouterr().err


def gsm8k_answers() -> Any:
    """A fake model that is right on every GSM8K item the pool holds: the item whose question the prompt carries."""
    from workers.benchmarks import get_benchmark

    bench = get_benchmark("gsm8k")
    table = [(it.turns[0], str(it.reference)) for it in bench.confirmation_pool([])[0]]

    def answer(prompt: str) -> tuple[str, ...]:
        gold = next((a for q, a in table if q in prompt), "-1")
        return ("The", " answer", " is", f" {gold}", ".")

    return answer


@pytest.mark.parametrize("budgets, gate, right, code, verdict", [
    ("0.4,0.5", "0.4", False, 0, "certified"),  # both sides alike: 12 ties certify 40%
    ("0.05,0.4", "0.05", False, 11, "undecided"),  # 12 ties neither certify nor refute 5%
    ("0.4,0.5", "0.4", True, 10, "refuted"),  # the reference right, the candidate wrong on every item
])
def test_a_gate_exits_with_the_gated_budgets_verdict(servers, tmp_path, capsys, budgets, gate, right, code, verdict):
    """``--gate BUDGET``: 0 certified, 10 refuted (the drop shown above the budget, by its own test at alpha), 11
    undecided; a gated budget is confirmed even where the screen's drop is above it."""
    from jobs import sweep as sweep_job

    reference, candidate = servers
    if right:
        reference.b.answer_of = gsm8k_answers()
    extra = ["--budgets", budgets, "--gate", gate, "--confirm-items", "24" if right else "12"]
    assert sweep_job.main(argv(reference, candidate, tmp_path, *extra)) == code
    chosen = json.loads((tmp_path / "run" / "report" / f"chosen-budget-{gate}.json").read_text())
    assert chosen["verdict"] == verdict == chosen["certification"]["verdict"], chosen["certification"]["reason"]
    err = capsys.readouterr().err
    assert f"gate {float(gate) * 100:g}%: {verdict} (exit {code})" in err
    if right:
        refutation = chosen["certification"]["refutation"]
        assert refutation["refuted"] and refutation["method"] in ("exact-unconditional", "betting"), refutation
        assert "REFUTED" in (tmp_path / "run" / "report" / "certification.md").read_text()
        assert "confirmed all the same (--gate)" in err


def test_a_gate_names_a_budget_of_the_run(servers, tmp_path, capsys):
    from jobs import sweep as sweep_job

    reference, candidate = servers
    assert sweep_job.main(argv(reference, candidate, tmp_path, "--gate", "0.3")) == 2
    assert "--gate 0.3: not one of --budgets (0.4, 0.5)" in capsys.readouterr().err
