"""spectune's acceptance rules inside vLLM's verification: the ``vllm.general_plugins`` entry point.

``pyproject.toml`` declares ``spectune_rules = "workers.vllm_plugin:register"``; vLLM calls
:func:`register` in every process it starts (front end, engine core, each TP worker), possibly more
than once, so it patches idempotently. Installing spectune changes nothing by itself: a rule runs
only in processes whose environment names a rule file (``SPECTUNE_VLLM_RULE_FILE``, written by
:class:`workers.vllm_engine.VLLMDecoder`), and the file is re-read when it changes, so one vLLM
engine serves trial after trial with different rules.

What is patched (vLLM V1 model runner, which also runs ``draft_model`` speculation on 0.32/0.33 and
is the runner vLLM-CPU subclasses):

- ``vllm.v1.sample.rejection_sampler.rejection_sample`` -> :func:`policies.ragged.verify_flat` over
  the step's flat ``[num_tokens, V]`` rows (vectorised; one call per distinct temperature). Its
  output keeps vLLM's contract: accepted draft tokens verbatim, then one token, ``-1`` after.
- ``apply_sampling_constraints`` -> identity while a rule is active: rules take raw logits and the
  temperature themselves (this also sidesteps vLLM-CPU's broken T > 0 expansion of per-request
  temperatures). Top-k/top-p/penalties are refused by the engine instead.
- ``SpecDecodeBaseProposer._sample_draft_tokens`` also returns the draft's full T = 1
  log-distribution (greedy drafting returns none in vLLM), which reaches the rule through vLLM's
  own per-request draft-probs plumbing.
- ``GPUModelRunner.sample_tokens`` keeps the step's ``sample_hidden_states`` (final-norm outputs,
  rows aligned with the logits) and the target model for DropMatch's dropout heads: no second
  forward.

Each process that applies a rule writes ``<rule file>.seen.<pid>.json`` (rule digest and call count)
so the engine can assert that the rule it asked for is the one running — a plugin that did not
load is an error there, never a silent fallback to vLLM's rule. ``SPECTUNE_VLLM_TRACE_DIR`` (tests)
saves every call's inputs and outputs.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

RULE_FILE_ENV = "SPECTUNE_VLLM_RULE_FILE"
NATIVE = "vllm-native"  # a rule file naming this hands verification back to vLLM's own sampler (A/B runs)
TRACE_DIR_ENV = "SPECTUNE_VLLM_TRACE_DIR"
ENTRY_POINT = "spectune_rules"

_lock = threading.Lock()
_patched = False


def rule_digest(spec: dict[str, Any]) -> str:
    return hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def write_rule(path: str | os.PathLike[str], policy: str, params: dict[str, Any], seed: int = 0) -> str:
    """Atomically write the rule file the plugin reads; returns the rule's digest."""
    from policies import make_policy

    if policy != NATIVE:
        make_policy(policy, **params)  # validate here, where the error reaches the user
    spec = {"policy": policy, "params": params, "seed": int(seed)}
    path = Path(path)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(spec, sort_keys=True))
    tmp.replace(path)
    return rule_digest(spec)


