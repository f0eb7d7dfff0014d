"""The OpenAI request layer without a server: every field checked, overrides validated by the registry."""

from __future__ import annotations

import pytest

from cluster.openai_api import (
    ApiError,
    Limits,
    Response,
    SpecChoice,
    TextStream,
    in_certificate,
    parse_chat,
    parse_completion,
    parse_spec,
)
from policies import make_policy
from workers.models.tiny import tiny_tokenizer

MODEL = "spectune/tiny-random"
DEFAULT = SpecChoice("kl_judge", {"threshold": 0.5}, 5)
LIMITS = Limits(max_tokens=64, max_prompt_tokens=128)


def completion(**body):
    return parse_completion({"model": MODEL, "prompt": "hi", **body}, LIMITS, MODEL, DEFAULT)


def error_of(fn, *args, **kwargs) -> ApiError:
    with pytest.raises(ApiError) as info:
        fn(*args, **kwargs)
    return info.value


def test_defaults_follow_openai_and_the_served_policy():
    req = completion()
    assert (req.max_tokens, req.temperature, req.stream, req.stop) == (16, 1.0, False, ())
    assert req.spec == DEFAULT and not req.overridden
    chat = parse_chat({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}, LIMITS, MODEL, DEFAULT)
    assert chat.max_tokens == min(LIMITS.default_chat_max_tokens, LIMITS.max_tokens) and chat.messages == [{"role": "user", "content": "hi"}]


def test_prompt_forms():
    assert completion(prompt=["one"]).prompt == "one"
    assert completion(prompt=[1, 2, 3]).prompt == [1, 2, 3]
    assert completion(prompt=[[4, 5]]).prompt == [4, 5]
    for bad in ("", [], ["a", "b"], [1, "x"], None, 5, [True]):
        assert error_of(completion, prompt=bad).param == "prompt"


@pytest.mark.parametrize("field,value", [
    ("max_tokens", "5"), ("max_tokens", 0), ("max_tokens", 65), ("max_tokens", True), ("max_tokens", 2.5),
    ("temperature", -0.1), ("temperature", 2.5), ("temperature", "hot"), ("temperature", float("nan")),
    ("top_p", 0), ("top_p", 1.5), ("top_p", "all"), ("top_k", -2), ("top_k", 2.5), ("n", 2), ("n", True), ("echo", True), ("logprobs", 3), ("best_of", 2), ("suffix", "x"),
    ("presence_penalty", 0.5), ("logit_bias", {"1": 5}), ("stop", 5), ("stop", ["a"] * 5), ("stop", [""]),
    ("stop", "x" * 65), ("seed", "1"), ("stream", "yes"), ("stream_options", {"include_usage": True}),
    ("user", 5), ("frobnicate", 1), ("spec_decode", "lossless"),
])
def test_bad_fields_are_400_naming_the_field(field, value):
    err = error_of(completion, **{field: value})
    assert err.status == 400 and err.param == field and field in err.message
    assert err.body()["error"]["type"] == "invalid_request_error"


