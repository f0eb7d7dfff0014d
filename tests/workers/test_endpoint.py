"""The endpoint engine against a small fake OpenAI-compatible server on 127.0.0.1: one clear line for a server
that cannot be used, retries with backoff for 5xx/drops, 429s waited out, a 4xx not retried, the concurrency
held, timing from the stream, and ``jobs.evaluate --engine openai`` refusing a server that ignores the knobs
while keeping every record (a rerun sends nothing again)."""

from __future__ import annotations

import json
import math
import re
from datetime import UTC

import pytest

from tests.workers.fake_openai import FakeServer
from workers.endpoint import (
    Endpoint,
    EndpointError,
    RequestFailed,
    acceptance_between,
    check,
    complete,
    parse_counters,
    settled_counters,
)

MESSAGES = [{"role": "user", "content": "2 + 40?"}]


@pytest.fixture
def fake():
    with FakeServer() as server:
        yield server


def ep(fake: FakeServer, **kw) -> Endpoint:
    return Endpoint(fake.url, fake.model, **{"retries": 3, "backoff_s": 0.0, **kw})


def test_a_server_that_cannot_be_used_is_one_line(fake, monkeypatch):
    with pytest.raises(EndpointError, match=r"^cannot reach http://127.0.0.1:9/v1: Connection refused$"):
        check(Endpoint("http://127.0.0.1:9/v1", "m", connect_timeout_s=2))
    with pytest.raises(EndpointError, match="model 'other' is not served at .*; it serves: fake/model"):
        check(Endpoint(fake.url, "other"))
    fake.b.api_key = "sekrit"
    with pytest.raises(EndpointError, match="refused the request: HTTP 401 .set --api-key-env."):
        check(ep(fake))
    with pytest.raises(EndpointError, match="--api-key-env FAKE_KEY: that environment variable is not set"):
        check(ep(fake, api_key_env="FAKE_KEY"))
    monkeypatch.setenv("FAKE_KEY", "sekrit")
    assert check(ep(fake, api_key_env="FAKE_KEY"))["id"] == "fake/model"
    for bad in ("127.0.0.1:8000", "", "ftp://x/v1"):
        with pytest.raises(EndpointError, match="--base-url must be an http"):
            Endpoint(bad, "m")


def test_a_stream_is_timed_and_counted_from_the_server(fake):
    fake.b.first_token_delay, fake.b.token_delay = 0.3, 0.02
    reply = complete(ep(fake), MESSAGES, max_tokens=16)
    assert reply.text == "The answer is 42." and reply.finish == "stop" and reply.completion_tokens == 5
    assert reply.ttft_s >= 0.3 and reply.seconds >= reply.ttft_s + 4 * 0.02
    assert 0.015 < reply.tpot_s < 0.2 and reply.attempts == 1
    assert fake.b.bodies[0]["stream"] is True and fake.b.bodies[0]["stream_options"] == {"include_usage": True}
    done = complete(ep(fake), None, "Q: 2 + 40?\nA:", max_tokens=2)  # /v1/completions
    assert done.text == "The answer" and done.completion_tokens == 2


def test_5xx_and_broken_streams_are_retried_with_backoff_and_429s_wait_their_retry_after(fake):
    waits: list[float] = []
    fake.b.fail_500, fake.b.drop_stream = 2, 1
    reply = complete(ep(fake, backoff_s=0.1), MESSAGES, max_tokens=16, sleep=waits.append)
    assert reply.attempts == 4 and reply.text == "The answer is 42."
    assert len(waits) == 3 and 0.1 <= waits[0] <= 0.2 and 0.2 <= waits[1] <= 0.4, "doubling, with jitter"
    waits.clear()
    fake.b.fail_429, fake.b.retry_after = 2, "1.5"
    assert complete(ep(fake), MESSAGES, max_tokens=16, sleep=waits.append).attempts == 3
    assert waits == [1.5, 1.5], "a 429's Retry-After is what it waits"


def test_what_still_fails_raises_once_and_a_4xx_is_not_retried(fake):
    fake.b.always_500 = True
    with pytest.raises(RequestFailed, match=r"HTTP 500.*after 4 attempts") as err:
        complete(ep(fake), MESSAGES, max_tokens=16, sleep=lambda _: None)
    assert err.value.attempts == 4 and fake.b.requests == 4
    fake.b.always_500, fake.b.bad_request, fake.b.requests = False, True, 0
    with pytest.raises(RequestFailed, match="HTTP 400: max_tokens: too large"):
        complete(ep(fake), MESSAGES, max_tokens=16, sleep=lambda _: None)
    assert fake.b.requests == 1


