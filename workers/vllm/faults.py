"""Test-only fault injection for the vLLM plugin: the failures a batched engine meets, on demand.

``SPECTUNE_VLLM_TEST_FAULTS`` names a JSON file the plugin re-reads when it changes (unset, always
outside tests: one env read per step). The tests use it to reproduce vLLM's own "missing cached draft
probabilities" path, a rule that raises, missing hidden states, and a worker that stalls — the step
that runs past vLLM's step timeout, or the moment a test kills a worker or the engine core.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

FAULTS_ENV = "SPECTUNE_VLLM_TEST_FAULTS"


class _Faults:
    """Test-only fault injection (``SPECTUNE_VLLM_TEST_FAULTS`` names a JSON file, re-read when it
    changes): ``{"drop_draft_probs_every": n}`` makes vLLM itself lose a request's cached draft
    probabilities on every n-th step with drafts (vLLM then logs "Missing cached draft probabilities
    ... falling back to legacy speculative rejection behavior" and passes ``draft_probs=None``, as it
    does in batched runs); ``drop_hidden_every`` withholds DropMatch's hidden states;
    ``raise_every`` makes the rule raise; ``fail_draft_call`` makes drafting for the rules raise in that call
    (0-based) of every propose; ``{"stall_s": s, "stall_times": k}`` makes the worker sleep s
    seconds in a speculative step, k times in all across the engine's processes and their
    replacements (each stall appends ``pid ppid`` to ``<file>.stalled`` first, so a test knows when
    and whom to kill; delete that file with the spec). Unset (always, outside tests): no cost beyond
    one env read."""

    def __init__(self) -> None:
        self.stamp: tuple[int, int] | None = None
        self.spec: dict[str, int] = {}
        self.steps = 0

    def current(self) -> dict[str, int]:
        path = os.environ.get(FAULTS_ENV)
        if not path:
            return {}
        try:
            st = os.stat(path)
        except OSError:
            self.stamp, self.spec = None, {}
            return {}
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp != self.stamp:
            try:
                self.spec = {k: int(v) for k, v in json.loads(Path(path).read_text()).items()}
            except (OSError, ValueError, AttributeError):
                self.spec = {}
            self.stamp, self.steps = stamp, 0
        return self.spec

    def hit(self, name: str) -> bool:
        every = self.current().get(name, 0)
        return every > 0 and self.steps % every == every - 1

    def stall(self) -> None:
        """Sleep ``stall_s`` if the spec asks for more stalls than ``<file>.stalled`` records."""
        spec = self.current()
        seconds = spec.get("stall_s", 0)
        if seconds <= 0:
            return
        log = Path(f"{os.environ[FAULTS_ENV]}.stalled")
        try:
            done = len(log.read_text().splitlines()) if log.exists() else 0
            if done >= spec.get("stall_times", 1):
                return
            with log.open("a") as f:
                f.write(f"{os.getpid()} {os.getppid()}\n")
        except OSError:
            return
        time.sleep(seconds)


FAULTS = _Faults()


class _FaultyRule:
    """A rule that raises (fault injection for the guard)."""

    name = "faulty"

    def __init__(self, policy: Any) -> None:
        self.config = policy.config

    def decide(self, batch: Any) -> Any:
        raise RuntimeError("injected fault (SPECTUNE_VLLM_TEST_FAULTS raise_every)")


def install(plugin: Any) -> bool:
    """Wrap the plugin's patched vLLM functions with the fault hooks, only when ``SPECTUNE_VLLM_TEST_FAULTS``
    is set in this process (tests); the production patch (:mod:`workers.vllm.plugin`, handed in as ``plugin``:
    this module never imports it) carries no fault code. Called by ``register()`` after it patched;
    idempotent. Returns whether the hooks are in place."""
    if not os.environ.get(FAULTS_ENV):
        return False
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(GPUModelRunner, "_spectune_faults", False):
        return True
    from workers.vllm import drafts

    apply_rule = plugin.apply_rule
    rules_drafts = drafts.drafts_for_rules
    draft_probs = GPUModelRunner._get_spec_decode_draft_probs

    def faulty_drafts_for_rules(proposer: Any, *args: Any, **kwargs: Any) -> Any:
        call = FAULTS.current().get("fail_draft_call")  # the call of each propose (0-based) that fails
        if call is not None and int(getattr(proposer, "_spectune_call", 0)) == call + 1:
            raise RuntimeError(f"injected drafting failure in call {call} of a propose")
        return rules_drafts(proposer, *args, **kwargs)

    sample_tokens = GPUModelRunner.sample_tokens

    def faulty_apply_rule(active: Any, *args: Any, policy: Any = None, **kwargs: Any) -> Any:
        if policy is None and FAULTS.hit("raise_every"):
            policy = _FaultyRule(active.policy)  # the rule raises: the plugin's guard decides losslessly
        if not FAULTS.hit("drop_hidden_every"):
            return apply_rule(active, *args, policy=policy, **kwargs)
        hidden, plugin.STEP.hidden = plugin.STEP.hidden, None  # DropMatch's hidden states withheld this step
        try:
            return apply_rule(active, *args, policy=policy, **kwargs)
        finally:
            plugin.STEP.hidden = hidden

    def _get_spec_decode_draft_probs(self: Any, spec_decode_metadata: Any) -> Any:
        cached = self._draft_prob_req_ids
        if (FAULTS.hit("drop_draft_probs_every") and cached is not None
                and any(spec_decode_metadata.num_draft_tokens)):
            # vLLM's own "missing cached draft probabilities" path: hide one drafted request's row
            victim = next(r for r, n in zip(self.input_batch.req_ids, spec_decode_metadata.num_draft_tokens,
                                            strict=False) if n)
            self._draft_prob_req_ids = [None if r == victim else r for r in cached]
            try:
                return draft_probs(self, spec_decode_metadata)
            finally:
                self._draft_prob_req_ids = cached
        return draft_probs(self, spec_decode_metadata)

    def faulty_sample_tokens(self: Any, grammar_output: Any) -> Any:
        state = self.execute_model_state
        speculative = state is not None and state.spec_decode_metadata is not None
        if speculative:
            FAULTS.stall()  # a step past vLLM's step timeout, or a worker about to be killed
        try:
            return sample_tokens(self, grammar_output)
        finally:
            if speculative and FAULTS.current():
                FAULTS.steps += 1

    plugin.apply_rule = faulty_apply_rule
    drafts.drafts_for_rules = faulty_drafts_for_rules
    GPUModelRunner._get_spec_decode_draft_probs = _get_spec_decode_draft_probs
    GPUModelRunner.sample_tokens = faulty_sample_tokens
    GPUModelRunner._spectune_faults = True
    return True
