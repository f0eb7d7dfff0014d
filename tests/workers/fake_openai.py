"""A small OpenAI-compatible server on 127.0.0.1 for the endpoint engine's fault tests: it streams chat and
completions replies and misbehaves on request (500s, 429s, dropped streams, a slow first token, a key it wants,
knobs it ignores), and counts what it was sent."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Behaviour:
    fail_500: int = 0  # the next N generation requests answer 500
    fail_429: int = 0  # the next N answer 429 with Retry-After
    retry_after: str = "0"
    drop_stream: int = 0  # the next N streams break after the first chunk
    always_500: bool = False
    bad_request: bool = False  # every generation request answers 400
    first_token_delay: float = 0.0
    token_delay: float = 0.0
    api_key: str | None = None
    report_rule: bool = True  # False: ignores spec_decode (no rule report in the reply)
    metrics: bool = False  # expose spec-decode figures on /metrics, as metrics_kind names:
    metrics_kind: str = "vllm"  # vLLM's Prometheus counters; "trt": TensorRT-LLM's JSON iteration stats, drained
    # by each read; "sglang": SGLang's gauge of the last window's acceptance rate (here: the last request's)
    pending: list = field(default_factory=list)  # trt: iteration rows not yet read
    gauge: float = 0.0
    count_delay: float = 0.0  # seconds between a stream's last chunk and its drafts being counted (as vLLM's front
    # end records a step's stats after it hands the outputs on)
    accepted_per_request: int = 3  # counters: accepted tokens a request adds (the same for every request: the
    # knobs "did not move" acceptance unless the candidate's extra body names a rule and report_rule is True)
    words: tuple[str, ...] = ("The", " answer", " is", " 42", ".")
    rule_words: tuple[str, ...] | None = None  # a request carrying a rule (vllm_xargs) answers these: a rule that acts
    answer_of: Any = None  # a function of the request's prompt text giving the words to answer (a model that is right
    # or wrong item by item), in place of ``words``
    finish: str = "stop"  # the finish reason of every reply ("length": cut at the limit)
    reasoning: tuple[str, ...] = ()  # delta.reasoning pieces before the content (a reasoning model)
    raw_utf8: bool = False  # JSON with non-ASCII characters unescaped (as vLLM and SGLang send it)
    abort_next: int = 0  # the next N streams finish with "abort"
    stream_error: int | None = None  # the next stream carries an error event with this code instead of tokens
    ports: set = field(default_factory=set)  # client ports seen: one per connection
    requests: int = 0
    warmups: int = 0  # one-token warm-up requests (not in requests, bodies, faults or counters)
    bodies: list[dict[str, Any]] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    drafted: float = 0.0
    accepted: float = 0.0


class FakeServer:
    def __init__(self, model: str = "fake/model") -> None:
        self.model = model
        self.b = Behaviour()
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            def _authorized(self) -> bool:
                want = server.b.api_key
                if want and self.headers.get("Authorization") != f"Bearer {want}":
                    self._send(401, {"error": {"message": "bad key"}})
                    return False
                return True

            def do_GET(self) -> None:  # noqa: N802
                if not self._authorized():
                    return
                if self.path == "/v1/models":
                    self._send(200, {"object": "list", "data": [{"id": server.model, "object": "model"}]})
                elif self.path == "/metrics" and server.b.metrics:
                    with server.lock:
                        if server.b.metrics_kind == "trt":
                            text, server.b.pending = json.dumps(server.b.pending), []
                        elif server.b.metrics_kind == "sglang":
                            text = f"sglang:spec_accept_rate{{model_name=\"m\"}} {server.b.gauge}\n"
                        else:
                            text = (f"vllm:spec_decode_num_draft_tokens_total{{model=\"m\"}} {server.b.drafted}\n"
                                    f"vllm:spec_decode_num_accepted_tokens_total{{model=\"m\"}} {server.b.accepted}\n")
                    data = text.encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "text/plain")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                else:
                    self._send(404, {"error": {"message": "no such route"}})

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                if not self._authorized():
                    return
                b = server.b
                if body.get("max_tokens") == 1:  # a warm-up (workers.endpoint_eval.warm): answered, counted apart
                    with server.lock:
                        b.warmups += 1
                    return self._stream(body, drop=False, warmup=True)
                with server.lock:
                    b.ports.add(self.client_address[1])
                    b.requests += 1
                    b.bodies.append(body)
                    fail = "500" if b.always_500 or b.fail_500 > 0 else "429" if b.fail_429 > 0 else \
                        "400" if b.bad_request else "drop" if b.drop_stream > 0 else None
                    if fail == "500" and not b.always_500:
                        b.fail_500 -= 1
                    elif fail == "429":
                        b.fail_429 -= 1
                    elif fail == "drop":
                        b.drop_stream -= 1
                    b.in_flight += 1
                    b.max_in_flight = max(b.max_in_flight, b.in_flight)
                try:
                    if fail == "500":
                        return self._send(500, {"error": {"message": "boom"}})
                    if fail == "429":
                        return self._send(429, {"error": {"message": "slow down"}}, {"Retry-After": b.retry_after})
                    if fail == "400":
                        return self._send(400, {"error": {"message": "max_tokens: too large"}})
                    self._stream(body, drop=fail == "drop")
                finally:
                    with server.lock:
                        b.in_flight -= 1

            def _stream(self, body: dict[str, Any], drop: bool, warmup: bool = False) -> None:
                b = server.b
                chat = "messages" in body
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()

                def event(obj: Any) -> None:
                    text = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=not b.raw_utf8)
                    data = f"data: {text}\n\n".encode()
                    self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                    self.wfile.flush()

                acts = b.rule_words is not None and "vllm_xargs" in body
                given = b.words
                if b.answer_of is not None and not warmup:
                    prompt = body.get("prompt") if not chat else "\n".join(str(m.get("content")) for m in body["messages"])
                    given = tuple(b.answer_of(prompt if isinstance(prompt, str) else json.dumps(prompt)))
                words = list(b.rule_words if acts else given)[: int(body.get("max_tokens") or 16)]
                if not warmup:
                    time.sleep(b.first_token_delay)
                with server.lock:
                    error, b.stream_error = (b.stream_error, None) if not warmup else (None, b.stream_error)
                    abort = b.abort_next > 0 and not warmup
                    b.abort_next -= int(abort)
                if error is not None:
                    event({"error": {"message": "bad things", "code": error}})
                    event("[DONE]")
                    self.wfile.write(b"0\r\n\r\n")
                    self.wfile.flush()
                    return
                for piece in b.reasoning:
                    event({"choices": [{"index": 0, "delta": {"reasoning": piece}}]})
                    time.sleep(b.token_delay)
                for i, w in enumerate(words):
                    if i:
                        time.sleep(b.token_delay)
                    choice = {"index": 0, "delta": {"content": w}} if chat else {"index": 0, "text": w}
                    event({"choices": [choice]})
                    if drop:
                        self.wfile.write(b"garbage-not-a-chunk")
                        self.wfile.flush()
                        self.close_connection = True
                        return
                spec = body.get("spec_decode") if b.report_rule else None
                final: dict[str, Any] = {"choices": [{"index": 0, "finish_reason": "abort" if abort else b.finish,
                                                      **({"delta": {}} if chat else {"text": ""})}]}
                if spec:  # as spectune's endpoint reports the rule it ran (SpecChoice.to_dict)
                    on = spec.get("policy") not in (None, "off")
                    final["spec_decode"] = {"enabled": on, "policy": spec.get("policy") if on else None,
                                            "params": spec.get("params") or {} if on else {},
                                            "draft_len": spec.get("draft_len") if on else 0,
                                            "num_drafts": 2 if on else 0, "num_draft_tokens": 8 if on else 0,
                                            "num_accepted_tokens": 3 if on else 0,
                                            "accepted_per_position": [2, 1] if on else []}
                event(final)
                n = len(words) + len(b.reasoning)
                event({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n}})
                event("[DONE]")
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
                if warmup:
                    return
                time.sleep(b.count_delay)
                with server.lock:  # 80 drafted tokens a request; a named rule accepts 20 more of them
                    b.drafted += 80
                    named = (isinstance(body.get("spec_decode"), dict) and body["spec_decode"].get("policy") != "off"
                             or "vllm_xargs" in body)
                    this = 10 * b.accepted_per_request + (20 if named and b.report_rule else 0)
                    b.accepted += this
                    b.pending.append({"iter": b.requests, "attentionDpRank": 0,
                                      "specDecodingStats": {"numDraftTokens": 80, "numAcceptedTokens": this}})
                    b.gauge = this / 80 + (b.requests % 7) * 0.003  # windows differ a little, as a real gauge's do

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def __enter__(self) -> FakeServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
