"""The OpenAI-compatible request/response layer of the Serve app: pure Python, no Ray, no models.

Parses and validates ``/v1/completions`` and ``/v1/chat/completions`` bodies into a
``GenRequest`` (every field checked for type and range; unknown fields and OpenAI features this
server does not implement are refused with an OpenAI-style 400 that names the field), validates
the per-request ``spec_decode`` override with the policy registry, builds response bodies and
server-sent-event chunks, and turns token ids into streamed text deltas whose concatenation is
exactly the non-streamed text.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from policies import POLICIES, make_policy

OFF = "off"  # spec_decode policy value that turns speculation off (target-only decoding)
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "abort": "abort"}


class ApiError(Exception):
    """An error answered to the client: HTTP status + OpenAI-style error body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


def check_api_key(expected: str | None, authorization: str | None) -> None:
    """A request's ``Authorization`` header against the server's key (None: no key asked for). Raises the 401
    OpenAI answers (its error shape; the key sent is never echoed). Compared in constant time."""
    import secrets

    if expected is None:
        return
    scheme, _, sent = (authorization or "").strip().partition(" ")
    if scheme.lower() != "bearer" or not sent.strip():
        raise ApiError(401, "You didn't provide an API key. This server needs one in an Authorization header using "
                            "Bearer auth (Authorization: Bearer YOUR_KEY; the OpenAI client's api_key)")
    if not secrets.compare_digest(sent.strip().encode(), expected.encode()):
        raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key")


@dataclass(frozen=True)
class Limits:
    """What one request may ask for. Excess is a 400/413, never a silently clipped request."""

    max_prompt_tokens: int = 4096
    max_tokens: int = 1024  # cap on max_tokens / max_completion_tokens
    default_max_tokens: int = 16  # /v1/completions default (OpenAI's)
    default_chat_max_tokens: int = 256  # /v1/chat/completions default (OpenAI: up to the context)
    # (either default is capped at max_tokens)
    max_body_bytes: int = 1 << 20
    max_stop: int = 4
    max_stop_chars: int = 64
    max_messages: int = 256
    max_draft_len: int = 16

    def __post_init__(self) -> None:
        for name, value in self.__dict__.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"limit {name} must be an integer >= 1, got {value!r}")


@dataclass(frozen=True)
class SpecChoice:
    """The acceptance rule a generation runs with; ``policy is None`` means speculation off."""

    policy: str | None
    params: dict[str, Any] = field(default_factory=dict)
    draft_len: int = 5

    def to_dict(self) -> dict[str, Any]:
        return {"enabled": self.policy is not None, "policy": self.policy, "params": dict(self.params),
                "draft_len": self.draft_len if self.policy is not None else 0}

    def build(self):
        return None if self.policy is None else make_policy(self.policy, **self.params)


@dataclass(frozen=True)
class GenRequest:
    kind: str  # "completion" | "chat"
    prompt: str | list[int] | None  # completion: text or token ids
    messages: list[dict[str, str]] | None  # chat
    max_tokens: int
    temperature: float
    seed: int | None  # None: the client gave none (vLLM then samples with its batched generator)
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    spec: SpecChoice
    overridden: bool  # the request carried spec_decode
    top_k: int = 0  # sampling truncation at T > 0 (policies.truncation): 0 / 1.0 are off
    top_p: float = 1.0


# -- field checks -----------------------------------------------------------------------------

