"""The vLLM engine: the same interface and per-generation stats as :class:`workers.engine.SpecDecoder`,
with vLLM's ``draft_model`` speculation and spectune's rule deciding inside vLLM's verification.

One engine hosts one pair. vLLM fixes the draft length when it starts, so a generation must ask for
that length. The rule can change between generations: the engine writes the rule file that the
``workers.vllm_plugin`` plugin reads in every vLLM process, then checks from the plugin's report that
this rule — not vLLM's own — decided the generation. Target-only decoding (the references) runs a
second vLLM engine without speculation, started on first use.

Stats come from vLLM's ``spec_decode`` counters (``LLM.get_metrics()``, differenced around each
generation) mapped onto spectune's names; times from vLLM's request timestamps.

What vLLM cannot do here, the engine refuses with a message: ``trace`` (per-round logits), draft
lengths other than the one it started with. ``on_tokens`` is called once, with all tokens (the offline
API does not stream; an abort cannot stop a generation part-way). Under tensor parallelism DropMatch
all-gathers the target's sharded LM head once per worker (not exercised on this CPU-only machine).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from policies import Policy, make_policy
from workers.engine import check_request
from workers.stats import Generation, GenerationStats
from workers.vllm_plugin import ENTRY_POINT, NATIVE, RULE_FILE_ENV, rule_digest, seen_rules, write_rule

_METRICS = {  # vLLM counter -> GenerationStats field
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}
_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


class VLLMUnavailable(RuntimeError):
    """vLLM or spectune's plugin is missing, or vLLM is not running the rule spectune asked for."""


@dataclass(frozen=True)
class VLLMSettings:
    draft_len: int = 5
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.85  # on CPU builds: the fraction of RAM for the KV cache
    target_only_memory_utilization: float | None = None  # the reference engine; default: same
    max_model_len: int = 4096
    dtype: str = "bfloat16"
    enforce_eager: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if not (isinstance(self.draft_len, int) and 1 <= self.draft_len <= 32):
            raise ValueError(f"draft_len must be an integer in [1, 32], got {self.draft_len!r}")
        if not (isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1):
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}")
        for name in ("gpu_memory_utilization", "target_only_memory_utilization"):
            value = getattr(self, name)
            if value is not None and not 0.0 < value <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {value!r}")
        if self.max_model_len < 16:
            raise ValueError(f"max_model_len must be >= 16, got {self.max_model_len!r}")
        if self.dtype not in ("bfloat16", "float16", "float32", "auto"):
            raise ValueError(f"dtype must be bfloat16, float16, float32 or auto, got {self.dtype!r}")


@dataclass
class VLLMPair:
    """What callers read from ``engine.pair`` (no torch modules: vLLM holds the models)."""

    name: str
    tokenizer: Any
    dtype: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    cache_dir: Path | None
    draft_dir: Path
    target_dir: Path


def check_plugin_installed() -> None:
    """The entry point must be declared by an installed distribution and not filtered out."""
    found = [ep for ep in importlib.metadata.entry_points(group="vllm.general_plugins") if ep.name == ENTRY_POINT]
    if not found:
        raise VLLMUnavailable(
            f"spectune's vLLM plugin (entry point {ENTRY_POINT!r} in group vllm.general_plugins) is not installed "
            "in this environment: install spectune into it (`pip install --no-deps -e .`)")
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None and ENTRY_POINT not in [p.strip() for p in allowed.split(",")]:
        raise VLLMUnavailable(f"VLLM_PLUGINS={allowed!r} does not include {ENTRY_POINT!r}: vLLM would run its own "
                              "acceptance rule instead of spectune's")


