"""An OpenAI-compatible server as an engine: spectune's own Serve endpoint, a stock ``vllm serve`` (with or without
spectune's plugin), SGLang, TensorRT-LLM, anything that answers ``/v1/chat/completions`` and ``/v1/completions``.

- :class:`Endpoint`: where a side of a comparison runs (base url, model, the key's environment variable) and what
  its requests carry beyond the prompt (``extra_body``: a rule's knobs, in whichever field that server reads).
- :func:`check`: ``GET /v1/models`` before anything runs: an unreachable url, a refused key or a model the server
  does not serve is one :class:`EndpointError` line, never a traceback.
- :func:`complete`: one streamed request, timed (time to first token, time per output token after it), retried
  with exponential backoff on a dropped connection, a timeout or a 5xx, rate-limited on a 429 (its
  ``Retry-After``); a 4xx is the request's own fault and is not retried. What still fails raises
  :class:`RequestFailed` (the caller counts the item against its side).
- :func:`run_concurrently`: requests at a stated concurrency, results in submission order.
- :func:`spec_counters`: the speculative-decoding counters of a server's Prometheus ``/metrics`` (vLLM's).

Knows HTTP and the OpenAI wire format; nothing about benchmarks, rules or certificates.
"""

from __future__ import annotations

import json
import os
import random
import re
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

RETRY_STATUS = frozenset({408, 425, 500, 502, 503, 504})
MAX_RETRY_AFTER_S = 60.0
RATE_LIMIT_WAITS = 30  # 429s a request may wait out, apart from its retries (a rate limit is not a failure)
# fields of a request body that the client owns: an extra body may not change how it is streamed or counted
RESERVED = frozenset({"model", "messages", "prompt", "stream", "stream_options", "max_tokens", "n"})


class EndpointError(ValueError):
    """A side cannot run at all (unreachable, refused, wrong model, bad settings): one line for the user."""


class RequestFailed(RuntimeError):
    """One request that still failed after its retries (or at once, on a 4xx that is its own fault)."""

    def __init__(self, message: str, status: int | None = None, attempts: int = 1) -> None:
        super().__init__(message)
        self.status, self.attempts = status, attempts


@dataclass(frozen=True)
class Endpoint:
    """One side of a comparison: an OpenAI-compatible server and the extra JSON its requests carry."""

    base_url: str  # ".../v1"
    model: str
    api_key_env: str | None = None  # the environment variable holding the key (never the key itself)
    extra_body: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 600.0  # the longest wait for the server's next bytes (connect excepted), not a whole-request cap
    connect_timeout_s: float = 10.0
    retries: int = 4  # after the first attempt
    backoff_s: float = 0.5  # first wait; doubles, with jitter

    def __post_init__(self) -> None:
        if not re.match(r"^https?://[^/\s]+", self.base_url or ""):
            raise EndpointError(f"--base-url must be an http(s) url like http://127.0.0.1:8000/v1, got {self.base_url!r}")
        if not self.model:
            raise EndpointError("--model is required with --engine openai (the name /v1/models lists)")
        if self.retries < 0 or self.timeout_s <= 0 or self.backoff_s < 0:
            raise EndpointError("retries must be >= 0 and timeouts > 0")
        if not isinstance(self.extra_body, dict):
            raise EndpointError(f"extra body must be a JSON object, got {type(self.extra_body).__name__}")
        owned = sorted(RESERVED & set(self.extra_body))
        if owned:
            raise EndpointError(f"an extra body may not set {', '.join(owned)}: spectune sets them (streamed, with usage)")

    @property
    def root(self) -> str:
        """The server's root (``/metrics`` lives there): the base url without its trailing ``/v1``."""
        return re.sub(r"/v1/?$", "", self.base_url.rstrip("/"))

    def url(self, path: str) -> str:
        return self.base_url.rstrip("/") + "/" + path.lstrip("/")

    def headers(self) -> dict[str, str]:
        out = {"Content-Type": "application/json"}
        if self.api_key_env:
            key = os.environ.get(self.api_key_env)
            if not key:
                raise EndpointError(f"--api-key-env {self.api_key_env}: that environment variable is not set")
            out["Authorization"] = f"Bearer {key}"
        return out

    def describe(self) -> dict[str, Any]:
        """What a record or a certificate's scope says of this side (no key)."""
        return {"base_url": self.base_url, "model": self.model, "extra_body": self.extra_body}