def _int(body: dict, name: str, lo: int, hi: int | None = None, default: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(name, f"must be an integer, got {json.dumps(value)[:40]}")
    if value < lo or (hi is not None and value > hi):
        raise bad(name, f"must be in [{lo}, {hi}], got {value}" if hi is not None else f"must be >= {lo}, got {value}")
    return value


def _number(body: dict, name: str, lo: float, hi: float, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad(name, f"must be a number, got {json.dumps(value)[:40]}")
    if not lo <= value <= hi:
        raise bad(name, f"must be in [{lo}, {hi}], got {value}")
    return float(value)


def _bool(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(name, f"must be true or false, got {json.dumps(value)[:40]}")
    return value


def _only(body: dict, name: str, allowed: tuple, why: str) -> None:
    """OpenAI fields accepted only at their neutral value (this server does not implement them)."""
    if name not in body:
        return
    value = body[name]
    same = any(value is a if a is None or isinstance(a, bool) else (not isinstance(value, bool) and value == a)
               for a in allowed)
    if not same:
        raise bad(name, f"{why} (got {json.dumps(value)[:40]})")


COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "top_k", "n", "stream", "stream_options", "stop", "seed",
                 "user", "presence_penalty", "frequency_penalty", "logit_bias", "spec_decode"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "best_of", "logprobs", "suffix"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "response_format",
                               "tools", "tool_choice", "parallel_tool_calls"}
ROLES = ("system", "developer", "user", "assistant")


def _common(body: Any, allowed_fields: set[str], model_name: str) -> dict:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    unknown = sorted(set(body) - allowed_fields)
    if unknown:
        raise bad(unknown[0], f"unknown field; accepted fields are {sorted(allowed_fields)}")
    model = body.get("model")
    if model is not None and model != model_name:
        if not isinstance(model, str):
            raise bad("model", "must be a string")
        raise ApiError(404, f"model {model[:100]!r} does not exist; this server serves {model_name!r}",
                       param="model", code="model_not_found")
    _only(body, "n", (None, 1), "only one choice per request is supported")
    _only(body, "presence_penalty", (None, 0, 0.0), "penalties are not supported")
    _only(body, "frequency_penalty", (None, 0, 0.0), "penalties are not supported")
    if body.get("logit_bias") not in (None, {}):
        raise bad("logit_bias", "is not supported")
    if "user" in body and body["user"] is not None and not isinstance(body["user"], str):
        raise bad("user", "must be a string")
    return body


def _stop(body: dict, limits: Limits) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise bad("stop", "must be a string or a list of strings")
    if len(items) > limits.max_stop:
        raise bad("stop", f"at most {limits.max_stop} stop sequences, got {len(items)}")
    if any(not s or len(s) > limits.max_stop_chars for s in items):
        raise bad("stop", f"each stop sequence must have 1 to {limits.max_stop_chars} characters")
    return tuple(items)


def _stream(body: dict) -> tuple[bool, bool]:
    stream = _bool(body, "stream")
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not stream:
        raise bad("stream_options", "is only allowed with stream: true")
    if not isinstance(opts, dict) or set(opts) - {"include_usage"}:
        raise bad("stream_options", 'must be an object with only "include_usage"')
    return stream, _bool(opts, "include_usage") if "include_usage" in opts else False


def parse_spec(value: Any, default: SpecChoice, limits: Limits) -> SpecChoice:
    """The per-request override. ``{"enabled": false}`` or ``{"policy": "off"}``: target-only.
    ``{"policy": P, "params": {...}}``: rule P with those params (P's defaults for the rest).
    ``{"params": {...}}`` alone: the served rule with those knobs changed. ``draft_len``: 1..max."""
    if not isinstance(value, dict):
        raise bad("spec_decode", "must be an object like {\"policy\": ..., \"params\": {...}, \"draft_len\": ...}")
    unknown = sorted(set(value) - {"policy", "params", "draft_len", "enabled"})
    if unknown:
        raise bad(f"spec_decode.{unknown[0]}", "unknown field; accepted: policy, params, draft_len, enabled")
    enabled = _bool(value, "enabled", default=True) if "enabled" in value else True
    policy = value.get("policy")
    if not enabled or policy == OFF:
        if set(value) - {"enabled", "policy"}:
            raise bad("spec_decode", "speculation off takes no params or draft_len")
        return SpecChoice(None, {}, default.draft_len)
    if policy is not None and not isinstance(policy, str):
        raise bad("spec_decode.policy", "must be a string")
    if policy is not None and policy not in POLICIES:
        raise bad("spec_decode.policy", f"unknown policy {policy[:60]!r}; known: {sorted(POLICIES)} or {OFF!r}")
    params = value.get("params", {})
    if not isinstance(params, dict):
        raise bad("spec_decode.params", "must be an object of rule parameters")
    draft_len = _int({"spec_decode.draft_len": value.get("draft_len")}, "spec_decode.draft_len", 1,
                     limits.max_draft_len, default=default.draft_len)
    if policy is None:
        if default.policy is None:
            if params:
                raise bad("spec_decode.params", "speculation is off on this server: name a policy too")
            return replace(default, draft_len=draft_len)
        policy, params = default.policy, {**default.params, **params}
    choice = SpecChoice(policy, dict(params), draft_len)
    try:
        choice.build()
    except (ValueError, TypeError) as err:
        raise bad("spec_decode.params", str(err)) from None
    return choice


def parse_completion(body: Any, limits: Limits, model_name: str, default: SpecChoice) -> GenRequest:
    body = _common(body, COMPLETION_FIELDS, model_name)
    _only(body, "echo", (None, False), "echo is not supported")
    _only(body, "best_of", (None, 1), "only best_of 1 is supported")
    _only(body, "logprobs", (None, False, 0), "logprobs are not supported")
    if body.get("suffix") not in (None, ""):
        raise bad("suffix", "is not supported")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise bad("prompt", "must not be empty")
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompt = list(prompt)
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise bad("prompt", "one prompt per request (send a batch as separate requests)")
    else:
        raise bad("prompt", "is required: a non-empty string or a list of token ids")
    return _finish(body, limits, default, "completion", prompt, None, min(limits.default_max_tokens, limits.max_tokens))


def parse_chat(body: Any, limits: Limits, model_name: str, default: SpecChoice) -> GenRequest:
    body = _common(body, CHAT_FIELDS, model_name)
    _only(body, "logprobs", (None, False), "logprobs are not supported")
    _only(body, "top_logprobs", (None, 0), "logprobs are not supported")
    for name in ("tools", "tool_choice", "parallel_tool_calls"):
        if body.get(name) not in (None, [], "none"):
            raise bad(name, "tool calling is not supported")
    fmt = body.get("response_format")
    if fmt not in (None, {"type": "text"}):
        raise bad("response_format", 'only {"type": "text"} is supported')
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "is required: a non-empty list of {role, content}")
    if len(messages) > limits.max_messages:
        raise bad("messages", f"at most {limits.max_messages} messages, got {len(messages)}")
    clean = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(where, "must be an object with role and content")
        extra = sorted(set(m) - {"role", "content", "name"})
        if extra:
            raise bad(f"{where}.{extra[0]}", "unknown field; accepted: role, content, name")
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"{where}.role", f"must be one of {list(ROLES)}, got {json.dumps(role)[:40]}")
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       and set(p) <= {"type", "text"} for p in content):
                raise bad(f"{where}.content", 'only text parts ({"type": "text", "text": ...}) are supported')
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise bad(f"{where}.content", "must be a string or a list of text parts")
        clean.append({"role": "system" if role == "developer" else role, "content": content})
    if "max_tokens" in body and "max_completion_tokens" in body:
        raise bad("max_completion_tokens", "give max_tokens or max_completion_tokens, not both")
    if body.get("max_completion_tokens") is not None:
        body = {**body, "max_tokens": body["max_completion_tokens"]}
    return _finish(body, limits, default, "chat", None, clean, min(limits.default_chat_max_tokens, limits.max_tokens))


