"""Serving on vLLM's async engine: concurrent requests decode together, each with its own rule.

:class:`AsyncVLLMDecoder` wraps vLLM's ``AsyncLLM`` (the engine behind vLLM's own OpenAI server):
every request that arrives joins the running batch at the next step (continuous batching) and its
tokens stream back as vLLM produces them. A request's rule (policy, params, seed) travels with it in
``SamplingParams.extra_args`` and the plugin groups each step's requests by rule, so two clients
with different ``spec_decode`` overrides are decoded in the same steps. A request's statistics are
its own: vLLM's per-request speculative-decoding metrics, and the plugin's per-request ledger
(lossless-fallback steps, the digests of the rules that decided it) taken for that request alone.
A client that goes away aborts its request in vLLM; the others go on.

Speculation off (``rule=None``) runs on a second, target-only ``AsyncLLM`` started on first use —
not where one engine at a time is the setting (vLLM-CPU: RAM holds one fp32 real pair's engines):
a server cannot stop its speculative engine under requests in flight, so there it is refused.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections.abc import AsyncIterator
from typing import Any

from workers.cpu_engine import check_request
from workers.stats import Generation
from workers.vllm.common import (
    EngineDied,
    VLLMProcessSetup,
    VLLMUnavailable,
    engine_kwargs,
    merge_rank_ledgers,
    plan_memory_on_gpu,
    refuse_sampling_constraints,
    rule_missing,
    rule_spec,
    sampling_params,
    shutdown_engine,
    to_generation,
)
from workers.vllm.rules import rule_digest
from workers.vllm.settings import VLLMPair, VLLMSettings, _declared_eos, check_drafter_dirs


class AsyncVLLMDecoder:
    """One pair on vLLM's ``AsyncLLM``: :meth:`stream` yields new token ids as they come, then the
    request's :class:`~workers.stats.Generation`."""

    def __init__(self, pair: str, settings: VLLMSettings | None = None,
                 cache_dir: str | os.PathLike[str] | None = None) -> None:
        from workers.models.pair import eos_token_ids, pair_dirs

        self.settings = s = settings or VLLMSettings()
        try:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as err:
            raise VLLMUnavailable(f"the vLLM engine needs vllm installed ({err})") from None
        draft_dir, target_dir, pair_cache = pair_dirs(pair, cache_dir)
        # before any vLLM process: a pair vLLM would refuse late (or run wrongly) fails here, naming the fix
        self._draft_width = check_drafter_dirs(s, draft_dir, target_dir)
        # on a GPU, unless the user chose: the memory plan's fractions and engines (a pair that does not fit fails here)
        self.settings = s = plan_memory_on_gpu(s, draft_dir, target_dir)
        # every request here carries its own rule; the setup's lossless rule file only makes the plugin act
        self._setup = setup = VLLMProcessSetup(s, prefix="spectune-vllm-async-")
        self.cpu_binding, self.exclusive = setup.cpu_binding, setup.exclusive
        self._args = AsyncEngineArgs
        self._async_llm = AsyncLLM
        self._target_dir = target_dir
        self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_kwargs(
            s, target_dir, draft_dir, shared=not self.exclusive, draft_width=self._draft_width)))
        self._reference: Any = None
        self._reference_lock: asyncio.Lock | None = None
        self._ids = itertools.count()
        self.fallback_totals: dict[str, Any] = {}
        tok = self.engine.get_tokenizer()
        vocab = int(self.engine.model_config.get_vocab_size())
        self.pair = VLLMPair(pair, tok, s.dtype, vocab, eos_token_ids(tok, _declared_eos(target_dir)), pair_cache,
                             draft_dir, target_dir, self._draft_width)
        self.checked = False
        self.in_flight = 0  # requests inside vLLM now, and the most at once (continuous batching at work)
        self.peak_in_flight = 0

    @property
    def dead(self) -> str | None:
        """Why this decoder can no longer serve (vLLM declared one of its engines dead), else None. A dead
        ``AsyncLLM`` is not restarted under requests in flight: the server reports itself unhealthy and
        Ray Serve replaces the replica (a new process, a new engine)."""
        for name, engine in (("speculative", self.engine), ("target-only reference", self._reference)):
            if engine is not None and getattr(engine, "errored", False):  # AsyncLLM: its core dead or its loop
                return (f"the {name} vLLM engine died (a step past VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS, a worker "
                        "or the engine core killed; vLLM's log names the cause)")
        return None

    async def check(self) -> None:
        """Start-up check: a short greedy request must be decided by spectune's rule, in every rank."""
        n = 2 * self.settings.draft_len + 2
        gen = None
        async for part in self.stream([1, 2, 3, 4], "lossless", max_new_tokens=n, stop_on_eos=False):
            gen = part
        assert isinstance(gen, Generation)
        if gen.stats.num_drafts == 0:
            raise VLLMUnavailable("vLLM ran no speculative step in the start-up check: speculation is not active")
        self.checked = True

    async def stream(self, prompt_ids: Any, rule: Any, *, max_new_tokens: int = 256, temperature: float = 0.0,
                     seed: int | None = 0, stop: list[str] | tuple[str, ...] | None = None,
                     stop_on_eos: bool = True, top_p: float = 1.0, top_k: int | None = None,
                     min_p: float = 0.0) -> AsyncIterator[list[int] | Generation]:
        """Yield lists of new token ids (EOS excluded), then the finished Generation. ``rule``: a Policy,
        a name or ``{"policy", "params", "seed"}`` (speculative), or None (target-only). ``seed`` None: the
        request carries no seed (a T > 0 request is then sampled by vLLM's batched generator, not its own:
        no per-request loop at large batch; not reproducible). Bad input raises
        ValueError before anything reaches vLLM: ``top_p``/``top_k``/``min_p`` other than off too (a rule
        does not apply them; :func:`~workers.vllm.common.refuse_sampling_constraints`)."""
        refuse_sampling_constraints(top_p, top_k, min_p)
        prompt = check_request(prompt_ids, self.pair.draft_width or self.pair.vocab_size, max_new_tokens, temperature)
        if len(prompt) + max_new_tokens > self.settings.max_model_len:
            raise ValueError(f"{len(prompt)} prompt tokens + max_new_tokens {max_new_tokens} exceed this vLLM "
                             f"engine's max_model_len of {self.settings.max_model_len}")
        spec = None if rule is None else rule_spec(rule, self.settings.seed)
        engine = self.engine if spec is not None else await self._reference_engine()
        eos = list(self.pair.eos_token_ids) if stop_on_eos else []
        params = sampling_params(max_new_tokens, temperature, seed, stop, eos, spec)
        request_id = f"spectune-{os.getpid()}-{next(self._ids)}"
        t0 = time.perf_counter()
        sent, final = 0, None
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            async for out in engine.generate({"prompt_token_ids": prompt}, params, request_id):
                tokens = out.outputs[0].token_ids
                new = [t for t in tokens[sent:] if t not in eos]
                sent = len(tokens)
                if new:
                    yield new
                final = out
        except Exception as err:
            why = self.dead
            if why is not None:
                raise EngineDied(f"request {request_id}: {why}") from err
            await engine.abort(request_id)
            raise
        except BaseException:
            if self.dead is None:
                await engine.abort(request_id)  # the client went away (or the loop is cancelled): free its slot
            raise
        finally:
            self.in_flight -= 1
        if final is None:
            raise RuntimeError(f"vLLM returned no output for request {request_id}")
        entry = await self._take_ledger(request_id) if spec is not None else {}
        gen = to_generation(final, prompt, eos, time.perf_counter() - t0, int(entry.get("lossless_fallback_steps", 0)),
                            self.settings.draft_len if spec is not None else None)
        if spec is not None and gen.stats.num_drafts and rule_digest(spec) not in entry.get("rules", set()):
            raise rule_missing(f"request {request_id}", gen.stats.num_drafts, spec["policy"], entry)
        if spec is None:
            gen.stats.num_drafts = gen.stats.target_forwards = gen.stats.num_generated
        yield gen

    async def generate(self, prompt_ids: Any, rule: Any, **kwargs: Any) -> Generation:
        """:meth:`stream` to the end."""
        gen = None
        async for part in self.stream(prompt_ids, rule, **kwargs):
            gen = part
        assert isinstance(gen, Generation)
        return gen

    def close(self) -> None:
        for engine in (self.engine, self._reference):
            if engine is not None:
                shutdown_engine(engine)
        self._reference = None

    async def _take_ledger(self, request_id: str) -> dict[str, Any]:
        """This request's entry of the plugin's ledger, merged over TP ranks (counts by max, rules by
        union); only this request's entries are taken, concurrent requests keep theirs."""
        ranks = await self.engine.collective_rpc("spectune_take_fallbacks", kwargs={"request_ids": [request_id]})
        merged, self.fallback_totals = merge_rank_ledgers(list(ranks))
        entries = list(merged.values())  # vLLM's internal id is the external one with a suffix: one entry
        return entries[0] if entries else {"steps": 0, "lossless_fallback_steps": 0, "rules": set()}

    async def _reference_engine(self) -> Any:
        if self.exclusive:
            raise ValueError("speculation off needs a second, target-only vLLM engine and this server runs one "
                             "engine at a time (vLLM-CPU default; one_engine_at_a_time=false starts both): "
                             "send a spec_decode rule")
        if self._reference_lock is None:
            self._reference_lock = asyncio.Lock()
        async with self._reference_lock:
            if self._reference is None:
                args = self._args(**engine_kwargs(self.settings, self._target_dir, None, shared=not self.exclusive,
                                                  draft_width=self._draft_width))
                self._reference = await asyncio.to_thread(self._async_llm.from_engine_args, args)
        return self._reference