def test_prometheus_counters_give_the_acceptance_between_two_reads():
    text = ('# HELP x\nvllm:spec_decode_num_draft_tokens_total{engine="0"} 100.0\n'
            'vllm:spec_decode_num_draft_tokens_total{engine="1"} 20.0\n'
            'vllm:spec_decode_num_accepted_tokens_total{engine="0"} 60\nvllm:spec_decode_num_drafts_total 30\n'
            'vllm:spec_decode_num_draft_tokens_created 1.7e9\n')
    got = parse_counters(text)
    assert got == {"draft_tokens": 120.0, "accepted_tokens": 60.0, "drafts": 30.0}
    assert parse_counters("other_metric 1\n") is None
    assert acceptance_between(got, {**got, "draft_tokens": 220.0, "accepted_tokens": 110.0}) == 0.5
    assert acceptance_between(None, got) is None


@pytest.mark.parametrize("kind", ["vllm", "trt"])
def test_counters_are_read_once_the_server_has_counted_the_last_reply(fake, kind):
    """A server counts a request's drafts a moment after its stream ends: the read after a chunk waits for it."""
    fake.b.metrics, fake.b.metrics_kind, fake.b.count_delay = True, kind, 0.1
    before = settled_counters(ep(fake))
    assert complete(ep(fake), MESSAGES, max_tokens=4).completion_tokens == 4
    after = settled_counters(ep(fake))
    assert after["draft_tokens"] - (0 if kind == "trt" else before["draft_tokens"]) == 80, after
    fake.b.count_delay = 0.0
    assert settled_counters(ep(fake))["draft_tokens"] == (0 if kind == "trt" else 80), "nothing counted twice"


def evaluate(fake: FakeServer, tmp_path, *extra: str) -> int:
    from jobs import evaluate as evaluate_job

    return evaluate_job.main(["--engine", "openai", "--base-url", fake.url, "--model", fake.model, "--benchmark",
                              "gsm8k", "--limit", "6", "--max-new-tokens", "16", "--runs-root", str(tmp_path),
                              "--retries", "1", *extra])


def test_evaluate_prints_both_sides_per_concurrency_and_resumes_without_sending_again(fake, tmp_path, capsys):
    fake.b.token_delay = 0.01
    assert evaluate(fake, tmp_path, "--policy", "kl_judge", "--param", "threshold=0.5", "--concurrency", "1,4") == 0
    out = capsys.readouterr().out
    for level in (1, 4):
        assert f"concurrency {level}:" in out
    assert out.count("TPOT p50") == 4 and "candidate over reference: tokens/s" in out and "n=6" in out
    assert 1 < fake.b.max_in_flight <= 4, "concurrency 4 held, and used"
    sent = [b for b in fake.b.bodies if b.get("spec_decode", {}).get("policy") == "kl_judge"]
    assert len(sent) == 12 and sent[0]["spec_decode"]["params"]["threshold"] == 0.5 and "seed" not in sent[0]
    assert sum(b["spec_decode"] == {"policy": "off"} for b in fake.b.bodies) == 12
    # each chunk's prompts are sent once, untimed, one token, before either side's clock (one server: once per item)
    assert fake.b.warmups == 12
    before = fake.b.requests
    assert evaluate(fake, tmp_path, "--policy", "kl_judge", "--param", "threshold=0.5", "--concurrency", "1,4") == 0
    assert fake.b.requests == before and fake.b.warmups == 12, "a rerun resumes from its records"
    summary = json.loads(next(tmp_path.glob("eval-endpoint/*/*/summary.json")).read_text())
    assert summary["knobs_applied"] and summary["levels"]["4"]["candidate"]["items"] == 6


def test_a_server_that_ignores_the_knobs_is_refused_in_one_line_and_nothing_is_lost(fake, tmp_path, capsys):
    fake.b.report_rule = False
    assert evaluate(fake, tmp_path, "--policy", "kl_judge") == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("refused: knob check: ignored: the candidate asked for {")
    assert "but the server reported no rule" in err[-1]
    stored = list(tmp_path.glob("eval-endpoint/*/*/c1/candidate/records.jsonl"))
    assert stored and len(stored[0].read_text().splitlines()) == 6


