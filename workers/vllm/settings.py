"""What a vLLM engine is started with, and the pieces of it that need no running vLLM.

:class:`VLLMSettings` (validated on construction) and :class:`VLLMPair` (what ``engine.pair`` holds);
vLLM-CPU's thread binding (``VLLM_CPU_OMP_THREADS_BIND`` for the CPUs this process may use, or a Ray
actor's share of them, one list per tensor-parallel rank, never over a user's value); the mapping of
vLLM's per-request speculative-decoding metrics onto spectune's counts, and an engine's cumulative
spec-decode counters (:func:`engine_counters`, what the per-request counts must add up to); a model directory's declared
EOS ids. Nothing here imports vllm at module level (only :func:`_on_cpu` asks vLLM's platform, and
answers False without it); :mod:`workers.vllm.engine` runs vLLM with these.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

CPU_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
STEP_TIMEOUT_ENV = "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"
CPU_STEP_TIMEOUT_S = 3600
_bind_set_here: str | None = None  # the value this module last wrote (so it is not taken for a user's)


SPECULATIVE_METHODS = ("draft_model", "eagle3")  # vLLM's speculative_config methods spectune's rules run with
DEFAULT_GPU_MEMORY_UTILIZATION = 0.85  # gpu_memory_utilization when not set and no memory plan applies


@dataclass(frozen=True)
class VLLMSettings:
    draft_len: int = 5
    tensor_parallel_size: int = 1
    # None: DEFAULT_GPU_MEMORY_UTILIZATION, or on a GPU the memory plan's (workers.vllm.common.memory_decision,
    # when target_only_memory_utilization and one_engine_at_a_time are None too); on CPU builds: the
    # fraction of RAM for the KV cache
    gpu_memory_utilization: float | None = None
    target_only_memory_utilization: float | None = None  # the reference engine; default: same
    max_model_len: int = 4096
    dtype: str = "bfloat16"
    enforce_eager: bool = False
    seed: int = 0
    # KV cache size in bytes for each engine (overrides the memory fractions; vLLM's kv_cache_memory_bytes).
    # On vLLM-CPU the fraction counts the worker's own resident memory, so small fractions fail to start.
    kv_cache_memory_bytes: int | None = None
    # vLLM-CPU thread binding: use num_cpus of this process's allowed CPUs, starting at cpu_offset
    # (a Ray actor passes its CPU count and slot); None = all of them. Ignored when the user set
    # VLLM_CPU_OMP_THREADS_BIND, and on GPU builds.
    num_cpus: int | None = None
    cpu_offset: int = 0
    # Run the speculative and the target-only engine one at a time (switching costs a restart);
    # None = on vLLM-CPU (RAM holds one fp32 real pair's engines, not two), not on GPUs.
    one_engine_at_a_time: bool | None = None
    # The longest one engine step may take before vLLM declares its engine dead
    # (VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS, vLLM's default 300 s). None: vLLM-CPU gets CPU_STEP_TIMEOUT_S
    # unless the user set the variable (a 4096-token prefill chunk of the real pair in emulated bf16 runs
    # past 300 s on a 2-core AVX2 machine), GPUs keep vLLM's default. A value here overrides both.
    step_timeout_s: int | None = None
    # vLLM's scheduler budget: tokens per engine step (prefill chunks included) and requests per step.
    # None = vLLM's defaults (vLLM-CPU: 4096 tokens offline, 2048 served). A smaller token budget splits
    # long prompts into more chunks, so decode steps of the requests in flight wait less behind them.
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    # What drafts: "draft_model" (a separate small model: the pair's draft directory) or "eagle3" (an EAGLE-3
    # head drafting from the target's hidden states: the pair's draft directory is the head,
    # workers.models.eagle). The rules judge both alike; q is the drafter's distribution over the target's ids.
    speculative_method: str = "draft_model"
    # Only the target-only (reference) engine: no speculative engine is started, ``generate`` refuses, and
    # ``autoregressive`` decodes (calibration's step timing, workers.calibrate, needs nothing else).
    target_only: bool = False

    def __post_init__(self) -> None:
        if self.speculative_method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_method must be one of {list(SPECULATIVE_METHODS)}, got "
                             f"{self.speculative_method!r}")
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
        if self.kv_cache_memory_bytes is not None and not (isinstance(self.kv_cache_memory_bytes, int)
                                                           and self.kv_cache_memory_bytes > 0):
            raise ValueError(f"kv_cache_memory_bytes must be a positive integer, got {self.kv_cache_memory_bytes!r}")
        if self.num_cpus is not None and not (isinstance(self.num_cpus, int) and self.num_cpus >= 1):
            raise ValueError(f"num_cpus must be an integer >= 1, got {self.num_cpus!r}")
        if not (isinstance(self.cpu_offset, int) and self.cpu_offset >= 0):
            raise ValueError(f"cpu_offset must be an integer >= 0, got {self.cpu_offset!r}")
        if self.step_timeout_s is not None and not (isinstance(self.step_timeout_s, int) and self.step_timeout_s > 0):
            raise ValueError(f"step_timeout_s must be a positive integer (seconds), got {self.step_timeout_s!r}")
        for name in ("max_num_batched_tokens", "max_num_seqs"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if (self.max_num_batched_tokens is not None and self.max_num_seqs is not None
                and self.max_num_batched_tokens < self.max_num_seqs):
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({self.max_num_seqs}): vLLM schedules at least one token per request")
        if not isinstance(self.target_only, bool):
            raise ValueError(f"target_only must be true or false, got {self.target_only!r}")


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
    draft_width: int = 0  # the draft's logits width when narrower than vocab_size (0: the same); padded in vLLM


# The target's hf_config key (vLLM ``hf_overrides``) naming the draft's narrower logits width: the plugin then
# lets vLLM run that draft, pads its logits to the target's width with -inf and masks the target's logits on
# the padded ids (:mod:`workers.vllm.plugin`). Set on both engines, so target-only decodes the same.
PAD_ATTR = "spectune_draft_width"


def check_drafter_dirs(settings: VLLMSettings, draft_dir: Path, target_dir: Path) -> int:
    """:func:`check_pair_dirs` for a draft model, :func:`workers.models.eagle.check_head_dir` for an EAGLE-3 head
    (never padded: vLLM maps a reduced head vocabulary onto the target's itself); the draft's width as there."""
    if settings.speculative_method == "eagle3":
        from workers.models.eagle import check_head_dir

        check_head_dir(draft_dir, target_dir, settings.tensor_parallel_size)
        return 0
    return check_pair_dirs(draft_dir, target_dir, settings.tensor_parallel_size)


def check_pair_dirs(draft_dir: Path, target_dir: Path, tensor_parallel_size: int = 1) -> int:
    """What vLLM would refuse late or not at all, as one ValueError naming the problem and the fix, before
    any vLLM process starts: a draft wider than the target, tokenizers that differ, a draft too narrow for
    the tokenizer, attention heads that tensor parallelism cannot split. Returns the draft's logits width
    when it is narrower than the target's (vLLM then pads it, :data:`PAD_ATTR`), else 0."""
    from workers.models.pair import check_same_specials, check_same_vocab, model_config, special_tokens

    draft_dir, target_dir = Path(draft_dir), Path(target_dir)
    draft, target = model_config(draft_dir), model_config(target_dir)
    widths = [c.get("vocab_size") for c in (draft, target)]
    if not all(isinstance(w, int) and w > 0 for w in widths):
        raise ValueError(f"config.json of draft {draft_dir} / target {target_dir} give vocab_size {widths[0]!r} / "
                         f"{widths[1]!r}; both must be positive integers")
    if widths[0] > widths[1]:
        raise ValueError(f"draft {draft_dir} scores {widths[0]} ids but target {target_dir} only {widths[1]}: the "
                         "draft could propose ids the target cannot score; use a draft no wider than the target")
    tp = tensor_parallel_size
    for role, path, config in (("draft", draft_dir, draft), ("target", target_dir, target)):
        heads = config.get("num_attention_heads")
        kv = config.get("num_key_value_heads") or heads
        if isinstance(heads, int) and heads % tp:
            raise ValueError(f"{role} {path} has {heads} attention heads, not divisible by tensor_parallel_size "
                             f"{tp}: choose a tensor_parallel_size that divides {heads}")
        if isinstance(kv, int) and kv > 0 and (kv % tp if kv >= tp else tp % kv):
            raise ValueError(f"{role} {path} has {kv} KV heads, which tensor_parallel_size {tp} can neither split nor "
                             f"replicate evenly: choose a tensor_parallel_size that divides {kv} or that {kv} divides")
    same_file = all((d / "tokenizer.json").is_file() for d in (draft_dir, target_dir)) and \
        (draft_dir / "tokenizer.json").read_bytes() == (target_dir / "tokenizer.json").read_bytes()
    padded = widths[0] < widths[1]
    if same_file and not padded:
        return 0
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(target_dir), local_files_only=True)
    if not same_file:
        # vLLM gives the draft the target's tokenizer: a draft trained on another one would be run silently
        draft_tok = AutoTokenizer.from_pretrained(str(draft_dir), local_files_only=True)
        check_same_vocab(draft_tok.get_vocab(), tokenizer.get_vocab(), draft_dir, target_dir)
        check_same_specials(special_tokens(draft_tok), special_tokens(tokenizer), draft_dir, target_dir)
    if len(tokenizer) > widths[0]:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens but draft {draft_dir} scores only {widths[0]} ids: "
                         "it could neither propose nor read every token the target emits; use a draft that covers "
                         "the tokenizer")
    return widths[0] if padded else 0