@dataclass
class Reply:
    """One finished request: its text and finish reason, its token counts (the server's ``usage``), the
    seconds to its first output token and in all, its attempts, and the rule report the server sent
    (spectune's ``spec_decode``), if any."""

    text: str
    finish: str
    completion_tokens: int
    prompt_tokens: int
    ttft_s: float
    seconds: float
    attempts: int = 1
    report: dict[str, Any] | None = None

    @property
    def tpot_s(self) -> float:
        """Time per output token after the first (what a streaming user waits between tokens)."""
        n = self.completion_tokens - 1
        return (self.seconds - self.ttft_s) / n if n > 0 else float("nan")


def _session():
    import requests

    return requests.Session()


_local = threading.local()


def _http():
    if not hasattr(_local, "session"):
        _local.session = _session()
    return _local.session


def _one_line(err: BaseException) -> str:
    text = str(err).splitlines()[0] if str(err) else type(err).__name__
    # requests' connection errors nest the reason deep: keep the part a user acts on
    found = re.search(r"(Connection refused|Name or service not known|timed out|No route to host|"
                      r"Temporary failure in name resolution|Connection reset by peer|RemoteDisconnected)", str(err))
    return found.group(1) if found else text[:200]


def check(endpoint: Endpoint) -> dict[str, Any]:
    """``GET /v1/models``: the server is there, takes the key, and serves ``endpoint.model``. Returns that model's
    card (recorded with the pair identity the user states). :class:`EndpointError`, one line, otherwise."""
    import requests

    url = endpoint.url("models")
    try:
        resp = _http().get(url, headers=endpoint.headers(), timeout=(endpoint.connect_timeout_s, 30.0))
    except requests.RequestException as err:
        raise EndpointError(f"cannot reach {endpoint.base_url}: {_one_line(err)}") from None
    if resp.status_code in (401, 403):
        hint = f" (the key in ${endpoint.api_key_env})" if endpoint.api_key_env else " (set --api-key-env)"
        raise EndpointError(f"{endpoint.base_url} refused the request: HTTP {resp.status_code}{hint}")
    if resp.status_code != 200:
        hint = " (is /v1 missing from the base url?)" if resp.status_code == 404 and "/v1" not in endpoint.base_url else ""
        raise EndpointError(f"{url} answered HTTP {resp.status_code}{hint}: {resp.text[:160]!r}")
    try:
        cards = resp.json().get("data") or []
        served = [str(c.get("id")) for c in cards]
    except (ValueError, AttributeError):
        raise EndpointError(f"{url} did not answer an OpenAI model list: {resp.text[:160]!r}") from None
    if endpoint.model not in served:
        raise EndpointError(f"model {endpoint.model!r} is not served at {endpoint.base_url}; it serves: "
                            f"{', '.join(served[:8]) or 'nothing'}")
    return next(c for c in cards if str(c.get("id")) == endpoint.model)


def body_for(endpoint: Endpoint, messages: list[dict[str, str]] | None, prompt: str | None, max_tokens: int,
             temperature: float, seed: int | None, stop: Sequence[str] | None) -> dict[str, Any]:
    """A chat (``messages``) or completions (``prompt``) request body, streamed with usage, plus the side's
    extra body (its rule's knobs)."""
    body: dict[str, Any] = {"model": endpoint.model, "max_tokens": max_tokens, "temperature": temperature,
                            "stream": True, "stream_options": {"include_usage": True}}
    if messages is not None:
        body["messages"] = messages
    else:
        body["prompt"] = prompt
    if seed is not None and temperature > 0:
        body["seed"] = seed
    if stop:
        body["stop"] = list(stop)
    return {**body, **endpoint.extra_body}