def test_a_fixed_server_configuration_is_checked_by_its_metrics(fake, tmp_path, capsys):
    """--knobs none: the candidate's extra body is the server's business; acceptance from /metrics must move, or
    the outputs at T = 0 and one request in flight differ. Identical outputs over 480 drafted tokens: ignored."""
    fake.b.metrics = True
    rc = evaluate(fake, tmp_path, "--knobs", "none", "--extra-body", '{"my_engine_threshold": 0.3}')
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 3 and err.startswith("refused: knob check: ignored: outputs identical to the reference's on all 6 "
                                      "items at T = 0 with one request in flight, over 480 drafted tokens"), err
    assert evaluate(fake, tmp_path / "same", "--knobs", "none") == 2, "the same configuration on both sides"
    assert "the reference and the candidate are the same configuration" in capsys.readouterr().err
    fake.b.metrics = False
    rc = evaluate(fake, tmp_path / "b", "--knobs", "none", "--extra-body", '{"my_engine_threshold": 0.3}')
    err = capsys.readouterr().err
    assert rc == 3 and "knob check: cannot tell yet: the replies carry no rule report and the server's /metrics has no " \
        "speculative-decoding counts" in err, err


def test_tensorrt_llms_drained_iteration_stats_are_the_counts_of_what_ran_between_reads():
    from workers.endpoint import counts_between, parse_iteration_stats

    rows = [{"iter": 1, "specDecodingStats": {"numDraftTokens": 30, "numAcceptedTokens": 12}},
            {"iter": 1, "attentionDpRank": 1, "specDecodingStats": {"numDraftTokens": 30, "numAcceptedTokens": 12}},
            {"iter": 2, "specDecodingStats": {"numDraftTokens": 10, "numAcceptedTokens": 9}}, {"iter": 3}]
    got = parse_iteration_stats(json.dumps(rows))
    assert got == {"draft_tokens": 40.0, "accepted_tokens": 21.0, "drained": 1.0}, "an attention-DP copy is skipped"
    assert counts_between({"draft_tokens": 999.0, "drained": 1.0}, got) == (21.0, 40.0)
    assert parse_iteration_stats("[]") == {"draft_tokens": 0.0, "accepted_tokens": 0.0, "drained": 1.0}
    assert parse_iteration_stats("not json") is None
    assert parse_iteration_stats(json.dumps([json.dumps(rows[0])]))["draft_tokens"] == 30.0, "rows as JSON strings"
    assert parse_counters('sglang:spec_accept_rate{model_name="m"} 0.61\n') == {"accept_rate_gauge": 0.61}


def test_a_gauge_that_stayed_at_zero_is_a_reference_that_does_not_speculate():
    from workers.endpoint_checks import _gauge_verdict

    moving = [0.61, 0.63, 0.6, 0.64, 0.62, 0.65]
    assert _gauge_verdict(moving, [0.0]).verdict == "applied"
    assert _gauge_verdict(moving, [0.6, 0.62, 0.61, 0.63, 0.64]).verdict == "cannot tell yet", "too few windows"
    assert _gauge_verdict(moving * 3, [0.625, 0.62, 0.635, 0.62, 0.63, 0.625] * 3).verdict == "ignored"
    assert _gauge_verdict(moving, [0.3, 0.32, 0.31, 0.33, 0.34]).verdict == "applied"
    assert _gauge_verdict(moving[:3], []).verdict == "cannot tell yet"


@pytest.mark.parametrize("kind", ["trt", "sglang"])
def test_a_fixed_configuration_on_tensorrt_llm_or_sglang_is_checked_by_their_metrics(tmp_path, capsys, kind):
    """TensorRT-LLM's iteration stats give counts per chunk; SGLang's gauge is sampled while each chunk runs (its
    distinct windows on each side compared): where acceptance moved the check passes, where not it refuses."""
    with FakeServer() as reference, FakeServer() as candidate:
        for fake in (reference, candidate):
            fake.b.metrics, fake.b.metrics_kind, fake.b.token_delay = True, kind, 0.05 if kind == "sglang" else 0.0
        candidate.b.accepted_per_request = 6
        args = ["--knobs", "none", "--reference-url", reference.url, "--limit", "16" if kind == "sglang" else "6"]
        assert evaluate(candidate, tmp_path, *args) == 0, capsys.readouterr().err
        assert "acceptance 0.75" in capsys.readouterr().out or kind == "sglang"
        candidate.b.accepted_per_request = reference.b.accepted_per_request  # the settings did nothing
        assert evaluate(candidate, tmp_path / "same", *args) == 3
        assert "refused: knob check: ignored: " in capsys.readouterr().err