def test_wrong_model_is_404_and_unknown_chat_parts_are_refused():
    err = error_of(completion, model="gpt-4")
    assert err.status == 404 and err.code == "model_not_found"
    base = {"model": MODEL}
    for messages, param in (([], "messages"), ([{"role": "robot", "content": "x"}], "messages[0].role"),
                            ([{"role": "user", "content": 5}], "messages[0].content"),
                            ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
                             "messages[0].content"),
                            ([{"role": "user", "content": "x", "tool_calls": []}], "messages[0].tool_calls")):
        assert error_of(parse_chat, {**base, "messages": messages}, LIMITS, MODEL, DEFAULT).param == param
    ok = {**base, "messages": [{"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}
    assert parse_chat(ok, LIMITS, MODEL, DEFAULT).messages == [{"role": "system", "content": "ab"}]
    for name, value in (("tools", [{"type": "function"}]), ("response_format", {"type": "json_object"})):
        assert error_of(parse_chat, {**ok, name: value}, LIMITS, MODEL, DEFAULT).param == name
    assert parse_chat({**ok, "max_completion_tokens": 7}, LIMITS, MODEL, DEFAULT).max_tokens == 7
    assert error_of(parse_chat, {**ok, "max_completion_tokens": 99}, LIMITS, MODEL, DEFAULT).param == "max_completion_tokens"


def test_spec_decode_override_uses_the_registry():
    assert parse_spec({"policy": "lossless"}, DEFAULT, LIMITS) == SpecChoice("lossless", {}, 5)
    assert parse_spec({"params": {"threshold": 2.0}}, DEFAULT, LIMITS) == SpecChoice("kl_judge", {"threshold": 2.0}, 5)
    assert parse_spec({"policy": "top_k", "params": {"k": 3}, "draft_len": 2}, DEFAULT, LIMITS).draft_len == 2
    assert parse_spec({"enabled": False}, DEFAULT, LIMITS).policy is None
    assert parse_spec({"policy": "off"}, DEFAULT, LIMITS).policy is None
    cases = [({"policy": "kl_jduge"}, "spec_decode.policy", "unknown policy"),
             ({"policy": "kl_judge", "params": {"threshold": -1}}, "spec_decode.params", "threshold"),
             ({"policy": "top_k", "params": {"kk": 3}}, "spec_decode.params", "kk"),
             ({"draft_len": 0}, "spec_decode.draft_len", "[1, 16]"),
             ({"draft_len": 17}, "spec_decode.draft_len", "got 17"),
             ({"policy": "lossless", "temperature": 1}, "spec_decode.temperature", "unknown field"),
             ({"enabled": False, "draft_len": 3}, "spec_decode", "off"), ({"params": [1]}, "spec_decode.params", "object")]
    for value, param, words in cases:
        err = error_of(parse_spec, value, DEFAULT, LIMITS)
        assert err.status == 400 and err.param == param and words in err.message, (value, err.message)


def test_a_request_is_inside_the_certificate_only_with_the_served_certified_rule_at_its_temperature():
    certified = {"kind": "sweep", "certified": True, "covers": {"temperature": 0.0, "pair": "tiny-random"}}
    assert in_certificate(certified, DEFAULT, completion(temperature=0))
    assert in_certificate(certified, DEFAULT, completion(temperature=0, spec_decode={"params": {"threshold": 0.5}}))
    knobs = make_policy("kl_judge", threshold=0.5).describe()["params"]  # every knob, the others at their defaults
    assert in_certificate(certified, DEFAULT, completion(temperature=0, spec_decode={"params": knobs}))
    assert in_certificate(certified, DEFAULT, completion(temperature=0, spec_decode={"policy": "kl_judge",
                                                                                    "params": {"threshold": 0.5}}))
    outside = [(certified, completion(temperature=0.7)),  # another temperature
               (certified, completion(temperature=0, spec_decode={"params": {"threshold": 0.6}})),  # other knobs
               (certified, completion(temperature=0, spec_decode={"policy": "lossless"})),  # another rule
               (certified, completion(temperature=0, spec_decode={"draft_len": 4})),
               ({**certified, "certified": False, "outside_certificate": ["dtype bf16"]}, completion(temperature=0)),
               ({"kind": "flags"}, completion(temperature=0)),
               ({"kind": "sweep", "certified": True}, completion(temperature=0)),  # temperature unknown
               ({**certified, "covers": {"temperature": "zero"}}, completion(temperature=0))]  # unreadable: not inside
    for source, req in outside:
        assert not in_certificate(source, DEFAULT, req), (source, req)


def test_top_k_and_top_p_are_read_as_vllm_reads_them():
    req = completion(temperature=0.7, top_k=20, top_p=0.8)
    assert (req.top_k, req.top_p) == (20, 0.8)
    assert (completion().top_k, completion().top_p) == (0, 1.0)
    assert completion(top_k=-1).top_k == 0, "vLLM's -1: no top-k"


def test_a_certificate_made_with_top_k_and_top_p_covers_requests_that_sample_so():
    """At T > 0 a request runs inside only with the certificate's truncation (none recorded: the whole
    distribution); at T = 0 truncation changes nothing and is not asked about."""
    cut = {"kind": "sweep", "certified": True, "covers": {"temperature": 0.7, "top_k": 20, "top_p": 0.8}}
    whole = {"kind": "sweep", "certified": True, "covers": {"temperature": 0.7}}
    assert in_certificate(cut, DEFAULT, completion(temperature=0.7, top_k=20, top_p=0.8))
    assert in_certificate(whole, DEFAULT, completion(temperature=0.7))
    assert in_certificate(whole, DEFAULT, completion(temperature=0.7, top_k=0, top_p=1))
    for source, req in ((cut, completion(temperature=0.7)), (cut, completion(temperature=0.7, top_k=20)),
                        (cut, completion(temperature=0.7, top_k=20, top_p=0.9)),
                        (whole, completion(temperature=0.7, top_p=0.8))):
        assert not in_certificate(source, DEFAULT, req), (source, req)
    greedy = {"kind": "sweep", "certified": True, "covers": {"temperature": 0.0}}
    assert in_certificate(greedy, DEFAULT, completion(temperature=0, top_p=0.5))


def test_stream_options_and_seed():
    req = completion(stream=True, stream_options={"include_usage": True}, seed=3)
    assert req.stream and req.include_usage and req.seed == 3
    assert completion().seed is None  # unseeded: no seed reaches vLLM (the CPU engine draws one per request)
    assert completion(seed=-1).seed >= 0


def test_limits_reject_nonsense():
    with pytest.raises(ValueError, match="max_tokens"):
        Limits(max_tokens=0)
    with pytest.raises(ValueError, match="max_body_bytes"):
        Limits(max_body_bytes=True)
    small = Limits(max_tokens=8)
    assert parse_completion({"prompt": "x"}, small, MODEL, DEFAULT).max_tokens == 8  # defaults capped


def test_text_stream_deltas_concatenate_to_the_final_text_and_never_show_a_stop_string():
    tok = tiny_tokenizer()
    text = "Answer: 42.\n\nQ: next question"
    ids = tok.encode(text, add_special_tokens=False)
    stream = TextStream(tok, ("\n\nQ:",))
    out = "".join(stream.push([t]) for t in ids)
    assert "\n\nQ" not in out and text.startswith(out)
    final = text[: text.index("\n\nQ:")]
    assert out + stream.finish(final) == final
    plain = TextStream(tok, ())
    assert "".join(plain.push([t]) for t in ids) + plain.finish(text) == text


def test_response_shapes():
    r = Response("chat", MODEL)
    full = r.full("hi", "eos", {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}, {})
    assert full["object"] == "chat.completion" and full["choices"][0]["finish_reason"] == "stop"
    assert r.chunk("", first=True)["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert r.chunk(None, "length")["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    assert Response("completion", MODEL).id.startswith("cmpl-") and r.id.startswith("chatcmpl-")