class VLLMDecoder:
    """Speculative decoding in vLLM with any registered rule, plus target-only decoding."""

    def __init__(self, pair: str, settings: VLLMSettings | None = None, cache_dir: str | os.PathLike[str] | None = None
                 ) -> None:
        from workers.pair import eos_token_ids, pair_dirs

        self.settings = settings or VLLMSettings()
        check_plugin_installed()
        try:
            from vllm import LLM
        except ImportError as err:
            raise VLLMUnavailable(f"the vLLM engine needs vllm installed ({err})") from None
        draft_dir, target_dir, pair_cache = pair_dirs(pair, cache_dir)
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")  # draft_model speculation runs on V1
        self._rule_dir = tempfile.TemporaryDirectory(prefix="spectune-vllm-")
        self.rule_file = Path(self._rule_dir.name) / "rule.json"
        self._digest = write_rule(self.rule_file, "lossless", {}, self.settings.seed)
        # Set before vLLM starts: the engine-core and worker processes inherit it.
        os.environ[RULE_FILE_ENV] = str(self.rule_file)
        s = self.settings
        self.llm = LLM(
            model=str(target_dir), tokenizer=str(target_dir), dtype=s.dtype, seed=s.seed,
            tensor_parallel_size=s.tensor_parallel_size, gpu_memory_utilization=s.gpu_memory_utilization,
            max_model_len=s.max_model_len, enforce_eager=s.enforce_eager, disable_log_stats=False,
            # TP workers as child processes of this one (a Ray actor that owns its GPUs), not Ray tasks
            distributed_executor_backend="mp" if s.tensor_parallel_size > 1 else None,
            speculative_config={"method": "draft_model", "model": str(draft_dir),
                                "num_speculative_tokens": s.draft_len,
                                "draft_tensor_parallel_size": s.tensor_parallel_size,
                                "draft_sample_method": "probabilistic"},
        )
        self._reference: Any = None
        tok = self.llm.get_tokenizer()
        vocab = int(self.llm.llm_engine.model_config.get_vocab_size())
        self.pair = VLLMPair(pair, tok, s.dtype, vocab, eos_token_ids(tok, _declared_eos(target_dir)), pair_cache,
                             draft_dir, target_dir)
        self._assert_rule_runs()

    # -- public API (SpecDecoder's) ---------------------------------------------------------------

    def generate(self, prompt_ids: Any, policy: Policy | str = "lossless", draft_len: int = 5,
                 max_new_tokens: int = 256, temperature: float = 0.0, seed: int = 0,
                 stop: list[str] | tuple[str, ...] | None = None, trace: bool = False,
                 on_tokens: Any = None) -> Generation:
        """``policy="vllm-native"`` verifies with vLLM's own rejection sampler (A/B measurements)."""
        if isinstance(policy, str) and policy != NATIVE:
            policy = make_policy(policy)
        if draft_len != self.settings.draft_len:
            raise ValueError(f"this vLLM engine was started with draft length {self.settings.draft_len}; "
                             f"got {draft_len} (vLLM fixes num_speculative_tokens at start)")
        self._set_rule(policy)
        before = self._counters()
        gen = self._run(self.llm, prompt_ids, max_new_tokens, temperature, seed, stop, trace, on_tokens)
        after = self._counters()
        st = gen.stats
        st.draft_len = draft_len
        for field in _METRICS.values():
            setattr(st, field, int(after[field] - before[field]))
        per_pos = [int(a - b) for a, b in zip(after["per_pos"], before["per_pos"], strict=False)]
        st.accepted_per_position = (per_pos + [0] * draft_len)[:draft_len]
        st.target_forwards = st.num_drafts
        st.draft_forwards = st.num_draft_tokens
        if st.num_drafts and not any(r.get("digest") == self._digest for r in seen_rules(self.rule_file)):
            raise VLLMUnavailable(f"vLLM verified {st.num_drafts} drafts but spectune's rule {self._rule_name} never "
                                  "ran: the plugin is not active in vLLM's worker processes")
        return gen

    def autoregressive(self, prompt_ids: Any, max_new_tokens: int = 256, temperature: float = 0.0, seed: int = 0,
                       stop: list[str] | tuple[str, ...] | None = None, trace: bool = False,
                       on_tokens: Any = None) -> Generation:
        """Target-only decoding on a second vLLM engine without speculation (started on first use)."""
        if self._reference is None:
            from vllm import LLM

            s = self.settings
            self._reference = LLM(
                model=str(self.pair.target_dir), dtype=s.dtype, seed=s.seed, tensor_parallel_size=s.tensor_parallel_size,
                gpu_memory_utilization=s.target_only_memory_utilization or s.gpu_memory_utilization,
                max_model_len=s.max_model_len, enforce_eager=s.enforce_eager)
        gen = self._run(self._reference, prompt_ids, max_new_tokens, temperature, seed, stop, trace, on_tokens)
        gen.stats.num_drafts = gen.stats.target_forwards = gen.stats.num_generated
        return gen

    def close(self) -> None:
        """Stop vLLM's engine-core processes now (rather than at interpreter exit)."""
        for llm in (self.llm, self._reference):
            core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
            if core is not None:
                core.shutdown()
        self._reference = None

    def profile(self) -> dict[str, Any]:
        """vLLM does not expose draft/target step times separately: c must come from the caller."""
        return {"pair": self.pair.name, "cost_ratio": None, "verify_s": {}, "engine": "vllm"}

    # -- the pieces -----------------------------------------------------------------------------

    def _set_rule(self, policy: Policy | str) -> None:
        if policy == NATIVE:
            described: dict[str, Any] = {"policy": NATIVE, "params": {}}
        elif hasattr(policy, "describe"):
            described = policy.describe()
        else:
            described = {"policy": policy.name, "params": policy.config.to_dict()}
        spec = {"policy": described["policy"], "params": described["params"], "seed": self.settings.seed}
        if rule_digest(spec) != self._digest:
            self._digest = write_rule(self.rule_file, spec["policy"], spec["params"], self.settings.seed)
        self._rule_name = spec["policy"]

    def _assert_rule_runs(self) -> None:
        """Start-up check: one short greedy generation must be decided by spectune's rule."""
        self._rule_name = "lossless"
        n = 2 * self.settings.draft_len + 2
        before = self._counters()
        self._run(self.llm, [1, 2, 3, 4], n, 0.0, 0, None, False, None, stop_on_eos=False)
        drafts = self._counters()["num_drafts"] - before["num_drafts"]
        if drafts and not any(r.get("digest") == self._digest for r in seen_rules(self.rule_file)):
            raise VLLMUnavailable(f"vLLM verified {drafts} drafts at start-up but spectune's rule never ran: the "
                                  "plugin did not load in vLLM's worker processes (see VLLM_PLUGINS and the log)")
        if drafts == 0:
            raise VLLMUnavailable("vLLM ran no speculative step in the start-up check: speculation is not active")

    def _counters(self) -> dict[str, Any]:
        out: dict[str, Any] = {f: 0 for f in _METRICS.values()}
        out["per_pos"] = []
        for m in self.llm.get_metrics():
            if m.name in _METRICS:
                out[_METRICS[m.name]] = getattr(m, "value", 0)
            elif m.name == _PER_POS:
                out["per_pos"] = list(getattr(m, "values", []))
        return out

    def _run(self, llm: Any, prompt_ids: Any, max_new_tokens: int, temperature: float, seed: int,
             stop: Any, trace: bool, on_tokens: Any, stop_on_eos: bool = True) -> Generation:
        from vllm import SamplingParams

        if trace:
            raise ValueError("trace=True (per-round target logits) is a CPU-engine feature; vLLM does not expose them")
        prompt = check_request(prompt_ids, self.pair.vocab_size, max_new_tokens, temperature)
        eos = list(self.pair.eos_token_ids) if stop_on_eos else []
        params = SamplingParams(
            temperature=float(temperature), max_tokens=max_new_tokens, seed=int(seed) if temperature > 0 else None,
            stop=[s for s in (stop or ()) if s] or None, stop_token_ids=eos or None,
            ignore_eos=not eos, skip_special_tokens=True,
        )
        t0 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        wall = time.perf_counter() - t0
        completion = out.outputs[0]
        tokens = list(completion.token_ids)
        finish = completion.finish_reason or "length"
        if finish == "stop":
            if isinstance(completion.stop_reason, str):
                finish = "stop"
            else:
                finish = "eos"
                if tokens and tokens[-1] in eos:
                    tokens = tokens[:-1]  # SpecDecoder's token_ids exclude the EOS token
        stats = GenerationStats(num_generated=len(tokens), prompt_tokens=len(prompt), wall_time_s=wall)
        m = getattr(out, "metrics", None)
        if m is not None and getattr(m, "first_token_ts", 0) and getattr(m, "scheduled_ts", 0):
            stats.prefill_time_s = max(0.0, min(wall, m.first_token_ts - m.scheduled_ts))
        stats.cached_prompt_tokens = int(getattr(out, "num_cached_tokens", 0) or 0)
        stats.verify_time_s = stats.decode_time_s  # target passes dominate; vLLM does not split them
        if on_tokens is not None and tokens:
            on_tokens(tokens)  # once, at the end: the offline LLM API does not stream
        return Generation(token_ids=tokens, text=completion.text, finish_reason=finish, stats=stats)


def _declared_eos(model_dir: Path) -> SimpleNamespace:
    """A model directory's config + generation config, as ``eos_token_ids`` reads them (no model load)."""
    def eos(name: str) -> SimpleNamespace:
        path = model_dir / name
        return SimpleNamespace(eos_token_id=json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None)

    return SimpleNamespace(config=eos("config.json"), generation_config=eos("generation_config.json"))
