"""The Serve app over real HTTP on 127.0.0.1, on the tiny pair: OpenAI shapes, streaming, per-request
overrides, every error path, backpressure, concurrency, Prometheus metrics, the official client."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from cluster.runtime import init_ray
from cluster.serve_app import ServeSettings, build_app

pytestmark = pytest.mark.slow

MODEL = "spectune/tiny-random"
FAIL = "<<fail-here>>"
KEY_ENV, KEY = "SPECTUNE_TEST_SERVE_KEY", "sk-test-0123456789"  # the "tight" app asks for this key


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, timeout: float = 600) -> None:
    end = time.time() + timeout
    while time.time() < end:
        try:
            if requests.get(f"{url}/healthz", timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{url} never became healthy")


@pytest.fixture(scope="module")
def server():
    import os

    import ray

    # a replica reads its key from its own environment, which a local Ray's workers take from this process when
    # Ray starts: start it after the variable is set
    os.environ[KEY_ENV] = KEY
    if ray.is_initialized():
        ray.shutdown()
    init_ray(num_cpus=2)
    from ray import serve

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    main = ServeSettings(pair="tiny-random", dtype="fp32", policy="kl_judge", params={"threshold": 0.5}, draft_len=4,
                         num_cpus=0.1, max_ongoing_requests=8, max_queued_requests=32, fail_marker=FAIL,
                         source={"kind": "flags"}, limits={"max_prompt_tokens": 1000, "max_tokens": 300,
                                                           "max_body_bytes": 20_000})
    tight = ServeSettings(pair="tiny-random", dtype="fp32", policy="lossless", num_cpus=0.1,
                          max_ongoing_requests=1, max_queued_requests=1, api_key_env=KEY_ENV)
    serve.run(build_app(main), name="main", route_prefix="/", blocking=False)
    serve.run(build_app(tight), name="tight", route_prefix="/tight", blocking=False)
    base = f"http://127.0.0.1:{port}"
    wait_healthy(base)
    wait_healthy(base + "/tight")
    yield base
    serve.shutdown()
    os.environ.pop(KEY_ENV, None)


def post(url: str, path: str, body: dict | bytes, stream: bool = False, key: str | None = None) -> requests.Response:
    auth = {"authorization": f"Bearer {key}"} if key else {}
    if isinstance(body, bytes):
        return requests.post(url + path, data=body, headers={"content-type": "application/json", **auth}, timeout=300)
    return requests.post(url + path, json=body, timeout=300, stream=stream, headers=auth)


def events(resp: requests.Response) -> list:
    out = []
    for line in resp.iter_lines(decode_unicode=True):
        if line.startswith("data: "):
            payload = line[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def test_models_policy_and_health(server):
    models = requests.get(server + "/v1/models", timeout=30).json()
    assert models["object"] == "list" and models["data"][0]["id"] == MODEL
    pol = requests.get(server + "/v1/policy", timeout=30).json()
    assert (pol["policy"], pol["params"], pol["draft_len"], pol["source"]["kind"]) == ("kl_judge", {"threshold": 0.5}, 4, "flags")
    assert requests.get(server + "/healthz", timeout=30).json()["status"] == "ok"


def test_completion_has_usage_and_per_request_spec_metrics(server):
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "Q: 2+2=\nA:", "max_tokens": 20,
                                         "temperature": 0, "seed": 1})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    choice = body["choices"][0]
    assert isinstance(choice["text"], str) and choice["finish_reason"] in ("stop", "length")
    use, sd = body["usage"], body["spec_decode"]
    assert use["total_tokens"] == use["prompt_tokens"] + use["completion_tokens"] and use["completion_tokens"] >= 1
    assert sd["policy"] == "kl_judge" and sd["draft_len"] == 4 and len(sd["accepted_per_position"]) == 4
    assert 0 <= sd["num_accepted_tokens"] <= sd["num_draft_tokens"] and sd["num_drafts"] >= 1
    assert sd["mean_acceptance_length"] == pytest.approx(use["completion_tokens"] / sd["num_drafts"])
    assert sd["draft_acceptance_rate"] == pytest.approx(sd["num_accepted_tokens"] / sd["num_draft_tokens"])
    assert sd["in_certificate"] is False  # a rule given by flags has no certificate


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_streamed_text_equals_non_streamed_text(server, path, temperature):
    chat = path.endswith("chat/completions")
    body = {"model": MODEL, "max_tokens": 40, "temperature": temperature, "seed": 11, "stop": ["\n\n"]}
    body.update({"messages": [{"role": "user", "content": "Tell me a story"}]} if chat else {"prompt": "Once upon"})
    whole = post(server, path, body).json()
    r = post(server, path, {**body, "stream": True, "stream_options": {"include_usage": True}}, stream=True)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    evs = events(r)
    assert evs[-1] == "[DONE]"
    chunks, usage_chunk = evs[:-2], evs[-2]
    key = (lambda c: c["choices"][0]["delta"].get("content", "")) if chat else (lambda c: c["choices"][0]["text"])
    text = "".join(key(c) for c in chunks)
    expected = whole["choices"][0]["message"]["content"] if chat else whole["choices"][0]["text"]
    assert text == expected
    assert len({c["id"] for c in chunks}) == 1
    last = chunks[-1]
    assert last["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert last["spec_decode"]["num_draft_tokens"] == whole["spec_decode"]["num_draft_tokens"]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == whole["usage"]
    if chat:
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"


def test_per_request_override_and_speculation_off(server):
    body = {"model": MODEL, "prompt": "def f(x):", "max_tokens": 24, "temperature": 0}
    off = post(server, "/v1/completions", {**body, "spec_decode": {"enabled": False}}).json()
    lossless = post(server, "/v1/completions", {**body, "spec_decode": {"policy": "lossless", "draft_len": 3}}).json()
    assert off["spec_decode"]["enabled"] is False and off["spec_decode"]["num_draft_tokens"] == 0
    assert lossless["spec_decode"]["policy"] == "lossless" and lossless["spec_decode"]["draft_len"] == 3
    assert lossless["choices"][0]["text"] == off["choices"][0]["text"]  # greedy lossless == target-only
    lenient = post(server, "/v1/completions", {**body, "spec_decode": {"params": {"threshold": 5.0}}}).json()
    assert lenient["spec_decode"]["params"] == {"threshold": 5.0}
    assert lenient["spec_decode"]["num_accepted_tokens"] >= 1


def test_top_k_one_samples_what_greedy_decodes(server):
    """top_k 1 at T 0.9 leaves one token to sample: the greedy output, whatever the seed (the CPU engine cuts the
    target's and the draft's distributions; the rule judges the target's)."""
    body = {"model": MODEL, "prompt": "def f(x):", "max_tokens": 16, "spec_decode": {"policy": "lossless"}}
    greedy = post(server, "/v1/completions", {**body, "temperature": 0}).json()["choices"][0]["text"]
    for seed in (1, 2):
        r = post(server, "/v1/completions", {**body, "temperature": 0.9, "seed": seed, "top_k": 1, "top_p": 0.9})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == greedy


BAD = [
    (b'{"prompt": ', 400, None, "not valid JSON"),
    ({"prompt": "x", "max_tokens": "5"}, 400, "max_tokens", "integer"),
    ({"prompt": "x", "max_tokens": 301}, 400, "max_tokens", "[1, 300]"),
    ({"prompt": "x", "temperature": 9}, 400, "temperature", "[0.0, 2.0]"),
    ({"prompt": "x", "best_of": 3}, 400, "best_of", "best_of"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p", "(0, 1]"),
    ({"prompt": "x", "tool": 1}, 400, "tool", "unknown field"),
    ({"prompt": "x", "spec_decode": {"policy": "kl_jduge"}}, 400, "spec_decode.policy", "unknown policy"),
    ({"prompt": "x", "spec_decode": {"policy": "dropmatch", "params": {"p_drop": 1.5}}}, 400, "spec_decode.params", "p_drop"),
    ({"prompt": "word " * 1500}, 400, "prompt", "exceed"),
    ({"prompt": [999999]}, 400, "prompt", "vocabulary"),
    ({"prompt": "x", "model": "gpt-4o"}, 404, "model", "does not exist"),
    ({"prompt": "x" * 30_000}, 413, None, "exceeds the limit"),
]


@pytest.mark.parametrize("body,status,param,words", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_requests_get_openai_style_errors(server, body, status, param, words):
    r = post(server, "/v1/completions", body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"] and "Traceback" not in r.text


def test_wrong_method_and_route_are_json_errors(server):
    r = requests.get(server + "/v1/completions", timeout=30)
    assert r.status_code == 405 and "error" in r.json()
    assert requests.get(server + "/v1/nothing", timeout=30).json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_failing_generation_is_500_and_the_replica_serves_on(server, stream):
    r = post(server, "/v1/completions", {"prompt": f"boom {FAIL}", "max_tokens": 20, "stream": stream}, stream=stream)
    if stream:
        evs = events(r)
        assert evs[-1] == "[DONE]" and evs[-2]["error"]["type"] == "server_error"
    else:
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        assert "injected failure" in r.json()["error"]["message"]
    ok = post(server, "/v1/completions", {"prompt": "fine", "max_tokens": 5, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_32_concurrent_requests_are_all_answered(server):
    def one(i: int) -> int:
        path = "/v1/chat/completions" if i % 2 else "/v1/completions"
        body = {"max_tokens": 16, "temperature": 0.7, "seed": i, "stream": i % 4 == 3}
        body.update({"messages": [{"role": "user", "content": f"hi {i}"}]} if i % 2 else {"prompt": f"n = {i}"})
        r = post(server, path, body, stream=body["stream"])
        if body["stream"]:
            return 200 if events(r)[-1] == "[DONE]" else 0
        return r.status_code

    with ThreadPoolExecutor(32) as pool:
        codes = list(pool.map(one, range(32)))
    assert codes == [200] * 32


def test_excess_requests_are_429_with_retry_after_not_queued(server):
    start = threading.Barrier(10)

    def one(i: int) -> requests.Response:
        start.wait()
        return post(server, "/tight/v1/completions", {"prompt": f"count {i}", "max_tokens": 300, "temperature": 0.8,
                                                     "seed": i}, key=KEY)

    with ThreadPoolExecutor(10) as pool:
        responses = list(pool.map(one, range(10)))
    codes = sorted(r.status_code for r in responses)
    assert set(codes) <= {200, 429} and codes.count(200) >= 1 and codes.count(429) >= 1, codes
    assert all(r.headers.get("retry-after") for r in responses if r.status_code == 429)


def test_aggregates_reach_rays_prometheus_endpoint(server):
    import ray

    port = ray._private.worker.global_worker.node.metrics_export_port
    post(server, "/v1/completions", {"prompt": "metrics", "max_tokens": 8})
    deadline, text = time.time() + 90, ""
    while time.time() < deadline:
        text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        if "spectune_num_accepted_tokens" in text and "spectune_request_latency_s_bucket" in text:
            break
        time.sleep(3)
    for name in ("spectune_requests", "spectune_generated_tokens", "spectune_num_draft_tokens",
                 "spectune_num_accepted_tokens", "spectune_request_latency_s_bucket",
                 "spectune_mean_acceptance_length_bucket"):
        assert name in text, f"{name} not exported"


def test_the_official_openai_client_works_unchanged(server):
    import openai  # a dev dependency (scripts/setup-env installs it)
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
    done = client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, temperature=0,
                                     extra_body={"spec_decode": {"policy": "top_k", "params": {"k": 4}}})
    assert done.choices[0].text is not None and done.usage.completion_tokens >= 1
    assert done.model_extra["spec_decode"]["policy"] == "top_k"
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=12, temperature=0, seed=3, stream=True)
        if c.choices]
    whole = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=12,
                                           temperature=0, seed=3)
    assert "".join(pieces) == whole.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=10_000)
    assert "max_tokens" in str(info.value)
    assert [m.id for m in client.models.list()] == [MODEL]


def test_a_server_with_a_key_refuses_requests_without_it_before_any_decode(server):
    """jobs.serve --api-key-env: the official client with the key is served; without it, or with a wrong one, a
    401 in OpenAI's shape (the client's AuthenticationError), before the body is even read (a body that would be a
    400 is a 401 first: it never reaches parsing, let alone the engine); /healthz stays open for probes."""
    import openai

    tight = server + "/tight"
    good = openai.OpenAI(base_url=tight + "/v1", api_key=KEY, max_retries=0)
    done = good.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0)
    assert done.usage.completion_tokens >= 1 and [m.id for m in good.models.list()] == [MODEL]

    wrong = openai.OpenAI(base_url=tight + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        wrong.completions.create(model=MODEL, prompt="Hello", max_tokens=200, temperature=0)
    assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
    assert "sk-wrong" not in str(info.value), "the key sent is never echoed"
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=200,
                                      stream=True)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    for path, body in (("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 10_000}),
                       ("/v1/chat/completions", b"{not json")):
        r = post(tight, path, body)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", r.text
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert "Authorization: Bearer" in r.json()["error"]["message"]
    assert requests.get(tight + "/v1/policy", timeout=30).status_code == 401
    assert requests.get(tight + "/v1/policy", headers={"authorization": f"Bearer {KEY}"}, timeout=30).json()[
        "policy"] == "lossless"
    assert requests.get(tight + "/healthz", timeout=30).json()["status"] == "ok"


def test_the_judge_scorer_asks_a_real_endpoint_and_caches_its_answer(server, tmp_path, monkeypatch):
    """A task file's ``judge`` scorer against this Serve app (the tiny pair: its replies carry no rating,
    so the score is 0 with the reply kept); the same prompt again is answered from the cache."""
    from workers.benchmarks.scorers import make_scorer

    monkeypatch.setenv("SPECTUNE_JUDGE_CACHE", str(tmp_path))
    monkeypatch.delenv("SPECTUNE_JUDGE_URL", raising=False)
    judge = make_scorer("judge", {"url": f"{server}/v1", "model": MODEL, "rubric": "Rate {output} vs {reference}: [[n]]",
                                  "max_tokens": 8, "retries": 1})
    first = judge("42", "42", {})
    assert first.score == 0.0 and first.reason == "no rating in the judge's reply"
    assert first.details["cached"] is False and isinstance(first.details["reply"], str)
    again = judge("42", "42", {})
    assert again.details["cached"] is True and again.details["reply"] == first.details["reply"]
    assert len(list(tmp_path.rglob("*.json"))) == 1
    wrong_model = make_scorer("judge", {"url": f"{server}/v1", "model": "nope", "rubric": "{output}", "retries": 0})
    with pytest.raises(ValueError, match="refused the request: HTTP 4"):
        wrong_model("x", "y", {})


def test_the_endpoint_engine_evaluates_a_rule_on_this_server_at_two_concurrencies(server, tmp_path, capsys):
    """``jobs.evaluate --engine openai`` against spectune's own endpoint: the rule goes in spec_decode, the
    reference sends speculation off, and per concurrency both sides' tokens/s, TPOT and accuracy come back; the
    server's rule reports show the knobs were applied."""
    from jobs import evaluate as evaluate_job

    rc = evaluate_job.main(["--engine", "openai", "--base-url", f"{server}/v1", "--model", MODEL, "--benchmark",
                            "gsm8k", "--limit", "4", "--max-new-tokens", "12", "--concurrency", "1,4", "--policy",
                            "kl_judge", "--param", "threshold=2", "--draft-len", "3", "--runs-root", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    for level in (1, 4):
        assert f"concurrency {level}:" in out
    errors = [json.loads(line)["reason"] for p in tmp_path.glob("eval-endpoint/*/*/c1/*/records.jsonl")
              for line in p.read_text().splitlines()]
    assert out.count("failed 0") == 4 and out.count("TPOT p50") == 4 and "candidate over reference" in out, errors[:2]
    records = [json.loads(line) for line in next(tmp_path.glob("eval-endpoint/*/*/c4/candidate/records.jsonl"))
               .read_text().splitlines()]
    assert len(records) == 4 and all(r["num_drafts"] > 0 and r["draft_len"] == 3 for r in records)
    reports = [json.loads(r["params"])["reported"] for r in records]
    assert all(rep["policy"] == "kl_judge" and rep["draft_len"] == 3 and rep["params"]["threshold"] == 2
               for rep in reports), reports[0]


def test_a_sweep_against_this_server_searches_its_knobs_and_certifies_for_the_endpoint(server, tmp_path):
    """``jobs/sweep.py --engine openai``: the pair actors are clients of this server; every trial and reference is a
    request carrying its rule in spec_decode (checked against the server's report), and the certification's scope
    names the endpoint and the pair id the ledger keys on."""
    from jobs import sweep as sweep_job

    run_dir = tmp_path / "sweep"
    rc = sweep_job.main(["--engine", "openai", "--base-url", f"{server}/v1", "--model", MODEL, "--pair-id",
                         "tiny-served", "--benchmark", "gsm8k", "--items", "4", "--confirm-items", "4",
                         "--max-new-tokens", "8", "--budgets", "0.5", "--policies", "kl_judge", "--draft-len", "2,3",
                         "--trials", "1", "--cost-ratio", "0.4", "--actors", "1", "--cpus-per-actor", "0.2",
                         "--speed-items", "3", "--concurrency", "2", "--runs-root", str(tmp_path),
                         "--run-dir", str(run_dir)])
    assert rc == 0
    chosen = json.loads((run_dir / "report" / "chosen-budget-0.5.json").read_text())
    timed = chosen["vs_lossless"]["timed"]  # the speed phase at the stated concurrency: tokens over each arm's walls
    assert timed["concurrency"] == 2 and timed["items"] == 3 and timed["tokens_per_s"]["candidate"] > 0, timed
    assert chosen["engine"] == "openai" and chosen["dtype"] == "server" and chosen["pair"] == "tiny-served"
    assert chosen["pair_fingerprint"] == "endpoint:tiny-served"
    assert chosen["endpoint"]["base_url"] == f"{server}/v1" and chosen["endpoint"]["model_card"]["id"] == MODEL
    assert isinstance(chosen["certified"], bool) and chosen["certification"]["steps"]
    records = [json.loads(line) for p in (run_dir / "trials").glob("*/records.jsonl") for line in p.read_text().splitlines()]
    assert records and all(r["error"] is None for r in records), [r["reason"] for r in records if r["error"]][:2]
    assert all(json.loads(r["params"])["reported"]["policy"] == "kl_judge" for r in records)


def test_a_fixed_configuration_of_this_server_is_certified_as_one_candidate(server, tmp_path):
    """``jobs/sweep.py --engine openai --server-config``: no search; the candidate is this server with a rule fixed in
    its request fields, the reference the same server with speculation off; the rule reports show the settings were
    applied, and the certificate names the configuration, the reference and the concurrency its speed came from."""
    from jobs import sweep as sweep_job

    run_dir = tmp_path / "fixed"
    rule = {"spec_decode": {"policy": "kl_judge", "params": {"threshold": 2.0}, "draft_len": 3}}
    rc = sweep_job.main(["--engine", "openai", "--base-url", f"{server}/v1", "--model", MODEL, "--pair-id",
                         "tiny-served", "--server-config", json.dumps({"note": "kl_judge fixed in the request"}),
                         "--extra-body", json.dumps(rule), "--reference-extra-body",
                         json.dumps({"spec_decode": {"policy": "off"}}), "--benchmark", "gsm8k", "--items", "2",
                         "--confirm-items", "4", "--max-new-tokens", "8", "--budgets", "0.9", "--concurrency", "2",
                         "--runs-root", str(tmp_path), "--run-dir", str(run_dir)])
    assert rc == 0
    chosen = json.loads((run_dir / "report" / "chosen-budget-0.9.json").read_text())
    assert chosen["screen"]["knob_check"] == "applied" and chosen["endpoint"]["extra_body"] == rule
    assert chosen["certification"]["n"] == 4 and chosen["speed"]["concurrency"] == 2
    assert chosen["speed"]["candidate"]["failed"] == 0 and chosen["speed"]["reference"]["failed"] == 0
    assert chosen["certified"] is True, chosen["certification"]["reason"]  # 4 items bound a 90% budget