def _ranges(cpus: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5" (vLLM's CPU list syntax)."""
    out, run = [], [cpus[0], cpus[0]]
    for c in cpus[1:]:
        if c == run[1] + 1:
            run[1] = c
        else:
            out.append(run)
            run = [c, c]
    out.append(run)
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in out)


def cpu_thread_binding(num_cpus: int | None = None, cpu_offset: int = 0, tensor_parallel_size: int = 1,
                       allowed: Sequence[int] | None = None) -> str:
    """The ``VLLM_CPU_OMP_THREADS_BIND`` value for the CPUs this process may use: ``num_cpus`` of the
    allowed CPUs (all by default) starting at ``cpu_offset`` (wrapping), split into one contiguous
    list per tensor-parallel rank ("0-3|4-7"). Each rank gets at least one CPU."""
    cpus = sorted(os.sched_getaffinity(0) if allowed is None else allowed)
    if not cpus:
        raise ValueError("no CPU is allowed for this process")
    start = cpu_offset % len(cpus)
    cpus = (cpus[start:] + cpus[:start])[:min(num_cpus or len(cpus), len(cpus))]
    tp = max(1, tensor_parallel_size)
    per_rank = max(1, len(cpus) // tp)
    lists = [sorted(cpus[(r * per_rank) % len(cpus):][:per_rank] or cpus[:per_rank]) for r in range(tp)]
    return "|".join(_ranges(c) for c in lists)


def set_cpu_thread_binding(settings: VLLMSettings, environ: Any = None) -> str:
    """Set ``VLLM_CPU_OMP_THREADS_BIND`` for the vLLM processes this one starts (they inherit the
    environment), unless the user set it; returns the value in force."""
    global _bind_set_here
    env = os.environ if environ is None else environ
    current = env.get(CPU_BIND_ENV)
    if current is not None and current != _bind_set_here:
        return current  # the user's choice
    value = cpu_thread_binding(settings.num_cpus, settings.cpu_offset, settings.tensor_parallel_size)
    env[CPU_BIND_ENV] = value
    _bind_set_here = value
    return value


def set_step_timeout(settings: VLLMSettings, on_cpu: bool, environ: Any = None) -> str | None:
    """Set ``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS`` for the engines this process starts: the settings' value
    if given, else on vLLM-CPU :data:`CPU_STEP_TIMEOUT_S` unless the user set it; returns the value in force
    (None: vLLM's default)."""
    env = os.environ if environ is None else environ
    if settings.step_timeout_s is not None:
        env[STEP_TIMEOUT_ENV] = str(settings.step_timeout_s)
    elif on_cpu:
        env.setdefault(STEP_TIMEOUT_ENV, str(CPU_STEP_TIMEOUT_S))
    return env.get(STEP_TIMEOUT_ENV)


def _on_cpu() -> bool:
    try:
        from vllm.platforms import current_platform

        return bool(current_platform.is_cpu())
    except Exception:  # noqa: BLE001
        return False


def spec_stats(metrics: Any, draft_len: int) -> dict[str, Any]:
    """vLLM's per-request ``RequestSpecDecodeMetrics`` -> spectune's per-generation counts. The histogram
    counts verify steps by accepted drafts j; acceptance is a leading run, so position i was accepted
    in every step with j > i."""
    hist = list(getattr(metrics, "histogram", None) or [])
    per_pos = [sum(hist[i + 1:]) for i in range(draft_len)]
    return {"num_drafts": sum(hist), "num_draft_tokens": int(getattr(metrics, "num_draft_tokens", 0) or 0),
            "num_accepted_tokens": sum(j * c for j, c in enumerate(hist)), "accepted_per_position": per_pos}


def _declared_eos(model_dir: Path) -> SimpleNamespace:
    """A model directory's config + generation config, as ``eos_token_ids`` reads them (no model load)."""
    def eos(name: str) -> SimpleNamespace:
        path = model_dir / name
        return SimpleNamespace(eos_token_id=json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None)

    return SimpleNamespace(config=eos("config.json"), generation_config=eos("generation_config.json"))


_METRICS = {  # vLLM counter -> GenerationStats field
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}
_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def engine_counters(llm: Any) -> dict[str, Any]:
    """An offline engine's spec-decode counters (cumulative, vLLM's engine-wide accounting) under spectune's
    names, read from its own Prometheus logger: ``LLM.get_metrics()`` reads the process-global registry,
    from which every later vLLM engine started with stats on (the reference, another pair) removes them."""
    out: dict[str, Any] = {f: 0 for f in _METRICS.values()}
    out["per_pos"] = []
    manager = getattr(llm.llm_engine, "logger_manager", None)
    for logger in getattr(manager, "stat_loggers", []):
        prom = getattr(logger, "spec_decoding_prom", None)
        if prom is None or not getattr(prom, "spec_decoding_enabled", False):
            continue
        value = (lambda c: float(c._value.get()))  # noqa: E731 - prometheus_client child counters
        out["num_drafts"] = value(prom.counter_spec_decode_num_drafts[0])
        out["num_draft_tokens"] = value(prom.counter_spec_decode_num_draft_tokens[0])
        out["num_accepted_tokens"] = value(prom.counter_spec_decode_num_accepted_tokens[0])
        out["per_pos"] = [value(c) for c in prom.counter_spec_decode_num_accepted_tokens_per_pos.get(0, [])]
        return out
    for m in llm.get_metrics():
        if m.name in _METRICS:
            out[_METRICS[m.name]] = getattr(m, "value", 0)
        elif m.name == _PER_POS:
            out["per_pos"] = list(getattr(m, "values", []))
    return out