def _finish(body: dict, limits: Limits, default: SpecChoice, kind: str, prompt: Any, messages: Any,
            default_max: int) -> GenRequest:
    name = "max_completion_tokens" if kind == "chat" and "max_completion_tokens" in body else "max_tokens"
    max_tokens = _int({name: body.get("max_tokens")}, name, 1, limits.max_tokens, default=default_max)
    seed = _int(body, "seed", -(2 ** 63), 2 ** 63 - 1)
    stream, include_usage = _stream(body)
    overridden = body.get("spec_decode") is not None
    spec = parse_spec(body["spec_decode"], default, limits) if overridden else default
    top_p = _number(body, "top_p", 0.0, 1.0, 1.0)
    if top_p == 0.0:
        raise bad("top_p", "must be in (0, 1] (1: the whole distribution), got 0")
    top_k = _int(body, "top_k", -1, default=0)  # -1 and 0: off, as vLLM reads them
    return GenRequest(
        kind=kind, prompt=prompt, messages=messages, max_tokens=int(max_tokens),
        temperature=_number(body, "temperature", 0.0, 2.0, 1.0),
        seed=None if seed is None else seed % (2 ** 63), stop=_stop(body, limits), stream=stream,
        include_usage=include_usage, spec=spec, overridden=overridden, top_k=max(int(top_k or 0), 0), top_p=top_p,
    )