def test_a_stock_vllm_serve_gets_the_rule_as_a_json_string_in_vllm_xargs(fake, tmp_path, capsys):
    """--knobs vllm: the plugin reads ``vllm_xargs.spectune_rule`` (vLLM's xargs hold scalars only); the
    reference is the server's own lossless rule; the check reads /metrics, where acceptance moved."""
    fake.b.metrics = True
    assert evaluate(fake, tmp_path, "--knobs", "vllm", "--policy", "kl_judge", "--param", "threshold=0.7",
                    "--seed", "3") == 0, capsys.readouterr().err
    cand = [b for b in fake.b.bodies if "vllm_xargs" in b]
    assert len(cand) == 6 and len(fake.b.bodies) == 12 and "spec_decode" not in cand[0]
    rule = json.loads(cand[0]["vllm_xargs"]["spectune_rule"])
    assert rule["policy"] == "kl_judge" and rule["params"]["threshold"] == 0.7 and rule["seed"] == 3
    assert "acceptance" in capsys.readouterr().out
    assert evaluate(fake, tmp_path, "--knobs", "vllm", "--policy", "lossless") == 2


def test_failed_requests_count_against_their_side_and_the_batch_goes_on(fake, tmp_path, capsys):
    fake.b.always_500 = True
    assert evaluate(fake, tmp_path, "--policy", "kl_judge", "--request-timeout", "5") in (0, 3)
    out = capsys.readouterr().out
    assert "failed 6" in out
    records = [json.loads(line) for p in tmp_path.glob("eval-endpoint/*/*/c1/*/records.jsonl")
               for line in p.read_text().splitlines()]
    assert len(records) == 12 and all(r["error"].startswith("RequestFailed") for r in records)
    assert all(math.isnan(float(r["score"])) or r["score"] == "nan" for r in records)


def test_bad_flags_are_one_line(tmp_path, capsys):
    from jobs import evaluate as evaluate_job

    base = ["--engine", "openai", "--model", "m", "--benchmark", "gsm8k", "--runs-root", str(tmp_path)]
    assert evaluate_job.main(base) == 2
    assert capsys.readouterr().err.strip() == ("error: --engine openai needs --base-url (the server's OpenAI base url, "
                                               "e.g. http://127.0.0.1:8000/v1)")
    for extra, message in ((["--extra-body", "{nope"], "--extra-body must be a JSON object"),
                           (["--concurrency", "2,x"], "--concurrency must be integers"),
                           (["--policy", "target-only"], "is the reference itself")):
        assert evaluate_job.main([*base, "--base-url", "http://127.0.0.1:9/v1", *extra]) == 2
        assert message in capsys.readouterr().err


def test_raw_utf8_line_separators_and_a_missing_charset_are_read_as_utf8(fake):
    """vLLM and SGLang send non-ASCII unescaped; U+2028 and U+0085 must not split an event, and an event stream
    without a charset is still UTF-8."""
    fake.b.raw_utf8, fake.b.words = True, ("café", " \u2028x", " х\u0085", "!")
    reply = complete(ep(fake), MESSAGES, max_tokens=16)
    assert reply.text == "café \u2028x х\u0085!" and reply.attempts == 1


def test_a_reasoning_model_is_timed_from_its_first_thought(fake):
    fake.b.first_token_delay, fake.b.token_delay, fake.b.reasoning = 0.05, 0.05, ("Let", " me", " think")
    reply = complete(ep(fake), MESSAGES, max_tokens=16)
    assert reply.ttft_s < 0.09 and reply.text == "The answer is 42." and reply.completion_tokens == 8


def test_connections_are_kept_between_requests(fake):
    for _ in range(4):
        complete(ep(fake), MESSAGES, max_tokens=16)
    assert len(fake.b.ports) == 1, "the stream is read to its end, so the connection is reused"


