"""spectune's acceptance rules inside vLLM's verification: the ``vllm.general_plugins`` entry point.

``pyproject.toml`` declares ``spectune_rules = "workers.vllm.plugin:register"``; vLLM calls :func:`register` in
every process it starts (front end, engine core, each TP worker), possibly more than once: it patches idempotently.
A rule runs where the environment names a rule file (``SPECTUNE_VLLM_RULE_FILE``, written by
:class:`workers.vllm.engine.VLLMDecoder`; re-read when it changes, so one engine serves trial after trial), or
where a request carries its own rule (then, with no file or a ``vllm-native`` one, the others run lossless).

What is patched (vLLM V1 model runner, which also runs ``draft_model`` speculation on 0.32/0.33 and
is the runner vLLM-CPU subclasses):

- ``vllm.v1.sample.rejection_sampler.rejection_sample`` -> :func:`policies.ragged.verify_flat` over
  the step's flat ``[num_tokens, V]`` rows (vectorised; one call per group of requests with the same rule and temperature). Its
  output keeps vLLM's contract: accepted draft tokens verbatim, then one token, ``-1`` after.
- ``apply_sampling_constraints`` -> identity while a rule is active: rules take raw logits and the
  temperature themselves (also sidesteps vLLM-CPU's broken T > 0 expansion of per-request temperatures). spectune's
  engines refuse top-p/top-k/min-p at admission; elsewhere a request with them is warned and counted.
- ``SpecDecodeBaseProposer._sample_draft_tokens`` also returns the draft's full distribution — exactly
  the one vLLM drew the token from, as its logits divided by T in the draft's dtype
  (:func:`workers.vllm.drafts.scaled_as_vllm`; T = 1 for greedy drafting, for which vLLM returns none) — which reaches the rule through vLLM's own per-request draft-probs plumbing. Greedy
  steps whose rules never read it (lossless, top-k, typical, DropMatch naive: ``_step_needs_q``) draft
  the way vLLM does, without the full-vocabulary log-softmax and cached distribution per draft token.
- ``GPUModelRunner.sample_tokens`` keeps the step's ``sample_hidden_states`` (final-norm outputs, rows aligned with
  the logits) and the target model for DropMatch's dropout heads: no second forward.

- A draft narrower than the target (Qwen2.5-0.5B's 151,936 logits under Qwen2.5-7B's 152,064; the engine
  names its width in the target's config, :data:`~workers.vllm.settings.PAD_ATTR`, and only then):
  ``SpeculativeConfig.verify_equal_vocab_size_if_draft_model`` lets that draft through (vLLM's
  heterogeneous-vocabulary path would force greedy drafting), ``DraftModelProposer._get_model`` pads the
  draft's ``compute_logits`` to the target's width with -inf (it never proposes a padded id, q = 0 there,
  and every vLLM path sees one width), and ``sample_tokens`` masks the target's logits on those ids to
  -inf in both engines (so KL(target ‖ draft) stays finite and lossless = target-only); DropMatch's
  dropout heads get the same mask as a bias.
- ``GPUModelRunner._input_fits_in_drafter`` also notes which requests' next drafts are placeholders: near
  ``max_model_len`` vLLM skips the drafter for the whole batch and fills the next step's drafts with
  token id 0 and no distribution (:func:`workers.vllm.drafts.note_drafter`). The rules never judge those: they become -1
  (rejected by every rule, the target's token emitted), counted as a fallback.
- Greedy drafting (``draft_sample_method="greedy"``) while a request samples (T > 0): the argmax drafts were not
  drawn from the distribution the proposer patch hands over, so T > 0 requests get none (q one-hot at the draft:
  lossless stays lossless) and rules that read q fall back to lossless, counted (spectune's engines never do).
- Under tensor parallelism ``rejection_sample`` broadcasts rank 0's output tokens to every rank each
  verify step (:func:`agree_across_ranks`) and the LM head is gathered by every rank at the first step whose
  rules need it (DropMatch; :func:`gather_head_under_tp`, after all ranks agree they can hold it): no rank can
  emit other tokens or join a collective alone.
- Gates (:mod:`workers.vllm.gates`): on an unsupported vLLM, a changed signature or a missing attribute nothing is
  patched and ``rejection_sample`` raises on first use; spectune's engines raise before vLLM starts.

A request carries its own rule in ``SamplingParams.extra_args[RULE_ARG]`` (spectune's engines always
send it; requests are grouped by rule; random draws keyed by rule seed, request seed and position);
requests without one use the rule file's, read once per step (under TP by rank 0 alone, then shared:
:meth:`workers.vllm.rules._RuleState.shared`). Nothing here raises inside a worker: a step the rule
cannot decide (its draft distribution or hidden states missing, or it failed) is decided by the
lossless rule for the requests concerned, counted per request in a ledger the front end reads through
:class:`WorkerExtension` (``collective_rpc``). The step decision (grouping, keyed seeds, fallbacks,
ledger) is :mod:`workers.vllm.step`, which rule decides is :mod:`workers.vllm.rules` (neither imports
vLLM), test-only fault injection is :mod:`workers.vllm.faults` (only with ``SPECTUNE_VLLM_TEST_FAULTS``
set). This module is the glue that patches vLLM and hands it a step's inputs. See docs/vllm-engine.md.

Each process that applies a rule writes ``<rule file>.seen.<pid>.json`` (rule digest and call count)
so the engine can assert that the rule it asked for is the one running — a plugin that did not
load is an error there, never a silent fallback to vLLM's rule. ``SPECTUNE_VLLM_TRACE_DIR`` (tests)
saves every call's inputs and outputs.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import Any

import torch

from policies import fused
from workers.vllm import drafts as _drafts
from workers.vllm.drafts import note_drafter, scaled_as_vllm  # noqa: F401 - public here too
from workers.vllm.heads import (  # noqa: F401 - public here too
    TP_AGREEMENT,
    _lm_head,
    _PaddedLogits,
    _tp_group,
    agree_across_ranks,
    gather_head_under_tp,
    mask_from,
    needs_head,
    pad_logits,
    padded_draft_width,
)
from workers.vllm.rules import (  # noqa: F401 - the rule names and helpers: public here too
    ENTRY_POINT,
    NATIVE,
    REQUEST_RULES,
    RULE,
    RULE_ARG,
    RULE_FILE_ENV,
    TRACE_DIR_ENV,
    _Active,
    carries_rules,
    implicit_rule,
    request_seed,
    rule_digest,
    rule_spec_of,
    seen_rules,
    write_rule,
)
from workers.vllm.step import (
    LEDGER,
    _lossless_everywhere,
    _warn_once,
    constrained_rows,
    decide_step,
    keyed_seed,
    needs_draft_distribution,
    needs_hidden,
)

_lock = threading.Lock()
_patched = False


class _Step(threading.local):
    """Per-step state handed from ``sample_tokens`` to the rejection sampler."""

    hidden: torch.Tensor | None = None  # [num_logits, d] final hidden states, rows aligned with logits
    target_indices: torch.Tensor | None = None  # rows of ``hidden`` at the draft positions
    model: Any = None
    req_ids: list[str] | None = None  # vLLM's request ids in batch order (the rows' order)
    rules: list[Any] | None = None  # per request: its own rule (extra_args), or None for the rule file's
    request_seeds: list[int] | None = None  # per request: SamplingParams.seed, else a hash of its id
    positions: list[int] | None = None  # per request: tokens computed before this step
    draft_scaled: bool = False  # the proposer patch handed over the drafter's logits divided by T (scaled_as_vllm)
    temps_cpu: list[float] | None = None  # per request: its temperature, from the host copy vLLM keeps
    greedy_drafts: bool = False  # ... for argmax drafts while some request samples (T > 0): not their q
    skipped: list[bool] | None = None  # per request: vLLM skipped the drafter, its drafts are placeholders
    snapshot: bool = False  # inside ``sample_tokens``: every hook of the step uses ``active``
    active: Any = None  # the rule file's rule as read once at the start of the step
    mask_from: int = 0  # a padded draft's width: the target's logits past it are -inf (0: no mask)


STEP = _Step()


def _step_needs_q(active: _Active) -> bool:
    """Inside ``sample_tokens`` (the step's rules known): whether any rule of the step reads the draft
    distribution at T = 0. Outside it, assume one does."""
    if not STEP.snapshot:
        return True
    rules = STEP.rules
    policies = [] if rules is None else [r.policy for r in rules if r is not None]
    if rules is None or any(r is None for r in rules):
        policies.append(active.policy)
    return any(needs_draft_distribution(p) for p in policies)


def step_temperatures(sampling_metadata: Any, b: int) -> list[float]:
    """Each request's temperature for the step, as host floats: from vLLM's host copy of them
    (``InputBatch.temperature_cpu``, which its device tensor is copied from), taken in ``sample_tokens``,
    so that no step waits on a device-to-host read; from the device tensor only where that copy is not
    there (another runner)."""
    if sampling_metadata.all_greedy or sampling_metadata.temperature is None:
        return [0.0] * b
    if STEP.temps_cpu is not None and len(STEP.temps_cpu) >= b:
        return [max(0.0, t) for t in STEP.temps_cpu[:b]]
    return sampling_metadata.temperature.float().clamp(min=0.0)[:b].tolist()


def _rule_now() -> _Active | None:
    """The rule file's rule for this hook: the step's snapshot inside ``sample_tokens`` (the file is read
    once per step, so a write between two hooks of one step cannot split it), else the file now."""
    return STEP.active if STEP.snapshot else RULE.current()


def apply_rule(active: _Active, draft_token_ids: torch.Tensor, num_draft_tokens: list[int], max_spec_len: int,
               draft_probs: torch.Tensor | None, target_logits: torch.Tensor, bonus_token_ids: torch.Tensor,
               sampling_metadata: Any, policy: Any = None) -> torch.Tensor:
    """vLLM's ``rejection_sample`` contract, decided by spectune's rules: [B, max_spec_len + 1] int32.
    Requests that carry their own rule (``SamplingParams.extra_args[RULE_ARG]``, read once per step in
    ``sample_tokens``) use it; the others use the rule file's. ``policy`` overrides every rule of the
    step (fault injection)."""
    override = policy
    policy = active.policy if policy is None else policy
    b = len(num_draft_tokens)
    req_ids = STEP.req_ids
    own = STEP.rules if STEP.rules is not None and len(STEP.rules) >= b else None
    policies = keys = request_seeds = None
    if own is not None:
        # ``policy`` given (fault injection) stands in for every rule of the step, the requests' own too
        policies = [None if r is None else (r.policy if override is None else override) for r in own[:b]]
        keys = [None if r is None else r.digest for r in own[:b]]
        request_seeds = [None if r is None else keyed_seed(int(r.spec.get("seed", 0)), STEP.request_seeds[i],
                                                          STEP.positions[i]) for i, r in enumerate(own[:b])]
    draft_logits = hidden = None
    if draft_probs is not None:
        # the drafter's logits divided by T from the proposer patch; else vLLM's own q (rules renormalize logs)
        draft_logits = draft_probs if STEP.draft_scaled else torch.log(draft_probs.float())
    if STEP.hidden is not None and STEP.target_indices is not None and (
            needs_hidden(policy) or any(p is not None and needs_hidden(p) for p in policies or ())):
        hidden = STEP.hidden.index_select(0, STEP.target_indices.to(STEP.hidden.device).long())
    constrained = constrained_rows(sampling_metadata, b, target_logits.shape[1])  # refused by spectune's engines
    if constrained and any(constrained) and req_ids is not None:  # a real step, not vLLM's profiling run: warn
        _warn_once("top-p/top-k requests under a spectune rule", "rules read the full distribution; vLLM applies "
                   "top-p/top-k to the bonus token only (counted per request: top_p_top_k_steps)", fallback=False)
    temps = step_temperatures(sampling_metadata, b)
    model, vocab = STEP.model, target_logits.shape[1]
    tracer = None
    if os.environ.get(TRACE_DIR_ENV):
        units = [0]

        def tracer(used, reason, t, gen_seed, rows, req, n_req, group_draft, group_hidden, weight, bias, tokens,
                   group_ids=None, row_keys=None):
            units[0] += 1
            members = req.tolist()
            spec = own[members[0]].spec if own is not None and own[members[0]] is not None else active.spec
            # the drafts the rule saw (the drafter's placeholders as -1)
            ids = draft_token_ids.index_select(0, rows) if group_ids is None else group_ids.to(draft_token_ids.dtype)
            _trace(active, spec, units[0], used, reason, t, gen_seed, ids, rows, n_req, target_logits,
                   group_draft, group_hidden, weight, bias, bonus_token_ids.reshape(b, -1)[:, 0].index_select(0, req),
                   tokens, None if req_ids is None else [req_ids[i] for i in members], row_keys)
    outcome = decide_step(
        policy, draft_token_ids=draft_token_ids, num_draft_tokens=num_draft_tokens, max_spec_len=max_spec_len,
        target_logits=target_logits, bonus_token_ids=bonus_token_ids, temperatures=temps, draft_logits=draft_logits,
        target_hidden=hidden, lm_head=None if model is None else (lambda: _lm_head(model, vocab, STEP.mask_from)),
        seed=int(active.spec.get("seed", 0)), step=active.calls, trace=tracer, policies=policies, keys=keys,
        request_seeds=request_seeds, skipped=STEP.skipped if STEP.skipped is not None and len(STEP.skipped) >= b
        else None, greedy_drafts=STEP.draft_scaled and STEP.greedy_drafts, draft_scaled=STEP.draft_scaled)
    try:
        digests = [active.digest if keys is None or keys[i] is None else keys[i] for i in range(b)]
        LEDGER.record(req_ids, num_draft_tokens, outcome.fallback, digests, constrained)
        RULE.report(active)
    except Exception as err:  # noqa: BLE001 - bookkeeping must not take the engine down either
        _warn_once(f"bookkeeping failed ({type(err).__name__})", str(err))
    return outcome.output_token_ids


def _trace(active: _Active, spec: dict[str, Any], unit: int, used: Any, reason: str | None, t: float, gen_seed: int,
           draft_ids, rows, n_req, target_logits, group_draft, group_hidden, weight, bias, bonus, output,
           req_ids, row_keys=None) -> None:
    trace_dir = os.environ.get(TRACE_DIR_ENV)
    if not trace_dir:
        return
    sel = (lambda x: None if x is None else x.index_select(0, rows).cpu())  # noqa: E731
    record = {"spec": spec, "call": active.calls, "temperature": t, "generator_seed": gen_seed,
              "row_keys": None if row_keys is None else list(row_keys),  # per-request streams, when drawn from
              "decided_by": used.name, "fallback": reason, "req_ids": req_ids,
              "draft_token_ids": draft_ids.cpu(), "num_draft_tokens": n_req.cpu(), "target_logits": sel(target_logits),
              "draft_logits": None if group_draft is None else group_draft.cpu(),
              "target_hidden": None if group_hidden is None else group_hidden.cpu(),
              "lm_head_weight": None if weight is None else weight.cpu(),
              "lm_head_bias": None if bias is None else bias.cpu(),
              "bonus_token_ids": bonus.cpu(), "output_token_ids": output.cpu(),
              "draft_scaled": bool(STEP.draft_scaled)}
    Path(trace_dir).mkdir(parents=True, exist_ok=True)
    torch.save(record, Path(trace_dir) / f"{os.getpid()}-{active.calls:06d}-{t:g}-{unit:04d}.pt")


def _read_request_rules(runner: Any, req_ids: list[str]) -> None:
    """Once per step: each request's own rule, seed and position (``STEP.rules`` None when no request
    of the step carries a rule: the common case costs one dict lookup per request)."""
    rules: list[Any] = []
    seeds: list[int] = []
    positions: list[int] = []
    any_rule = False
    for rid in req_ids:
        state = runner.requests.get(rid)
        sp = getattr(state, "sampling_params", None)
        spec = rule_spec_of(sp)
        rules.append(None if spec is None else REQUEST_RULES.for_request(rid, spec, len(req_ids)))
        any_rule = any_rule or spec is not None
        seeds.append(request_seed(rid, getattr(sp, "seed", None), float(getattr(sp, "temperature", 0.0) or 0.0)))
        positions.append(int(getattr(state, "num_computed_tokens", 0) or 0))
    STEP.rules, STEP.request_seeds, STEP.positions = (rules, seeds, positions) if any_rule else (None, None, None)


class WorkerExtension:
    """Methods vLLM adds to its worker class (``LLM(worker_extension_cls=...)``), reached from the front
    end with ``llm.collective_rpc(name)``: the plugin's per-request records live in the worker process."""

    def spectune_take_fallbacks(self, request_ids: list[str] | None = None) -> dict[str, Any]:
        """Per-request lossless-fallback counts since the last call (then cleared; only ``request_ids``'
        when given), and the totals."""
        return LEDGER.take(request_ids)

    def spectune_env(self) -> dict[str, Any]:
        """What the worker process runs with: its thread binding, CPUs, OpenMP threads, step timeout; and
        what it did: TP broadcasts, rule-file reads, steps that asked for the rule, blocks decided by the fused
        kernel (policies.fused)."""
        return {"pid": os.getpid(), "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
                "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": os.environ.get("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"),
                "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
                "affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
                "torch_threads": torch.get_num_threads(), "tp_broadcasts": TP_AGREEMENT["broadcasts"],
                "rule_file_reads": RULE.file_reads, "rule_lookups": RULE.lookups, "fused_calls": fused.CALLS["fused"],
                "fused_failure": fused.failure(),
                # on a GPU: what this worker's allocator reserved at its peak (the memory plan's check), else None
                "cuda_max_reserved_bytes": int(torch.cuda.max_memory_reserved()) if torch.cuda.is_available() else None}


