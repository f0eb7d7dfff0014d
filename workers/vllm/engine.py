"""The vLLM engine: the same interface and per-generation stats as :class:`workers.cpu_engine.SpecDecoder`,
with vLLM's ``draft_model`` speculation and spectune's rule deciding inside vLLM's verification.

One engine hosts one pair. vLLM fixes the draft length when it starts, so a generation must ask for
that length. The rule can change between generations: the engine writes the rule file that the
``workers.vllm.plugin`` plugin reads in every vLLM process, then checks from the plugin's report that
this rule — not vLLM's own — decided the generation. Target-only decoding (the references) runs a
second vLLM engine without speculation, started on first use.

Stats are per request: vLLM's own per-request speculative-decoding metrics
(``per_request_spec_decode_metrics="summary"``: the histogram of accepted drafts per verify step, the
same accounting as its engine-wide ``spec_decode`` counters) mapped onto spectune's names, times from
vLLM's request timestamps, and the plugin's lossless-fallback count per request (read from the worker
with ``collective_rpc``). So a batch of requests in one ``generate`` (:meth:`VLLMDecoder.generate_batch`,
:meth:`VLLMDecoder.evaluate_items`: continuous batching) gets every request's own statistics.

On vLLM-CPU the engine binds vLLM's OpenMP threads to the CPUs this process may use
(``VLLM_CPU_OMP_THREADS_BIND`` from ``os.sched_getaffinity``, or ``num_cpus`` of them from
``cpu_offset`` on: a Ray actor's share), unless the user set the variable: vLLM's own default
("auto") reserves a core for its scheduler, which on a 2-core machine halves the model's threads.
The settings, that binding and the metric mapping live in :mod:`workers.vllm.settings` (no vLLM needed).

What vLLM cannot do here, the engine refuses with a message: ``trace`` (per-round logits), draft
lengths other than the one it started with. ``on_tokens`` is called once, with all tokens (the offline
API does not stream; an abort cannot stop a generation part-way). Under tensor parallelism DropMatch
all-gathers the target's sharded LM head once per worker (not exercised on this CPU-only machine).

An engine vLLM declares dead (a step past ``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS``, a worker or the engine
core killed) is replaced: the batch in flight reruns once on a new engine, and a second death fails its
requests with :class:`EngineDied` (counted: ``engine_deaths``, ``batch_retries``); the decoder itself
goes on. :class:`~workers.vllm.common.DeathWatch` keeps vLLM's sync client from waiting forever on a
core that exited on a signal.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from typing import Any

from policies import Policy, make_policy
from workers.cpu_engine import check_request
from workers.stats import Generation
from workers.vllm.common import (  # noqa: F401 - VLLMUnavailable, check_plugin_installed: public here too
    WORKER_EXTENSION,
    DeathWatch,
    EngineDied,
    VLLMProcessSetup,
    VLLMUnavailable,
    check_plugin_installed,
    describe_rule,
    engine_dead,
    engine_kwargs,
    is_engine_death,
    lose_batch,
    merge_rank_ledgers,
    plan_memory_on_gpu,
    reap_workers,
    refuse_sampling_constraints,
    rule_missing,
    rule_spec,
    sampling_params,
    shutdown_engine,
    to_generation,
)
from workers.vllm.rules import (
    NATIVE,
    rule_digest,
    seen_rules,
    write_rule,
)
from workers.vllm.settings import (
    STEP_TIMEOUT_ENV,
    VLLMPair,
    VLLMSettings,
    _declared_eos,
    check_drafter_dirs,
)

SPECULATIVE, REFERENCE = "speculative", "target-only reference"  # the two engines a decoder may run
logger = logging.getLogger(__name__)


class VLLMDecoder:
    """Speculative decoding in vLLM with any registered rule, plus target-only decoding."""

    def __init__(self, pair: str, settings: VLLMSettings | None = None, cache_dir: str | os.PathLike[str] | None = None
                 ) -> None:
        from workers.models.pair import eos_token_ids, pair_dirs

        self.settings = settings or VLLMSettings()
        try:
            from vllm import LLM
        except ImportError as err:
            raise VLLMUnavailable(f"the vLLM engine needs vllm installed ({err})") from None
        draft_dir, target_dir, pair_cache = pair_dirs(pair, cache_dir)
        # before any vLLM process: a pair vLLM would refuse late (or run wrongly) fails here, naming the fix
        self._draft_width = check_drafter_dirs(self.settings, draft_dir, target_dir)
        # on a GPU, unless the user chose: the memory plan's fractions and engines (a pair that does not fit fails here)
        self._chosen = self.settings  # before the plan: memory_report() recomputes the plan from these
        self.settings = plan_memory_on_gpu(self.settings, draft_dir, target_dir)
        self._setup = setup = VLLMProcessSetup(self.settings)
        self.cpu_binding, self.rule_file, self._digest = setup.cpu_binding, setup.rule_file, setup.digest
        s = self.settings
        self._dirs = (target_dir, draft_dir)
        self._reference: Any = None
        # One engine at a time (the reference started only after the speculative one stopped, and back):
        # on vLLM-CPU the two fp32 engines of the real pair need ~28 GB together; on a GPU both stay up.
        self.exclusive = setup.exclusive
        self.engine_switches = 0
        self.engine_deaths = 0  # engines vLLM declared dead under a batch, each replaced (docs: "Engine death")
        self.batch_retries = 0  # batches rerun on the replacement (once each)
        self.workers_reaped: list[int] = []  # a dead engine's workers killed because they outlived it
        self._worker_pids: dict[str, list[int]] = {}
        self._closed = False
        self._llm: Any = None
        if s.target_only:  # the reference engine alone: nothing speculative to start or check
            first = self._reference = LLM(**self._engine_kwargs(REFERENCE))
            self._note_workers(REFERENCE, first)
        else:
            first = self._llm = LLM(**self._engine_kwargs(SPECULATIVE))
            self._note_workers(SPECULATIVE, first)
        self.fallback_totals: dict[str, Any] = {}
        tok = first.get_tokenizer()
        vocab = int(first.llm_engine.model_config.get_vocab_size())
        self.pair = VLLMPair(pair, tok, s.dtype, vocab, eos_token_ids(tok, _declared_eos(target_dir)), pair_cache,
                             draft_dir, target_dir, self._draft_width)
        if not s.target_only:
            self._assert_rule_runs()

    # -- public API (SpecDecoder's) ---------------------------------------------------------------

    def generate(self, prompt_ids: Any, policy: Policy | str = "lossless", draft_len: int = 5,
                 max_new_tokens: int = 256, temperature: float = 0.0, seed: int = 0,
                 stop: list[str] | tuple[str, ...] | None = None, trace: bool = False,
                 on_tokens: Any = None, *, top_p: float = 1.0, top_k: int | None = None, min_p: float = 0.0
                 ) -> Generation:
        """``policy="vllm-native"`` verifies with vLLM's own rejection sampler (A/B measurements).
        ``top_p``/``top_k``/``min_p`` other than off are refused (:func:`refuse_sampling_constraints`)."""
        if trace:
            raise ValueError("trace=True (per-round target logits) is a CPU-engine feature; vLLM does not expose them")
        (result,) = self.generate_batch([prompt_ids], policy, draft_len, max_new_tokens, temperature, [seed], stop,
                                        errors="raise", top_p=top_p, top_k=top_k, min_p=min_p)
        assert isinstance(result, Generation)
        if on_tokens is not None and result.token_ids:
            on_tokens(result.token_ids)  # once, at the end: the offline LLM API does not stream
        return result

    def generate_batch(self, prompts: Sequence[Any], policy: Any = "lossless", draft_len: int = 5,
                       max_new_tokens: int = 256, temperature: float = 0.0, seeds: Sequence[int] | int = 0,
                       stop: list[str] | tuple[str, ...] | None = None, errors: str = "return", *,
                       top_p: float = 1.0, top_k: int | None = None, min_p: float = 0.0
                       ) -> list[Generation | Exception]:
        """Every prompt in one vLLM ``generate`` (continuous batching), each with its own statistics.

        ``policy``: one rule for every request (the engine's rule file: a Policy, a name, or
        ``"vllm-native"``), or a list with one rule per request (a Policy, a name, or
        ``{"policy", "params", "seed"}``; the seed defaults to the engine's): each request then carries
        its own rule in ``SamplingParams.extra_args`` and the plugin groups the step's requests by rule.
        A request that cannot run (bad ids, longer than ``max_model_len``) gets its exception in its
        slot (``errors="return"``) instead of failing the others; ``errors="raise"`` raises the first.
        ``top_p`` < 1, ``top_k`` > 0 or ``min_p`` > 0 raise ValueError for the whole call: a rule does not
        apply them (:func:`~workers.vllm.common.refuse_sampling_constraints`)."""
        refuse_sampling_constraints(top_p, top_k, min_p)
        if draft_len != self.settings.draft_len:
            raise ValueError(f"this vLLM engine was started with draft length {self.settings.draft_len}; "
                             f"got {draft_len} (vLLM fixes num_speculative_tokens at start)")
        if isinstance(policy, (list, tuple)):
            if len(policy) != len(prompts):
                raise ValueError(f"got {len(policy)} rules for {len(prompts)} prompts")
            rules = [self._rule_spec(p) for p in policy]
            if self._rule_name == NATIVE:  # per-request rules need spectune's plugin active in the step
                self._set_rule(make_policy("lossless"))
            return self._run_many(SPECULATIVE, prompts, max_new_tokens, temperature, seeds, stop, errors=errors,
                                  rules=rules)
        if isinstance(policy, str) and policy != NATIVE:
            policy = make_policy(policy)
        self._set_rule(policy)
        if policy != NATIVE:
            # the rule travels with every request (extra_args), as vLLM broadcasts it to every TP rank:
            # no rank reads a different rule or seed from the rule file, whatever the timing of its writes
            return self._run_many(SPECULATIVE, prompts, max_new_tokens, temperature, seeds, stop, errors=errors,
                                  rules=[self._rule_spec(policy)] * len(prompts))
        results = self._run_many(SPECULATIVE, prompts, max_new_tokens, temperature, seeds, stop, errors=errors)
        drafts = sum(g.stats.num_drafts for g in results if isinstance(g, Generation))
        if drafts and not any(r.get("digest") == self._digest for r in seen_rules(self.rule_file)):
            raise VLLMUnavailable(f"vLLM verified {drafts} drafts but the rule file's {self._rule_name} was not "
                                  "read: the plugin is not active in vLLM's worker processes")
        return results

    def autoregressive(self, prompt_ids: Any, max_new_tokens: int = 256, temperature: float = 0.0, seed: int = 0,
                       stop: list[str] | tuple[str, ...] | None = None, trace: bool = False,
                       on_tokens: Any = None) -> Generation:
        """Target-only decoding on a second vLLM engine without speculation (started on first use)."""
        if trace:
            raise ValueError("trace=True (per-round target logits) is a CPU-engine feature; vLLM does not expose them")
        (result,) = self.autoregressive_batch([prompt_ids], max_new_tokens, temperature, [seed], stop, errors="raise")
        assert isinstance(result, Generation)
        if on_tokens is not None and result.token_ids:
            on_tokens(result.token_ids)
        return result

    def autoregressive_batch(self, prompts: Sequence[Any], max_new_tokens: int = 256, temperature: float = 0.0,
                             seeds: Sequence[int] | int = 0, stop: list[str] | tuple[str, ...] | None = None,
                             errors: str = "return") -> list[Generation | Exception]:
        """Target-only decoding of every prompt in one ``generate`` on the reference engine."""
        results = self._run_many(REFERENCE, prompts, max_new_tokens, temperature, seeds, stop, errors=errors)
        for g in results:
            if isinstance(g, Generation):
                g.stats.num_drafts = g.stats.target_forwards = g.stats.num_generated
        return results

    def evaluate_items(self, bench: Any, items: Sequence[Any], spec: Any,
                       references: dict[str, list[str]] | None = None) -> list[Any]:
        """:func:`workers.evaluation.evaluate_item` for a whole list of items, each turn of every item in
        one batched ``generate`` (:func:`workers.vllm.batch_eval.evaluate_items`)."""
        from workers.vllm.batch_eval import evaluate_items

        return evaluate_items(self, bench, items, spec, references)

    def close(self) -> None:
        """Stop vLLM's engine-core processes now (rather than at interpreter exit)."""
        for llm in (self._llm, self._reference):
            shutdown_engine(llm)
        self._llm = self._reference = None
        self._closed = True

    def profile(self) -> dict[str, Any]:
        """vLLM does not expose draft/target step times separately: c must come from the caller."""
        return {"pair": self.pair.name, "cost_ratio": None, "verify_s": {}, "engine": "vllm"}

    def worker_env(self, which: str | None = None) -> list[dict[str, Any]]:
        """What each vLLM worker process of an engine runs with (pid, thread binding, CPUs, OpenMP threads)
        and what it did (spectune_env): ``which`` (SPECULATIVE or REFERENCE), or by default the speculative
        engine if it is up, else the reference one; never starts one."""
        if which not in (None, SPECULATIVE, REFERENCE):
            raise ValueError(f"which must be {SPECULATIVE!r} or {REFERENCE!r}, got {which!r}")
        live = {SPECULATIVE: self._llm, REFERENCE: self._reference}.get(which) if which else (
            self._llm if self._llm is not None else self._reference)
        return [] if live is None else list(live.collective_rpc("spectune_env"))

    def memory_report(self) -> dict[str, Any]:
        """Each engine that is up, against what it was given: its workers' peak reserved device memory (None on
        CPU builds), its ``gpu_memory_utilization`` share and, on a GPU where the memory plan chose the shares,
        whether the peak stayed within what the plan allows it: its share, plus spectune's extras for the
        speculative engine (the plan keeps them outside both shares: workers/vllm/memory.py). After a warm
        batch; docs/gpu.md says what a first GPU run records."""
        from workers.vllm.common import device_total_bytes, memory_decision, memory_shares
        from workers.vllm.memory import GIB

        shares = dict(zip((SPECULATIVE, REFERENCE), memory_shares(self.settings, not self.exclusive), strict=True))
        report: dict[str, Any] = {"max_num_seqs": self.settings.max_num_seqs, "engines": {}}
        total = None
        for which, llm in ((SPECULATIVE, self._llm), (REFERENCE, self._reference)):
            if llm is None:
                continue
            peaks = [w.get("cuda_max_reserved_bytes") for w in self.worker_env(which)]
            entry: dict[str, Any] = {"gpu_memory_utilization": shares[which], "worker_max_reserved_bytes": peaks}
            if peaks and all(p is not None for p in peaks):
                total = total or device_total_bytes()
                entry["share_bytes"] = int(shares[which] * total)
                _, plan = memory_decision(self._chosen, self._dirs[1], self._dirs[0], total)
                if plan is not None and self.settings.kv_cache_memory_bytes is None:
                    extras = int(plan.extras_gib * GIB) if which == SPECULATIVE else 0
                    entry["plan_extras_bytes"] = extras
                    entry["within_plan"] = all(p <= entry["share_bytes"] + extras for p in peaks)
            report["engines"][which] = entry
        report["device_total_bytes"] = total
        return report

    # -- the pieces -----------------------------------------------------------------------------

    @property
    def llm(self) -> Any:
        """The speculative engine (restarted here if the reference took its place)."""
        if self._closed:
            raise RuntimeError("this vLLM engine was closed")
        if self.settings.target_only:
            raise ValueError("this vLLM engine decodes target-only (VLLMSettings.target_only): it has no "
                             "speculative engine; use autoregressive()")
        if self._llm is not None and engine_dead(self._llm):  # died between calls: nothing in flight was lost
            self._bury(SPECULATIVE, None, 0)
        if self._llm is None:
            from vllm import LLM

            if self._reference is not None:
                shutdown_engine(self._reference)
                self._reference = None
                self.engine_switches += 1
            self._llm = LLM(**self._engine_kwargs(SPECULATIVE))
            self._note_workers(SPECULATIVE, self._llm)
            self._assert_rule_runs()
        return self._llm

    def _reference_llm(self) -> Any:
        if self._closed:
            raise RuntimeError("this vLLM engine was closed")
        if self._reference is not None and engine_dead(self._reference):
            self._bury(REFERENCE, None, 0)
        if self._reference is None:
            from vllm import LLM

            if self.exclusive and self._llm is not None:
                shutdown_engine(self._llm)
                self._llm = None
                self.engine_switches += 1
            self._reference = LLM(**self._engine_kwargs(REFERENCE))
            self._note_workers(REFERENCE, self._reference)
        return self._reference

    def _engine_kwargs(self, which: str) -> dict[str, Any]:
        target_dir, draft_dir = self._dirs
        return engine_kwargs(self.settings, target_dir, draft_dir if which == SPECULATIVE else None,
                             shared=not self.exclusive, draft_width=self._draft_width)

    def _rule_spec(self, rule: Any) -> dict[str, Any]:
        return rule_spec(rule, self.settings.seed)

    def _set_rule(self, policy: Policy | str) -> None:
        described = describe_rule(policy)
        spec = {"policy": described["policy"], "params": described["params"], "seed": self.settings.seed}
        if rule_digest(spec) != self._digest:
            self._digest = write_rule(self.rule_file, spec["policy"], spec["params"], self.settings.seed)
        self._rule_name, self._rule_policy = spec["policy"], policy

    def _assert_rule_runs(self) -> None:
        """Start-up check: one short greedy generation must be decided by spectune's rule in every TP rank
        (each rank's own ledger entry for the request names the rule; vLLM's profiling run, which also
        goes through the plugin, does not count)."""
        before = getattr(self, "_rule_policy", None)  # a restart mid-run: the rule file goes back to it after
        self._set_rule(make_policy("lossless"))
        n = 2 * self.settings.draft_len + 2
        rule = self._rule_spec("lossless")
        try:
            (gen,) = self._run_many(SPECULATIVE, [[1, 2, 3, 4]], n, 0.0, 0, None, errors="return",
                                    stop_on_eos=False, rules=[rule], retry=False)
        finally:
            if before is not None:
                self._set_rule(before)
        if isinstance(gen, EngineDied):  # the new engine died in its first step: the next call tries again
            raise gen
        if isinstance(gen, VLLMUnavailable):
            raise VLLMUnavailable(f"vLLM verified drafts at start-up but spectune's rule never ran ({gen}); see "
                                  "VLLM_PLUGINS and the log")
        if isinstance(gen, Exception):
            raise gen
        if gen.stats.num_drafts == 0:
            raise VLLMUnavailable("vLLM ran no speculative step in the start-up check: speculation is not active")

    def _note_workers(self, which: str, llm: Any) -> None:
        self._worker_pids[which] = [int(w["pid"]) for w in llm.collective_rpc("spectune_env")]

    def _engine(self, which: str) -> Any:
        return self.llm if which == SPECULATIVE else self._reference_llm()

    def _bury(self, which: str, err: BaseException | None, n: int) -> EngineDied:
        """Forget an engine vLLM declared dead (the next call starts a new one) and say what was lost."""
        dead = self._llm if which == SPECULATIVE else self._reference
        if which == SPECULATIVE:
            self._llm = None
        else:
            self._reference = None
        shutdown_engine(dead)
        reaped = reap_workers(self._worker_pids.pop(which, []))
        self.workers_reaped += reaped
        self.engine_deaths += 1
        cause = f"{type(err).__name__}: {err}" if err is not None else "found dead between calls"
        msg = (f"the {which} vLLM engine died ({cause}) with {n} request(s) in flight; vLLM's log above names "
               f"the cause (a step past VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS="
               f"{os.environ.get(STEP_TIMEOUT_ENV, 'unset')} s, a worker or the engine core killed, e.g. for "
               f"memory). Engine deaths so far: {self.engine_deaths}; the next call starts a new engine"
               + (f"; killed its worker(s) {reaped}, still running after it" if reaped else ""))
        logger.warning("%s", msg)
        return EngineDied(msg)

    def _take_ledger(self, llm: Any) -> dict[str, dict[str, Any]]:
        """The plugin's per-request records from the worker(s) since the last call (then cleared), keyed
        by vLLM's internal request id *and* by the external id it was made from ("<external>-<8 random
        chars>"): verify steps, lossless-fallback steps, the digests of the rules that decided in every
        rank (:func:`merge_rank_ledgers`). The worker's running totals land in ``self.fallback_totals``."""
        ranks, self.fallback_totals = merge_rank_ledgers(list(llm.collective_rpc("spectune_take_fallbacks")))
        merged: dict[str, dict[str, Any]] = {}
        for req_id, entry in ranks.items():
            merged[req_id] = merged[req_id.rsplit("-", 1)[0]] = entry
        return merged

    def _run_many(self, which: str, prompts: Sequence[Any], max_new_tokens: int, temperature: float,
                  seeds: Sequence[int] | int, stop: Any, *, errors: str, stop_on_eos: bool = True,
                  rules: Sequence[dict[str, Any]] | None = None, retry: bool = True) -> list[Generation | Exception]:
        """One ``generate`` on engine ``which`` (SPECULATIVE or REFERENCE). ``rules``: per-request rule specs,
        carried in ``SamplingParams.extra_args``; each request's record must then show that its own rule
        decided it. An engine that dies under the batch is replaced and the batch rerun once on the new
        one (``retry``; keyed draws make the rerun decide as the first run would have); a second death
        fails the batch's requests with :class:`EngineDied`."""
        n = len(prompts)
        seed_list = [int(seeds)] * n if isinstance(seeds, int) else [int(x) for x in seeds]
        if len(seed_list) != n:
            raise ValueError(f"got {len(seed_list)} seeds for {n} prompts")
        speculative = which == SPECULATIVE
        eos = list(self.pair.eos_token_ids) if stop_on_eos else []
        results: list[Generation | Exception] = [ValueError("not run")] * n
        checked: dict[int, list[int]] = {}
        for i, prompt_ids in enumerate(prompts):
            try:
                prompt = check_request(prompt_ids, self.pair.draft_width or self.pair.vocab_size, max_new_tokens,
                                       temperature)
                if len(prompt) >= self.settings.max_model_len:
                    raise ValueError(f"the prompt has {len(prompt)} tokens; this vLLM engine's max_model_len is "
                                     f"{self.settings.max_model_len}")
                checked[i] = prompt
            except ValueError as err:
                if errors == "raise":
                    raise
                results[i] = err
        if not checked:
            return results
        order = sorted(checked)
        params = [sampling_params(max_new_tokens, temperature, seed_list[i], stop, eos,
                                  None if rules is None else rules[i]) for i in order]
        attempts = 2 if retry else 1
        for attempt in range(attempts):
            try:
                llm = self._engine(which)  # a new one after a death; it may die in its start-up check too
            except EngineDied as err:
                if attempt + 1 < attempts:
                    self.batch_retries += 1
                    continue
                return lose_batch(order, results, err, errors, attempt + 1)
            try:
                if speculative:
                    self._take_ledger(llm)  # start clean: what follows belongs to these requests
                t0 = time.perf_counter()
                with DeathWatch(llm):
                    outs = llm.generate([{"prompt_token_ids": checked[i]} for i in order], params, use_tqdm=False)
                wall = time.perf_counter() - t0
                ledger = self._take_ledger(llm) if speculative else {}
                break
            except Exception as err:
                if is_engine_death(err, llm):
                    died = self._bury(which, err, len(order))
                    if attempt + 1 < attempts:
                        self.batch_retries += 1
                        continue
                    return lose_batch(order, results, died, errors, attempt + 1)
                if errors == "raise" or len(order) == 1:
                    raise
                # vLLM refused the batch (a request it rejects that the checks above let through): one by
                # one, so only the bad request fails
                for i in order:
                    try:
                        (results[i],) = self._run_many(which, [checked[i]], max_new_tokens, temperature,
                                                       [seed_list[i]], stop, errors="return", stop_on_eos=stop_on_eos,
                                                       rules=None if rules is None else [rules[i]], retry=retry)
                    except Exception as err:  # noqa: BLE001
                        results[i] = err
                return results
        for i, out in zip(order, outs, strict=True):
            entry = ledger.get(str(out.request_id), {})
            gen = to_generation(out, checked[i], eos, wall if len(order) == 1 else None,
                                int(entry.get("lossless_fallback_steps", 0)),
                                self.settings.draft_len if speculative else None)
            if rules is not None and gen.stats.num_drafts and rule_digest(rules[i]) not in entry.get("rules", set()):
                err = rule_missing(f"request {i}", gen.stats.num_drafts, rules[i]["policy"], entry)
                if errors == "raise":
                    raise err
                results[i] = err
                continue
            results[i] = gen
        return results