def test_an_aborted_stream_is_retried_an_in_stream_4xx_is_not_and_an_http_date_retry_after_is_read(fake):
    from datetime import datetime, timedelta
    from email.utils import format_datetime

    from workers.endpoint import _retry_after

    fake.b.abort_next = 1
    assert complete(ep(fake), MESSAGES, max_tokens=16, sleep=lambda _: None).attempts == 2
    fake.b.stream_error, fake.b.requests = 400, 0
    with pytest.raises(RequestFailed, match="stream carried error 400"):
        complete(ep(fake), MESSAGES, max_tokens=16, sleep=lambda _: None)
    assert fake.b.requests == 1
    when = format_datetime(datetime.now(UTC) + timedelta(seconds=30), usegmt=True)
    assert 25 < _retry_after(when) <= 30 and _retry_after("2") == 2.0 and _retry_after("soon") is None


def test_429s_are_waited_out_apart_from_the_retries(fake):
    fake.b.fail_429 = 6  # more than the 3 retries
    waits: list[float] = []
    assert complete(ep(fake), MESSAGES, max_tokens=16, sleep=waits.append).attempts == 7 and waits == [0.0] * 6


def test_an_extra_body_may_not_change_how_requests_are_streamed_or_counted(fake):
    with pytest.raises(EndpointError, match="may not set max_tokens, stream"):
        ep(fake, extra_body={"stream": False, "max_tokens": 3})


def test_an_interrupted_chunks_stored_records_are_kept_untimed_and_never_drawn_again(fake, tmp_path, capsys):
    """A crash between a chunk's records and its wall line: the rerun keeps those records (an item's outcome is drawn
    once) and sends only what is missing; the untimed records do not count in tokens/s."""
    assert evaluate(fake, tmp_path, "--policy", "kl_judge") == 0
    sent = fake.b.requests
    for side in ("reference", "candidate"):
        walls = next(tmp_path.glob(f"eval-endpoint/*/*/c1/{side}/walls.jsonl"))
        walls.write_text("")  # the crash came before any wall line
        if side == "candidate":
            records = next(tmp_path.glob("eval-endpoint/*/*/c1/candidate/records.jsonl"))
            lines = records.read_text().splitlines()
            records.write_text("\n".join(lines[:4]) + "\n")  # and after 4 of the candidate's 6 records
    assert evaluate(fake, tmp_path, "--policy", "kl_judge") == 0
    out = capsys.readouterr().out
    assert fake.b.requests == sent + 2, "only the 2 candidate items never stored are sent"
    assert "tokens/s counts 0 of 6 items" in out and "tokens/s counts 2 of 6 items" in out


def test_a_rerun_over_other_items_times_only_the_chunks_wholly_its_own(fake, tmp_path, capsys):
    assert evaluate(fake, tmp_path, "--policy", "kl_judge", "--limit", "10") == 0  # chunks of 2 items: 5 a side
    sent = fake.b.requests
    assert evaluate(fake, tmp_path, "--policy", "kl_judge", "--limit", "3") == 0
    out = capsys.readouterr().out
    assert fake.b.requests == sent and "tokens/s counts 2 of 3 items" in out, "the chunk of items 2 and 3 is not timed"
    assert "no interval: 1 paired chunk, 5 are needed" in out
    walls = next(tmp_path.glob("eval-endpoint/*/*/c1/candidate/walls.jsonl"))
    walls.write_text(walls.read_text() + '{"items": ["x"], "wal')  # a line torn by a crash: skipped when read
    assert evaluate(fake, tmp_path, "--policy", "kl_judge", "--limit", "3") == 0
    assert fake.b.requests == sent and "tokens/s counts 2 of 3 items" in capsys.readouterr().out
    assert evaluate(fake, tmp_path, "--policy", "kl_judge", "--limit", "3", "--fresh") == 0
    assert fake.b.requests == sent + 6 and "tokens/s counts" not in capsys.readouterr().out