def register() -> None:
    """``vllm.general_plugins`` entry point: patch vLLM once per process; a rule pins the V1 runner (gates)."""
    global _patched
    from workers.host_memory import keep_freed_memory
    from workers.vllm import gates
    from workers.vllm.orphans import watch_parent

    watch_parent()
    gates.require_v1_runner()  # 0.33's V2 default runner bypasses every patch
    keep_freed_memory()  # every vLLM process: the rules' full-vocabulary temporaries reuse the heap
    with _lock:
        if _patched:
            return
        if gates.refuse_unsupported():
            _patched = True
            return
        import vllm.v1.sample.rejection_sampler as rs
        from vllm.config.speculative import SpeculativeConfig
        from vllm.v1.spec_decode.draft_model import DraftModelProposer
        from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        orig_reject = rs.rejection_sample
        orig_constraints = rs.apply_sampling_constraints
        orig_draft = SpecDecodeBaseProposer._sample_draft_tokens
        orig_sample_tokens = GPUModelRunner.sample_tokens
        orig_verify_vocab = SpeculativeConfig.verify_equal_vocab_size_if_draft_model
        orig_fits = getattr(GPUModelRunner, "_input_fits_in_drafter", None)
        orig_get_draft_model = DraftModelProposer._get_model

        def verify_equal_vocab_size_if_draft_model(self):
            if padded_draft_width(self):
                return None  # a narrower draft spectune's engine asked for: padded below
            return orig_verify_vocab(self)

        def _get_draft_model(self):
            model = orig_get_draft_model(self)
            width = padded_draft_width(self.speculative_config)
            self._spectune_draft_width = width
            if width:
                model.compute_logits = _PaddedLogits(model.compute_logits,
                                                     self.speculative_config.target_model_config.get_vocab_size())
            return model

        def rejection_sample(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                             target_logits, bonus_token_ids, sampling_metadata, *args, **kwargs):
            active = _rule_now()
            if active is None or active.policy is None:
                if active is not None:
                    RULE.report(active)
                if STEP.draft_scaled and draft_probs is not None and not sampling_metadata.all_greedy:
                    # drafted under a rule (the proposer patch's scaled logits), verified by vLLM's own: its q,
                    # or none where the drafts were argmax ones at T > 0 (q one-hot: still lossless)
                    draft_probs = None if STEP.greedy_drafts else draft_probs.float().softmax(dim=-1)
                output = orig_reject(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens,
                                     draft_probs, target_logits, bonus_token_ids, sampling_metadata, *args, **kwargs)
                return agree_across_ranks(output, _tp_group())
            try:
                output = apply_rule(active, draft_token_ids, list(num_draft_tokens), int(max_spec_len), draft_probs,
                                    target_logits, bonus_token_ids, sampling_metadata)
            except Exception as err:  # noqa: BLE001 - never a dead engine
                try:
                    output = _lossless_everywhere(f"plugin error ({type(err).__name__})", str(err), draft_token_ids,
                                                  list(num_draft_tokens), int(max_spec_len), target_logits,
                                                  bonus_token_ids, sampling_metadata, req_ids=STEP.req_ids,
                                                  skipped=STEP.skipped, step=active.calls)
                except Exception as err2:  # noqa: BLE001 - even that failed (out of memory?): vLLM's own, q one-hot
                    _warn_once(f"the lossless fallback failed too ({type(err2).__name__})", str(err2))
                    output = orig_reject(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, None,
                                         target_logits, bonus_token_ids, sampling_metadata, *args, **kwargs)
            # every TP rank calls this, whatever its rule file read said: one collective per step, rank 0's tokens
            return agree_across_ranks(output, _tp_group())

        def apply_sampling_constraints(logits, *args, **kwargs):
            active = _rule_now()
            if active is not None and active.policy is not None:
                return logits  # rules read raw logits and apply the temperature themselves
            return orig_constraints(logits, *args, **kwargs)

        def _sample_draft_tokens(self, hidden_states, sampling_metadata):
            # decided once per propose (K calls; vLLM stacks what they return): every call of it returns the
            # same kind, vLLM's own (tokens, its probs or None) or the rules' (tokens, scaled logits)
            if _drafts.first_call_of_propose(self):
                active = _rule_now()
                own = active is None or active.policy is None or (sampling_metadata.all_greedy
                                                                  and not _step_needs_q(active))
                if not own and getattr(self, "use_heterogeneous_vocab", False):
                    # never raise inside the worker: vLLM drafts as usual and spectune's rules see no
                    # draft distribution, so rules that need one fall back to lossless (counted per step)
                    _warn_once("draft and target vocabularies differ: no draft distribution for spectune's rules",
                               "use_heterogeneous_vocab", fallback=False)
                    own = True
                self._spectune_mode = "vllm" if own else "rules"
            if self._spectune_mode == "failed":  # an earlier call of this propose failed before any distribution
                return _drafts.failed_draft(self, hidden_states, None, STEP)
            if self._spectune_mode == "vllm":
                # vLLM's own drafting: its rule, or greedy steps whose rules never read q (lossless, top-k):
                # no full-vocabulary log-softmax and cached distribution per draft token
                STEP.draft_scaled = STEP.greedy_drafts = False  # whatever reaches the sampler is vLLM's own q
                return orig_draft(self, hidden_states, sampling_metadata)
            logits = None
            try:
                logits = self.model.compute_logits(hidden_states)
                return _drafts.drafts_for_rules(self, logits, sampling_metadata, STEP)
            except Exception as err:  # noqa: BLE001 - never a dead engine
                # this propose's drafts cannot be judged: the next verify step treats them as placeholders (every
                # rule rejects them, the target's token is emitted, counted per request); the return keeps the
                # propose's kind. No second compute_logits where the first ran: under TP it is a collective.
                _warn_once(f"drafting for spectune's rules failed ({type(err).__name__})", str(err))
                return _drafts.failed_draft(self, hidden_states, logits, STEP)

        def _input_fits_in_drafter(self, *args, **kwargs):
            fits = orig_fits(self, *args, **kwargs)
            try:
                note_drafter(self, bool(fits))
            except Exception as err:  # noqa: BLE001 - bookkeeping only
                _warn_once(f"drafter bookkeeping failed ({type(err).__name__})", str(err), fallback=False)
            return fits

        def sample_tokens(self, grammar_output):
            state = self.execute_model_state
            # read once per step, by rank 0 alone under TP, and shared; never in a target-only engine (no
            # drafts to judge: no rule file read, no broadcast per step)
            speculative = getattr(self, "speculative_config", None) is not None
            active = RULE.shared(_tp_group()) if speculative else None
            if speculative and (active is None or active.policy is None) and carries_rules(
                    self, self.input_batch.req_ids):
                active = implicit_rule()  # no rule file or vLLM's own: a request's own rule still decides it
            STEP.active, STEP.snapshot = active, True
            mask = getattr(self, "_spectune_mask_from", None)
            if mask is None:
                mask = self._spectune_mask_from = mask_from(self.model_config)
            STEP.mask_from = mask
            if getattr(getattr(self, "drafter", None), "_spectune_failed", False):  # the last propose failed: its
                self.drafter._spectune_failed = False  # drafts are judged by no rule, as placeholders are
                note_drafter(self, False)
            if mask and state is not None and state.logits is not None:
                # a padded draft's missing ids: never the target's either, in every engine and every path
                # (vLLM's sampler, bonus tokens, the rule's target logits), as on the CPU engine
                state.logits[..., mask:] = float("-inf")
            if state is not None and active is not None and active.policy is not None:
                meta = state.spec_decode_metadata
                STEP.hidden = state.sample_hidden_states
                STEP.target_indices = None if meta is None else meta.target_logits_indices
                STEP.model = self.model
                STEP.req_ids = list(self.input_batch.req_ids)
                host_temps = getattr(self.input_batch, "temperature_cpu", None)
                STEP.temps_cpu = None if host_temps is None else [float(t) for t in host_temps[:len(STEP.req_ids)]]
                skipped = getattr(self, "_spectune_skipped", None)  # drafts of this step the drafter never made
                STEP.skipped = [rid in skipped for rid in STEP.req_ids] if skipped else None
                try:
                    _read_request_rules(self, STEP.req_ids)
                except Exception as err:  # noqa: BLE001 - the rule file's rule decides instead
                    STEP.rules = None
                    _warn_once(f"per-request rules unreadable ({type(err).__name__})", str(err))
                if not getattr(self, "_spectune_head_ready", False) and needs_head(
                        [active.policy, *(r.policy for r in STEP.rules or () if r is not None)]):
                    # under TP the LM head is gathered here by every rank alike (rank 0's rule, the same requests)
                    # at the first step whose rules need it: never inside a rule, where one rank could be alone
                    gather_head_under_tp(self.model, self.model_config.get_vocab_size(), mask, _tp_group())
                    self._spectune_head_ready = True
            try:
                return orig_sample_tokens(self, grammar_output)
            finally:
                STEP.hidden = STEP.target_indices = STEP.model = STEP.req_ids = None
                STEP.rules = STEP.request_seeds = STEP.positions = STEP.skipped = STEP.temps_cpu = None
                STEP.active, STEP.snapshot, STEP.mask_from = None, False, 0

        rs.rejection_sample = rejection_sample
        rs.apply_sampling_constraints = apply_sampling_constraints
        SpecDecodeBaseProposer._sample_draft_tokens = _sample_draft_tokens
        GPUModelRunner.sample_tokens = sample_tokens
        if orig_fits is not None:
            GPUModelRunner._input_fits_in_drafter = _input_fits_in_drafter
        else:
            _warn_once("vLLM's runner has no _input_fits_in_drafter", "drafts vLLM fills with placeholders when it "
                       "skips the drafter cannot be told apart", fallback=False)
        SpeculativeConfig.verify_equal_vocab_size_if_draft_model = verify_equal_vocab_size_if_draft_model
        DraftModelProposer._get_model = _get_draft_model
        _patched = True
    from workers.vllm.faults import install

    install(sys.modules[__name__])  # tests only (SPECTUNE_VLLM_TEST_FAULTS set): fault hooks around the patched functions