def complete(endpoint: Endpoint, messages: list[dict[str, str]] | None = None, prompt: str | None = None, *,
             max_tokens: int, temperature: float = 0.0, seed: int | None = None,
             stop: Sequence[str] | None = None, sleep: Callable[[float], None] = time.sleep) -> Reply:
    """One request, streamed and timed, retried as the module says. :class:`RequestFailed` when it still fails."""
    body = body_for(endpoint, messages, prompt, max_tokens, temperature, seed, stop)
    route = "chat/completions" if messages is not None else "completions"
    last = ""
    status: int | None = None
    wait = endpoint.backoff_s
    failures = limited = attempt = 0
    while True:
        attempt += 1
        try:
            reply = _stream(endpoint, route, body)
            reply.attempts = attempt
            return reply
        except _Retry as err:
            last, status = err.message, err.status
            if err.status == 429 and limited < RATE_LIMIT_WAITS:  # waited out on its own budget
                limited += 1
                pause = err.retry_after if err.retry_after is not None else wait * (1.0 + random.random())
            else:
                failures += 1
                if failures > endpoint.retries:
                    break
                pause = err.retry_after if err.retry_after is not None else wait * (1.0 + random.random())
                wait *= 2
        except RequestFailed as err:
            err.attempts = attempt
            raise
        sleep(min(pause, MAX_RETRY_AFTER_S))
    raise RequestFailed(f"{last} (after {attempt} attempts)", status, attempt)