def test_the_knob_check_says_applied_ignored_or_cannot_tell_yet_with_what_would_decide(fake, tmp_path, capsys):
    """--knobs vllm at T = 0: a rule that changes outputs at one request in flight is applied (no /metrics needed);
    identical outputs over too few drafted tokens cannot tell yet, and say how many tokens (and items) would."""
    fake.b.rule_words = ("The", " answer", " is", " 41", ".")  # the rule acts: another output
    assert evaluate(fake, tmp_path, "--knobs", "vllm", "--policy", "kl_judge") == 0
    out = capsys.readouterr().out
    assert "knob check: applied: the candidate's outputs differ from the reference's on 6 of 6 items at T = 0" in out
    fake.b.rule_words, fake.b.metrics = None, True  # ignored, on 2 items: 160 drafted tokens a side
    fake.b.report_rule = False  # (the fake's rules then accept no more than the server's own)
    assert evaluate(fake, tmp_path / "few", "--knobs", "vllm", "--policy", "kl_judge", "--limit", "2") in (0, 3)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("refused: knob check: cannot tell yet: outputs identical to the reference's on all 2 items"), err
    assert "drafted tokens a side would decide at these rates" in err
    assert "or 299 drafted tokens at one request in flight with no output differing (~4 items)" in err, err


def _run(concurrency: int, pairs: list[tuple[list[str], list[str]]], counts: tuple, ref_counts: tuple):
    """A synthetic comparison: items with (reference, candidate) outputs and one chunk's /metrics counts a side."""
    from types import SimpleNamespace

    from workers.endpoint_eval import Comparison, SideRun

    def rec(i: int, outputs: list[str]) -> SimpleNamespace:
        return SimpleNamespace(item_id=f"i{i}", outputs=outputs, failed=False, params="{}", tokens=10,
                               finish_reasons=["stop"])

    ids = [f"i{i}" for i in range(len(pairs))]
    sides = [SideRun({f"i{i}": rec(i, p[k]) for i, p in enumerate(pairs)},
                     [{"items": ids, "wall_s": 1.0, "counts": c}]) for k, c in ((0, ref_counts), (1, counts))]
    return Comparison(concurrency, *sides)


def test_the_knob_check_pools_every_level_and_reads_outputs_only_at_t0_and_one_in_flight():
    """The issue's run: acceptance 0.819 on 740 drafted tokens against 0.767 on 780 at each of two levels (z about
    2.5 each): one level cannot tell, the two pooled are applied. At T > 0 or concurrency 4, outputs say nothing."""
    from workers.endpoint import Endpoint
    from workers.endpoint_checks import knob_verdict
    from workers.endpoint_eval import Side

    url = "http://127.0.0.1:9/v1"
    ref = Side("reference", Endpoint(url, "m"), "server")
    cand = Side("candidate", Endpoint(url, "m", extra_body={"vllm_xargs": {"spectune_rule": "{}"}}), "kl_judge")
    same = [(["a"], ["a"])] * 16
    level = [_run(c, same, (606.0, 740.0), (598.0, 780.0)) for c in (1, 4)]
    one = knob_verdict(ref, cand, level[:1], temperature=0.7)
    assert one.verdict == "cannot tell yet" and re.search(r"about [\d,]+ drafted tokens a side would decide at these "
                                                          r"rates \(~\d+ items at this run's 46 an item\)", one.needed)
    both = knob_verdict(ref, cand, level, temperature=0.7)
    assert both.verdict == "applied" and "pooled over every chunk and level" in both.evidence
    differ = [(["a"], ["b"])] * 4 + [(["a"], ["a"])] * 4
    at4 = _run(4, differ, (80.0, 100.0), (80.0, 100.0))
    assert knob_verdict(ref, cand, [at4], temperature=0.0).verdict == "cannot tell yet", "C = 4: not batch-invariant"
    at1 = _run(1, differ, (80.0, 100.0), (80.0, 100.0))
    assert knob_verdict(ref, cand, [at1], temperature=0.7).verdict == "cannot tell yet", "T > 0: sampled"
    assert knob_verdict(ref, cand, [at1], temperature=0.0).verdict == "applied"
    big = _run(4, same, (40_000.0, 100_000.0), (40_100.0, 100_000.0))
    got = knob_verdict(ref, cand, [big], temperature=0.7)
    assert got.verdict == "ignored" and "the same within 0.01" in got.evidence, got.line()