# -- responses ----------------------------------------------------------------------------------

def _ran(spec: SpecChoice) -> Any:
    """A rule as it runs: its whole validated config (knobs left out take their defaults) and draft length."""
    rule = spec.build()
    return None if rule is None else (rule.describe(), spec.draft_len)


def in_certificate(source: dict[str, Any], default: SpecChoice, req: GenRequest) -> bool:
    """Whether a request ran inside the served rule's certificate (``workers.results.scope.ran_inside``): the
    request ran the served rule (its whole config and draft length) at the certificate's temperature, top-k and
    top-p."""
    from workers.results.scope import ran_inside

    # an uncertified source never builds the rules to compare them
    return source.get("certified") is True and ran_inside(source, _ran(req.spec) == _ran(default), req.temperature,
                                                          req.top_k, req.top_p)


def spec_metrics(stats: Any, spec: SpecChoice, inside: bool | None = None) -> dict[str, Any]:
    """Per-request speculative metrics with vLLM's names (plus the rule that ran, and whether it ran inside
    the served rule's certificate)."""
    on = spec.policy is not None
    return {
        **spec.to_dict(),
        **({} if inside is None else {"in_certificate": inside}),
        "mean_acceptance_length": stats.mean_acceptance_length,
        "draft_acceptance_rate": stats.draft_acceptance_rate if on else 0.0,
        "num_drafts": stats.num_drafts if on else 0,
        "num_draft_tokens": stats.num_draft_tokens,
        "num_accepted_tokens": stats.num_accepted_tokens,
        "accepted_per_position": list(stats.accepted_per_position),
        "cached_prompt_tokens": stats.cached_prompt_tokens,
        "decode_tokens_per_s": stats.tokens_per_s,
    }


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class Response:
    """Ids and bodies for one request (the same id across its stream chunks)."""

    def __init__(self, kind: str, model: str) -> None:
        self.kind, self.model = kind, model
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.object = "chat.completion" if kind == "chat" else "text_completion"

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, text: str, finish: str, use: dict, spec: dict) -> dict[str, Any]:
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": FINISH[finish]}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": FINISH[finish]}
        return {**self._head(self.object), "choices": [choice], "usage": use, "spec_decode": spec}

    def chunk(self, delta: str | None, finish: str | None = None, first: bool = False,
              spec: dict | None = None) -> dict[str, Any]:
        reason = None if finish is None else FINISH[finish]
        if self.kind == "chat":
            d: dict[str, Any] = {"role": "assistant", "content": delta or ""} if first else (
                {"content": delta} if delta else {})
            choice = {"index": 0, "delta": d, "logprobs": None, "finish_reason": reason}
            body = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            body = {**self._head("text_completion"),
                    "choices": [{"index": 0, "text": delta or "", "logprobs": None, "finish_reason": reason}]}
        if spec is not None:
            body["spec_decode"] = spec
        return body

    def usage_chunk(self, use: dict) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": [], "usage": use}


def sse(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


class TextStream:
    """Token ids in, text deltas out. Holds back an unfinished UTF-8 character and the last
    characters that could still begin a stop string, so the deltas never show text the final
    (stop-cut) text does not have; ``finish`` sends the rest of the final text."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...]) -> None:
        self.tok, self.ids, self.sent, self.stop = tokenizer, [], "", stop
        self.hold = max((len(s) for s in stop), default=1) - 1

    def push(self, ids: list[int]) -> str:
        self.ids += ids
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        end = len(text.rstrip("\ufffd"))
        if self.hold:
            end = min(end, len(text) - self.hold)  # could be the start of a stop string
        for s in self.stop:
            at = text.find(s)
            if at >= 0:
                end = min(end, at)  # the final text is cut before it
        safe = text[:max(end, 0)]
        if len(safe) <= len(self.sent) or not safe.startswith(self.sent):
            return ""
        delta, self.sent = safe[len(self.sent):], safe
        return delta

    def finish(self, final_text: str) -> str:
        if not final_text.startswith(self.sent):  # cannot happen for prefix-stable decoding; never resend
            return ""
        delta, self.sent = final_text[len(self.sent):], final_text
        return delta