def seen_rules(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """What the plugin reported applying, one entry per vLLM process that ran a rule."""
    path = Path(path)
    out = []
    for f in sorted(path.parent.glob(f"{path.name}.seen.*.json")):
        try:
            out.append(json.loads(f.read_text()))
        except (OSError, json.JSONDecodeError):
            continue  # being rewritten; the next read sees it
    return out


@dataclass
class _Active:
    policy: Any
    spec: dict[str, Any]
    digest: str
    stamp: tuple[int, int]
    calls: int = 0


class _RuleState:
    """The rule named by this process's rule file, re-read when the file changes."""

    def __init__(self) -> None:
        self.active: _Active | None = None

    def current(self) -> _Active | None:
        path = os.environ.get(RULE_FILE_ENV)
        if not path:
            return None
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise RuntimeError(f"spectune vLLM plugin: {RULE_FILE_ENV}={path} does not exist") from None
        stamp = (st.st_mtime_ns, st.st_size)
        if self.active is None or self.active.stamp != stamp:
            from policies import make_policy

            spec = json.loads(Path(path).read_text())
            policy = None if spec["policy"] == NATIVE else make_policy(spec["policy"], **spec.get("params", {}))
            self.active = _Active(policy, spec, rule_digest(spec), stamp)
        return self.active

    def report(self, active: _Active) -> None:
        active.calls += 1
        if active.calls in (1, 10, 100) or active.calls % 1000 == 0:
            path = Path(os.environ[RULE_FILE_ENV])
            seen = path.parent / f"{path.name}.seen.{os.getpid()}.json"
            tmp = seen.with_suffix(".tmp")
            tmp.write_text(json.dumps({"pid": os.getpid(), "digest": active.digest, "calls": active.calls,
                                       **active.spec}))
            tmp.replace(seen)


RULE = _RuleState()


class _Step(threading.local):
    """Per-step state handed from ``sample_tokens`` to the rejection sampler."""

    hidden: torch.Tensor | None = None  # [num_logits, d] final hidden states, rows aligned with logits
    target_indices: torch.Tensor | None = None  # rows of ``hidden`` at the draft positions
    model: Any = None
    draft_logprobs: bool = False  # the proposer patch produced T = 1 log-probs this process


STEP = _Step()


def _lm_head(model: Any, vocab: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The target's LM head as [V, d] (+ bias). Under tensor parallelism each rank holds a vocabulary
    shard: the full head is all-gathered once (every rank verifies the same step, so every rank joins
    the collective) and kept on the model (V x d per rank, ~0.5 GB for a 1.5B bf16 target)."""
    cached = getattr(model, "_spectune_lm_head", None)
    if cached is not None:
        return cached
    head = getattr(model, "lm_head", None)
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise RuntimeError("spectune vLLM plugin: the target model has no plain lm_head.weight tensor "
                           "(quantized head?); DropMatch cannot build its dropout heads")
    bias = getattr(head, "bias", None)
    bias = bias if isinstance(bias, torch.Tensor) else None
    if weight.shape[0] < vocab:  # a tensor-parallel shard of the (padded) vocabulary
        from vllm.distributed import tensor_model_parallel_all_gather

        weight = tensor_model_parallel_all_gather(weight.contiguous(), dim=0)
        bias = None if bias is None else tensor_model_parallel_all_gather(bias.contiguous(), dim=0)
        if weight.shape[0] < vocab:
            raise RuntimeError(f"spectune vLLM plugin: the gathered lm_head has {weight.shape[0]} of {vocab} rows")
    result = (weight[:vocab], None if bias is None else bias[:vocab])
    model._spectune_lm_head = result
    return result


def _needs_hidden(policy: Any) -> bool:
    from policies.any_of import AnyOfConfig

    cfg = policy.config
    if isinstance(cfg, AnyOfConfig):
        return any(member.name == "dropmatch" for member in cfg.members)
    return policy.name == "dropmatch"


def apply_rule(active: _Active, draft_token_ids: torch.Tensor, num_draft_tokens: list[int], max_spec_len: int,
               draft_probs: torch.Tensor | None, target_logits: torch.Tensor, bonus_token_ids: torch.Tensor,
               sampling_metadata: Any) -> torch.Tensor:
    """vLLM's ``rejection_sample`` contract, decided by a spectune rule: [B, max_spec_len + 1] int32."""
    from policies.ragged import verify_flat

    device = target_logits.device
    b = len(num_draft_tokens)
    num = torch.tensor(num_draft_tokens, dtype=torch.long, device=device)
    if draft_probs is None:
        draft_logits = None
    elif STEP.draft_logprobs:
        draft_logits = draft_probs  # T = 1 log-probs from the proposer patch
    else:  # vLLM's own probabilistic drafts: q at the request temperature; rules renormalize logs
        draft_logits = torch.log(draft_probs.float())
    hidden = weight = bias = None
    if _needs_hidden(active.policy):
        if STEP.hidden is None or STEP.model is None or STEP.target_indices is None:
            raise RuntimeError("spectune vLLM plugin: DropMatch needs the target's hidden states, but "
                               "GPUModelRunner.sample_tokens did not hand them over (unsupported runner?)")
        hidden = STEP.hidden.index_select(0, STEP.target_indices.to(STEP.hidden.device).long())
        weight, bias = _lm_head(STEP.model, target_logits.shape[1])
    bonus = bonus_token_ids.reshape(b, -1)[:, 0]
    if sampling_metadata.all_greedy or sampling_metadata.temperature is None:
        temps = torch.zeros(b, device=device)
    else:
        temps = sampling_metadata.temperature.float().clamp(min=0.0)[:b]
    seed = int(active.spec.get("seed", 0))
    out = torch.full((b, max_spec_len + 1), -1, dtype=torch.int32, device=device)
    start = torch.cumsum(num, 0) - num
    for t in sorted(set(temps.tolist())):  # one vectorised call per distinct temperature
        req = (temps == t).nonzero().squeeze(1)
        n_req = num.index_select(0, req)
        rows = (start.index_select(0, req).unsqueeze(1) + torch.arange(max(max_spec_len, 1), device=device))
        rows = rows[torch.arange(rows.shape[1], device=device).unsqueeze(0) < n_req.unsqueeze(1)]
        gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + active.calls)
        result = verify_flat(
            active.policy,
            draft_token_ids=draft_token_ids.index_select(0, rows).long(),
            num_draft_tokens=n_req,
            target_logits=target_logits.index_select(0, rows),
            bonus_token_ids=bonus.index_select(0, req),
            draft_logits=None if draft_logits is None else draft_logits.index_select(0, rows),
            target_hidden=None if hidden is None else hidden.index_select(0, rows),
            lm_head_weight=weight, lm_head_bias=bias, temperature=float(t), generator=gen,
        )
        width = result.output_token_ids.shape[1]
        out[req, :width] = result.output_token_ids.to(torch.int32)
        _trace(active, t, draft_token_ids, rows, n_req, target_logits, draft_logits, hidden, weight, bias,
               bonus.index_select(0, req), result.output_token_ids)
    RULE.report(active)
    return out


def _trace(active: _Active, t: float, draft_ids, rows, n_req, target_logits, draft_logits, hidden, weight, bias,
           bonus, output) -> None:
    trace_dir = os.environ.get(TRACE_DIR_ENV)
    if not trace_dir:
        return
    sel = (lambda x: None if x is None else x.index_select(0, rows).cpu())  # noqa: E731
    record = {"spec": active.spec, "call": active.calls, "temperature": t,
              "generator_seed": int(active.spec.get("seed", 0)) * 1_000_003 + active.calls,
              "draft_token_ids": sel(draft_ids), "num_draft_tokens": n_req.cpu(), "target_logits": sel(target_logits),
              "draft_logits": sel(draft_logits), "target_hidden": sel(hidden),
              "lm_head_weight": None if weight is None else weight.cpu(),
              "lm_head_bias": None if bias is None else bias.cpu(),
              "bonus_token_ids": bonus.cpu(), "output_token_ids": output.cpu()}
    Path(trace_dir).mkdir(parents=True, exist_ok=True)
    torch.save(record, Path(trace_dir) / f"{os.getpid()}-{active.calls:06d}-{t:g}.pt")


def register() -> None:
    """The ``vllm.general_plugins`` entry point: patch vLLM once per process."""
    global _patched
    with _lock:
        if _patched:
            return
        import vllm.v1.sample.rejection_sampler as rs
        from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        orig_reject = rs.rejection_sample
        orig_constraints = rs.apply_sampling_constraints
        orig_draft = SpecDecodeBaseProposer._sample_draft_tokens
        orig_sample_tokens = GPUModelRunner.sample_tokens

        def rejection_sample(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                             target_logits, bonus_token_ids, sampling_metadata, *args, **kwargs):
            active = RULE.current()
            if active is None or active.policy is None:
                if active is not None:
                    RULE.report(active)
                return orig_reject(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens,
                                   draft_probs, target_logits, bonus_token_ids, sampling_metadata, *args, **kwargs)
            return apply_rule(active, draft_token_ids, list(num_draft_tokens), int(max_spec_len), draft_probs,
                              target_logits, bonus_token_ids, sampling_metadata)

        def apply_sampling_constraints(logits, *args, **kwargs):
            active = RULE.current()
            if active is not None and active.policy is not None:
                return logits  # rules read raw logits and apply the temperature themselves
            return orig_constraints(logits, *args, **kwargs)

        def _sample_draft_tokens(self, hidden_states, sampling_metadata):
            active = RULE.current()
            if active is None or active.policy is None:
                STEP.draft_logprobs = False  # whatever reaches the sampler now is vLLM's own q
                return orig_draft(self, hidden_states, sampling_metadata)
            if getattr(self, "use_heterogeneous_vocab", False):
                raise RuntimeError("spectune rules need a draft and target that share one vocabulary")
            logits = self.model.compute_logits(hidden_states)
            # T = 1 log-probs first: vLLM's draft sampler divides the logits by T in place
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            if sampling_metadata.all_greedy or not getattr(self, "_enable_probabilistic_draft_probs", False):
                tokens = logits.argmax(dim=-1)
            else:
                tokens, _ = self._sample_from_logits(logits, sampling_metadata)
            STEP.draft_logprobs = True
            return tokens, logprobs

        def sample_tokens(self, grammar_output):
            state = self.execute_model_state
            active = RULE.current()
            if state is not None and active is not None and active.policy is not None:
                meta = state.spec_decode_metadata
                STEP.hidden = state.sample_hidden_states
                STEP.target_indices = None if meta is None else meta.target_logits_indices
                STEP.model = self.model
            try:
                return orig_sample_tokens(self, grammar_output)
            finally:
                STEP.hidden = STEP.target_indices = STEP.model = None

        rs.rejection_sample = rejection_sample
        rs.apply_sampling_constraints = apply_sampling_constraints
        SpecDecodeBaseProposer._sample_draft_tokens = _sample_draft_tokens
        GPUModelRunner.sample_tokens = sample_tokens
        _patched = True