def test_the_speed_ratio_has_an_interval_from_paired_chunks_and_says_when_it_holds_one():
    from types import SimpleNamespace

    from workers.endpoint_checks import chunk_size, speed_interval
    from workers.endpoint_eval import Comparison, SideRun

    assert chunk_size(16, 1) == 3 and chunk_size(200, 1) == 16 and chunk_size(30, 4) == 6 and chunk_size(8, 4) == 4

    def cmp(walls_ref: list[float], walls_cand: list[float]) -> Comparison:
        runs = []
        for walls in (walls_ref, walls_cand):
            recs = {f"i{k}": SimpleNamespace(tokens=100, failed=False) for k in range(len(walls))}
            runs.append(SideRun(recs, [{"items": [f"i{k}"], "wall_s": w, "load": 1.0 + k / 10}
                                       for k, w in enumerate(walls)]))
        return Comparison(1, *runs)

    noisy = speed_interval(cmp([1.0, 1.2, 0.9, 1.1, 1.0, 0.95], [1.1, 1.0, 1.0, 1.2, 0.9, 1.0]))
    assert noisy.low < 1.0 < noisy.high and noisy.chunks == 6 and "it holds 1.0, no speed difference is shown" in \
        noisy.text() and "this machine's load 1.0-1.5 on" in noisy.text()
    fast = speed_interval(cmp([2.0, 2.2, 1.9, 2.1, 2.0], [1.0, 1.1, 1.0, 1.05, 0.95]))
    assert 1.0 < fast.low <= fast.ratio <= fast.high and "holds" not in fast.text()
    assert fast.ratio == pytest.approx(10.2 / 5.1)
    few = speed_interval(cmp([1.0, 1.0, 1.0], [0.5, 0.5, 0.5]))
    assert few.low is None and "no interval: 3 paired chunks, 5 are needed" in few.text()


def test_replies_cut_at_the_length_limit_are_counted_and_warned_of(fake, tmp_path, capsys):
    fake.b.finish = "length"
    assert evaluate(fake, tmp_path, "--policy", "kl_judge") == 0
    out = capsys.readouterr().out
    assert out.count("at the length limit 6/6") == 2
    assert "warning: 6 of 6 reference replies (100%) and 6 of 6 candidate replies (100%) stopped at the length limit " \
           "(16 new tokens)" in out and "--shots" in out


def test_progress_comes_per_item_and_at_least_every_30_s_while_the_server_is_silent():
    import time

    from workers.endpoint_eval import Progress

    lines: list[str] = []
    progress = Progress(lines.append, 2, total=4, every_s=0.3, gap_s=0.0)
    progress.at(" (chunk 1/2, reference)")
    progress.done(10)
    time.sleep(0.8)  # nothing finishes: the heartbeat speaks
    progress.done(10)
    progress.stop()
    assert lines[0].startswith("concurrency 2: 1/4 requests done (chunk 1/2, reference) |") and "ETA" in lines[0]
    assert any(line.endswith("(waiting on the server)") for line in lines[1:-1]) and lines[-1].startswith(
        "concurrency 2: 2/4 requests done")
    assert Progress(lines.append, 1, total=1).every_s == 30.0


def test_top_k_and_top_p_reach_the_server_on_both_sides_and_name_the_run(fake, tmp_path, capsys):
    """The server samples both arms from the same truncated distribution: the reference (target alone) and the
    candidate requests carry the same top_k / top_p, and the run's spec key holds them."""
    assert evaluate(fake, tmp_path, "--policy", "kl_judge", "--temperature", "0.7", "--top-k", "20", "--top-p",
                    "0.9", "--concurrency", "2") == 0
    timed = [b for b in fake.b.bodies if b.get("max_tokens") == 16]
    assert len(timed) == 12 and all(b["top_k"] == 20 and b["top_p"] == 0.9 for b in timed)
    assert {b["spec_decode"]["policy"] for b in timed} == {"off", "kl_judge"}
    assert not any("top_k" in b for b in fake.b.bodies if b.get("max_tokens") != 16), "warm-ups are not sampled"
    fake.b.bodies.clear()
    assert evaluate(fake, tmp_path, "--policy", "kl_judge", "--temperature", "0.7", "--top-p", "0.9", "--extra-body",
                    '{"top_p": 0.5}') == 2
    assert not fake.b.bodies, "a clash is refused before any request"
    err = capsys.readouterr().err
    assert "--extra-body sets top_p and so does --top-p" in err and "Traceback" not in err