class _Retry(Exception):
    def __init__(self, message: str, status: int | None = None, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.retry_after = message, status, retry_after


def _retry_after(value: str | None) -> float | None:
    """``Retry-After`` in seconds: delta-seconds or an HTTP date."""
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    from email.utils import parsedate_to_datetime

    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    import datetime as dt

    return max(0.0, (when - dt.datetime.now(dt.UTC)).total_seconds()) if when.tzinfo else None


def _stream(endpoint: Endpoint, route: str, body: dict[str, Any]) -> Reply:
    import requests

    t0 = time.perf_counter()
    try:
        resp = _http().post(endpoint.url(route), data=json.dumps(body), headers=endpoint.headers(), stream=True,
                            timeout=(endpoint.connect_timeout_s, endpoint.timeout_s))
    except requests.RequestException as err:
        raise _Retry(f"{route}: {_one_line(err)}") from None
    with resp:
        if resp.status_code == 429:
            raise _Retry(f"{route}: HTTP 429 (rate limited)", 429, _retry_after(resp.headers.get("Retry-After")))
        if resp.status_code in RETRY_STATUS:
            raise _Retry(f"{route}: HTTP {resp.status_code}: {resp.text[:160]!r}", resp.status_code)
        if resp.status_code != 200:
            raise RequestFailed(f"{route}: HTTP {resp.status_code}: {_error_message(resp)}", resp.status_code)
        text: list[str] = []
        finish, usage, report, ttft, done = "", {}, None, None, False
        try:
            # bytes split on newlines only, each line UTF-8: servers emit U+2028/U+0085 raw in JSON, and an
            # event stream without a charset would otherwise be read as Latin-1
            for raw in resp.iter_lines():
                line = raw.decode("utf-8") if isinstance(raw, bytes) else raw
                if done or not line.startswith("data:"):
                    continue  # after [DONE]: read to the end, so the connection is kept for the next request
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    _stream_error(route, chunk["error"])
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    piece = delta.get("content") if "delta" in choice else choice.get("text")
                    thought = delta.get("reasoning") or delta.get("reasoning_content")
                    if (piece or thought) and ttft is None:  # a reasoning model's first token is its thinking
                        ttft = time.perf_counter() - t0
                    if piece:
                        text.append(piece)
                    if choice.get("finish_reason"):
                        finish = choice["finish_reason"]
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if chunk.get("spec_decode"):
                    report = chunk["spec_decode"]
        except (requests.RequestException, ValueError) as err:  # a dropped or garbled stream: the whole request again
            raise _Retry(f"{route}: the stream broke: {_one_line(err)}") from None
    seconds = time.perf_counter() - t0
    if not finish:
        raise _Retry(f"{route}: the stream ended without a finish reason")
    if finish in ("abort", "error"):
        raise _Retry(f"{route}: the server finished the request with {finish!r}")
    if not usage:
        raise RequestFailed(f"{route}: the server sent no usage (stream_options.include_usage): tokens cannot be counted")
    return Reply("".join(text), finish, int(usage.get("completion_tokens") or 0), int(usage.get("prompt_tokens") or 0),
                 ttft if ttft is not None else seconds, seconds, report=report)


def _stream_error(route: str, error: Any) -> None:
    """An error event inside a 200 stream: retried unless its code says the request itself is at fault (4xx)."""
    code = error.get("code") if isinstance(error, dict) else None
    message = str(error.get("message") if isinstance(error, dict) else error)[:160]
    try:
        status = int(code)
    except (TypeError, ValueError):
        status = None
    if status is not None and 400 <= status < 500 and status not in (408, 429):
        raise RequestFailed(f"{route}: the stream carried error {status}: {message}", status)
    raise _Retry(f"{route}: the stream carried an error: {message}", status)


def _error_message(resp: Any) -> str:
    try:
        err = resp.json().get("error")
        return str(err.get("message") if isinstance(err, dict) else err)[:200]
    except (ValueError, AttributeError):
        return repr(resp.text[:200])


T = TypeVar("T")
R = TypeVar("R")


def run_concurrently(fn: Callable[[T], R], jobs: Iterable[T], concurrency: int,
                     on_done: Callable[[int, R], None] | None = None) -> list[R]:
    """``fn`` over ``jobs`` with at most ``concurrency`` in flight; results in submission order. ``fn`` must not
    raise for one job's failure (it returns it): one bad request never stops the batch."""
    if concurrency < 1:
        raise EndpointError(f"--concurrency must be >= 1, got {concurrency}")
    from concurrent.futures import as_completed

    jobs = list(jobs)
    out: list[Any] = [None] * len(jobs)
    pool = ThreadPoolExecutor(max_workers=concurrency)
    try:
        futures = {pool.submit(fn, job): i for i, job in enumerate(jobs)}
        for fut in as_completed(futures):
            i = futures[fut]
            out[i] = fut.result()
            if on_done is not None:
                on_done(i, out[i])
    except BaseException:  # Ctrl-C: queued requests are not sent; those in flight finish and are dropped
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
    return out


SPEC_COUNTERS = {"draft_tokens": "vllm:spec_decode_num_draft_tokens", "accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
                 "drafts": "vllm:spec_decode_num_drafts"}
# SGLang exposes no counters, only gauges of its last logged decode window (every ``decode_log_interval`` steps)
SPEC_GAUGE = "sglang:spec_accept_rate"


def spec_counters(endpoint: Endpoint) -> dict[str, float] | None:
    """The server's speculative-decoding figures from ``/metrics``, or None where it exposes none (or no
    ``/metrics``):

    - vLLM's Prometheus counters (summed over label sets): ``draft_tokens``, ``accepted_tokens``, ``drafts``;
    - TensorRT-LLM's JSON iteration stats (``trtllm-serve`` with ``enable_iter_perf_stats``): each read returns the
      iterations since the previous one, so their ``specDecodingStats`` sums are marked ``drained`` (counts of what
      ran since the last read, not running totals); attention-DP copies of rank 0's row are skipped;
    - SGLang's gauge of its last decode window's acceptance: ``accept_rate_gauge`` (a sample, not a count).
    """
    import requests

    try:
        resp = _http().get(endpoint.root + "/metrics", headers=endpoint.headers(), timeout=(endpoint.connect_timeout_s, 30.0))
    except requests.RequestException:
        return None
    if resp.status_code != 200:
        return None
    text = resp.text
    if text.lstrip().startswith("["):
        return parse_iteration_stats(text)
    return parse_counters(text)


def settled_counters(endpoint: Endpoint, settle_s: float = 0.2, reads: int = 6) -> dict[str, float] | None:
    """:func:`spec_counters` read once the server has counted its last replies: a server may count a request's
    drafts a moment after its stream ends (vLLM's front end records a step's stats after it hands the outputs on;
    the test server after its last chunk), so a read made as the last reply arrives can miss them. Reads again every
    ``settle_s`` until two reads agree (at most ``reads`` reads; the last one stands). A draining server's reads
    (TensorRT-LLM's) are added up until one returns nothing new."""
    got = spec_counters(endpoint)
    for _ in range(reads - 1):
        if not got or "draft_tokens" not in got:
            return got
        time.sleep(settle_s)
        again = spec_counters(endpoint)
        if not again or "draft_tokens" not in again:
            return got
        if got.get("drained"):
            if not again.get("draft_tokens") and not again.get("accepted_tokens"):
                return got
            got = {**got, "draft_tokens": got["draft_tokens"] + again["draft_tokens"],
                   "accepted_tokens": got.get("accepted_tokens", 0.0) + again.get("accepted_tokens", 0.0)}
            continue
        if all(again.get(k) == got.get(k) for k in SPEC_COUNTERS):
            return again
        got = again
    return got


def parse_counters(text: str) -> dict[str, float] | None:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        for key, name in SPEC_COUNTERS.items():
            if line.startswith(name + "_total") or line.startswith(name + "{") or line.startswith(name + " "):
                try:
                    out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
                except (ValueError, IndexError):
                    continue
        if not out and (line.startswith(SPEC_GAUGE + "{") or line.startswith(SPEC_GAUGE + " ")):
            try:
                out["accept_rate_gauge"] = float(line.rsplit(" ", 1)[1])
            except (ValueError, IndexError):
                continue
    if "draft_tokens" in out:
        out.pop("accept_rate_gauge", None)
    return out or None


def parse_iteration_stats(text: str) -> dict[str, float] | None:
    """TensorRT-LLM's ``/metrics`` (a JSON list of iteration stats): the draft and accepted tokens of the iterations
    it returned, or None where no row carries ``specDecodingStats``."""
    import json

    try:
        rows = json.loads(text)
    except ValueError:
        return None
    drafted = accepted = 0.0
    seen = False
    for row in rows if isinstance(rows, list) else []:
        if isinstance(row, str):  # some releases send each iteration as a JSON string
            try:
                row = json.loads(row)
            except ValueError:
                continue
        spec = row.get("specDecodingStats") if isinstance(row, dict) else None
        if not isinstance(spec, dict) or row.get("attentionDpRank", 0) not in (0, None):
            continue
        seen = True
        drafted += float(spec.get("numDraftTokens") or 0)
        accepted += float(spec.get("numAcceptedTokens") or 0)
    return {"draft_tokens": drafted, "accepted_tokens": accepted, "drained": 1.0} if seen else \
        ({"draft_tokens": 0.0, "accepted_tokens": 0.0, "drained": 1.0} if isinstance(rows, list) else None)


def counts_between(before: dict[str, float] | None, after: dict[str, float] | None) -> tuple[float, float] | None:
    """(accepted, drafted) tokens between two :func:`spec_counters` reads; None where unknown (no counters, a
    gauge only, or a counter that went down: the server restarted between the reads). A draining server's second
    read is itself what ran between them."""
    if after and after.get("drained"):
        return after.get("accepted_tokens", 0.0), after.get("draft_tokens", 0.0)
    if not before or not after or "draft_tokens" not in after:
        return None
    drafted = after.get("draft_tokens", 0.0) - before.get("draft_tokens", 0.0)
    accepted = after.get("accepted_tokens", 0.0) - before.get("accepted_tokens", 0.0)
    if drafted < 0 or accepted < 0:
        return None
    return accepted, drafted


def acceptance_between(before: dict[str, float] | None, after: dict[str, float] | None) -> float | None:
    """Accepted / drafted tokens between two :func:`spec_counters` reads, or None where unknown."""
    counts = counts_between(before, after)
    return counts[0] / counts[1] if counts and counts[1] > 0 else None
