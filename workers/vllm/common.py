"""What both vLLM engines share (the offline :mod:`workers.vllm.engine` for evaluation, the async
:mod:`workers.vllm.async_engine` for serving): the engine arguments, the plugin check, a request's rule as it
travels in ``SamplingParams.extra_args``, and a finished ``RequestOutput`` as spectune's Generation.
Imports vllm only inside functions."""

from __future__ import annotations

import importlib.metadata
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from policies import make_policy
from workers.stats import Generation, GenerationStats
from workers.vllm.rules import ENTRY_POINT, NATIVE, RULE_ARG
from workers.vllm.settings import DEFAULT_GPU_MEMORY_UTILIZATION, PAD_ATTR, VLLMSettings, spec_stats

WORKER_EXTENSION = "workers.vllm.plugin.WorkerExtension"


def sampling_params(max_new_tokens: int, temperature: float, seed: int | None, stop: Any, eos: list[int],
                    rule: dict[str, Any] | None = None) -> Any:
    """vLLM's SamplingParams for one request of either engine: the seed only where it draws (T > 0) and
    one was given (a seeded request puts vLLM's sampler on its per-request generator loop),
    EOS as stop tokens (none: generate to the length), and the request's own rule in ``extra_args``."""
    from vllm import SamplingParams

    return SamplingParams(
        temperature=float(temperature), max_tokens=max_new_tokens, seed=int(seed) if temperature > 0 and seed is not None else None,
        stop=[x for x in (stop or ()) if x] or None, stop_token_ids=eos or None, ignore_eos=not eos,
        skip_special_tokens=True, extra_args=None if rule is None else {RULE_ARG: rule})


def refuse_sampling_constraints(top_p: float = 1.0, top_k: int | None = None, min_p: float = 0.0) -> None:
    """Admission check of spectune's vLLM engines: top-p, top-k and min-p are refused with a ValueError
    naming the parameter. While a spectune rule verifies, vLLM's ``apply_sampling_constraints`` is an
    identity (the rules read the raw target logits and apply the temperature themselves), so vLLM would
    apply them to the bonus token only: the output would follow neither the constrained nor the
    unconstrained distribution. ``top_k`` 0, -1 or None, ``top_p`` 1 and ``min_p`` 0 mean "off"."""
    why = ("spectune's rules on vLLM decide from the full target distribution at the request's temperature "
           "(vLLM would apply it to the bonus token only), so the vLLM engine refuses it")
    if top_p is not None and float(top_p) != 1.0:
        raise ValueError(f"top_p={top_p}: {why}; send top_p=1.0")
    if top_k is not None and int(top_k) not in (0, -1):
        raise ValueError(f"top_k={top_k}: {why}; send top_k=0 (or -1, or none)")
    if min_p is not None and float(min_p) != 0.0:
        raise ValueError(f"min_p={min_p}: {why}; send min_p=0.0")


def merge_rank_ledgers(ranks: list[dict[str, Any]]) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """The plugin's ledgers (``spectune_take_fallbacks``, one per TP rank, in rank order) merged per request:
    counts by max (the ranks decide the same steps); ``rules`` = the digests that *every* rank applied to
    the request, so a rank where spectune's rule did not run (the plugin not loaded there) leaves the
    request's rule out and the caller's check fails; ``ranks_without`` names such ranks. Also the
    running totals."""
    per_rank = [rank.get("requests", {}) for rank in ranks]
    merged: dict[str, dict[str, Any]] = {}
    for req_id in set().union(*per_rank):
        entries = [r.get(req_id) or {} for r in per_rank]
        merged[req_id] = {
            "steps": max(int(e.get("steps", 0)) for e in entries),
            "lossless_fallback_steps": max(int(e.get("lossless_fallback_steps", 0)) for e in entries),
            "rules": set.intersection(*[set(e.get("rules", {})) for e in entries]),
            "ranks_without": [k for k, e in enumerate(entries) if not e.get("rules")]}
    return merged, (ranks[-1].get("totals", {}) if ranks else {})


def rule_missing(request: str, drafts: int, policy: str, entry: dict[str, Any]) -> VLLMUnavailable:
    """The error for a request whose own rule did not decide its drafts (in some rank)."""
    where = (f" in TP rank(s) {entry['ranks_without']}" if entry.get("ranks_without") and entry.get("steps")
             else "")
    return VLLMUnavailable(f"{request}: vLLM verified {drafts} drafts but its rule {policy} never decided one{where} "
                           "(spectune's plugin inactive in vLLM's worker processes?)")


REFERENCE_SHARE = 0.35  # of the memory budget, for the target-only engine when both engines share a device


def memory_shares(s: VLLMSettings, shared: bool) -> tuple[float, float]:
    """``gpu_memory_utilization`` for the speculative and the target-only engine. One at a time (vLLM-CPU,
    or the reference on its own device): each may take the whole budget. Both resident on one device
    (GPUs): ``s.gpu_memory_utilization`` is the budget of the two together (vLLM refuses to start an
    engine whose fraction is more than the device has free), split so that they fit: the reference
    gets ``target_only_memory_utilization`` or REFERENCE_SHARE of the budget, the speculative engine
    (target + draft + their KV caches) the rest."""
    budget = s.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION
    if not shared:
        return budget, s.target_only_memory_utilization or budget
    ref = s.target_only_memory_utilization or round(budget * REFERENCE_SHARE, 4)
    if ref >= budget - 0.05:
        raise ValueError(f"target_only_memory_utilization {ref} leaves the speculative engine less than 0.05 of "
                         f"the device within gpu_memory_utilization {budget} (both engines share it)")
    return round(budget - ref, 4), ref


def memory_decision(s: VLLMSettings, draft_dir: Path, target_dir: Path, total_bytes: int
                    ) -> tuple[VLLMSettings, Any]:
    """On a GPU of ``total_bytes`` per rank: the settings the memory plan (:func:`workers.vllm.memory.plan_memory`
    from the pair's configs) gives, and the plan — unless the user chose (``gpu_memory_utilization``,
    ``target_only_memory_utilization`` or ``one_engine_at_a_time`` set): then ``(s, None)``. Plan "both":
    both engines resident, each with its own fraction; "one at a time": they alternate, each with the
    plan's fraction; "does not fit": ValueError before any vLLM process, naming the smallest TP that fits."""
    import dataclasses

    from workers.vllm.memory import DTYPE_BYTES, GIB, ModelShape, plan_memory

    if any(v is not None for v in (s.gpu_memory_utilization, s.target_only_memory_utilization,
                                   s.one_engine_at_a_time)):
        return s, None
    plan = plan_memory(int(total_bytes), ModelShape.from_dir(target_dir), ModelShape.from_dir(draft_dir),
                       dtype=s.dtype if s.dtype in DTYPE_BYTES else "bfloat16", tp=s.tensor_parallel_size,
                       max_num_seqs=s.max_num_seqs or 256, draft_len=s.draft_len, max_model_len=s.max_model_len)
    seqs = s.max_num_seqs or 256  # the plan's batch, passed on (vLLM's own default on a large card is 1024)
    if plan.mode == "both":
        budget = round(plan.speculative_utilization + plan.reference_utilization, 3)
        return dataclasses.replace(s, gpu_memory_utilization=budget, max_num_seqs=seqs,
                                   target_only_memory_utilization=plan.reference_utilization,
                                   one_engine_at_a_time=False), plan
    if plan.mode == "one at a time":
        return dataclasses.replace(s, gpu_memory_utilization=plan.speculative_utilization, max_num_seqs=seqs,
                                   target_only_memory_utilization=plan.reference_utilization,
                                   one_engine_at_a_time=True), plan
    raise ValueError(f"the pair does not fit a {total_bytes / GIB:.1f} GiB device at tensor_parallel_size "
                     f"{s.tensor_parallel_size}: {plan.note} (speculative engine ~{plan.speculative_gib} GiB, "
                     f"target-only ~{plan.reference_gib} GiB per rank, estimates; python -m workers.vllm.memory). "
                     "Set gpu_memory_utilization / one_engine_at_a_time to override the plan.")


def device_total_bytes() -> int:
    """The first visible GPU's total memory, read through NVML (vLLM's platform layer maps the visible index),
    which creates no CUDA context here; ``torch.cuda.mem_get_info`` would create one, held by this process for
    its lifetime beside the engines' (~0.5 GiB the plan does not give it)."""
    try:
        from vllm.platforms import current_platform

        return int(current_platform.get_device_total_memory(0))
    except Exception:  # noqa: BLE001 - no vLLM here, or no NVML: the CUDA runtime's device properties
        import torch

        return int(torch.cuda.get_device_properties(0).total_memory)


def plan_memory_on_gpu(s: VLLMSettings, draft_dir: Path, target_dir: Path) -> VLLMSettings:
    """:func:`memory_decision` with this process's GPU (:func:`device_total_bytes`), logged; on CPU builds (no
    CUDA) the settings unchanged."""
    import logging

    import torch

    if not torch.cuda.is_available():
        return s
    total = device_total_bytes()
    planned, plan = memory_decision(s, draft_dir, target_dir, total)
    if plan is not None:
        logging.getLogger(__name__).warning(
            "spectune memory plan (estimates, from the configs) for %.1f GiB per rank: %s -> "
            "gpu_memory_utilization=%s, target_only_memory_utilization=%s, one_engine_at_a_time=%s (%s)",
            total / (1 << 30), plan.mode, planned.gpu_memory_utilization, planned.target_only_memory_utilization,
            planned.one_engine_at_a_time, plan.note)
    return planned


def engine_kwargs(s: VLLMSettings, target_dir: Path, draft_dir: Path | None, shared: bool = False,
                  draft_width: int = 0) -> dict[str, Any]:
    """vLLM engine arguments (``LLM(**...)`` or ``AsyncEngineArgs(**...)``) for the speculative engine
    (``draft_dir`` given) or the target-only reference engine (None). ``shared``: both engines are
    resident on one device at once (see :func:`memory_shares`). ``draft_width``: the pair's draft is
    narrower than the target (:func:`~workers.vllm.settings.check_pair_dirs`): the target's config then
    names it (``hf_overrides``, target only: vLLM gives dict overrides to the target alone), which lets
    the plugin run that draft padded and mask the target's logits past it, in both engines alike."""
    spec_share, ref_share = memory_shares(s, shared)
    kwargs: dict[str, Any] = dict(
        model=str(target_dir), tokenizer=str(target_dir), dtype=s.dtype, seed=s.seed,
        tensor_parallel_size=s.tensor_parallel_size, kv_cache_memory_bytes=s.kv_cache_memory_bytes,
        max_model_len=s.max_model_len, enforce_eager=s.enforce_eager, disable_log_stats=False,
        # TP workers as child processes of this one (a Ray actor that owns its GPUs), not Ray tasks
        distributed_executor_backend="mp" if s.tensor_parallel_size > 1 else None,
        worker_extension_cls=WORKER_EXTENSION)  # both engines: spectune_env reports their processes
    for name in ("max_num_batched_tokens", "max_num_seqs"):  # None: vLLM's default for the platform
        if getattr(s, name) is not None:
            kwargs[name] = getattr(s, name)
    if draft_width:
        kwargs["hf_overrides"] = {PAD_ATTR: int(draft_width)}
    if draft_dir is None:
        kwargs["gpu_memory_utilization"] = ref_share
        return kwargs
    kwargs.update(
        gpu_memory_utilization=spec_share, per_request_spec_decode_metrics="summary",
        speculative_config={"method": s.speculative_method, "model": str(draft_dir), "num_speculative_tokens": s.draft_len,
                            "draft_tensor_parallel_size": s.tensor_parallel_size,
                            "draft_sample_method": "probabilistic"})
    return kwargs


class VLLMProcessSetup:
    """What this process sets before it starts a vLLM engine (its engine-core and worker processes
    inherit the environment): the V1 model runner (the one the plugin patches; vLLM 0.33 runs
    draft_model on its V2 runner by default and marks V1 deprecated — explicit, not left to vLLM's
    default; the installed vLLM passes the plugin's version and signature gates first), vLLM-CPU's thread
    binding, the step timeout, whether the two engines run one at a time, the rule file (lossless)
    that makes the plugin act (a request's own rule overrides it), and this process as the owner that
    vLLM's processes watch (:mod:`workers.vllm.orphans`: they leave when it is gone)."""

    def __init__(self, settings: VLLMSettings, prefix: str = "spectune-vllm-") -> None:
        import tempfile

        from policies import fused
        from workers.vllm.rules import RULE_FILE_ENV, write_rule
        from workers.vllm.settings import _on_cpu, set_cpu_thread_binding, set_step_timeout

        fused.mode()  # a bad SPECTUNE_FUSED fails here, before vLLM starts, naming it (its workers inherit it)
        check_plugin_installed()
        check_patch_gates()
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
        if os.environ["VLLM_USE_V2_MODEL_RUNNER"].strip() != "0":
            raise VLLMUnavailable("VLLM_USE_V2_MODEL_RUNNER is set: spectune's plugin patches vLLM's V1 model runner, "
                                  "which draft_model speculation needs; unset it or set it to 0")
        on_cpu = _on_cpu()
        self.cpu_binding = set_cpu_thread_binding(settings) if on_cpu else None
        self.step_timeout = set_step_timeout(settings, on_cpu)
        # One engine at a time on vLLM-CPU: RAM holds one fp32 real pair's engines, not two
        self.exclusive = on_cpu if settings.one_engine_at_a_time is None else settings.one_engine_at_a_time
        # vLLM's engine core and workers leave when this process ends, however it ends (workers.vllm.orphans)
        from workers.vllm.orphans import arm

        arm()
        self.rule_dir = tempfile.TemporaryDirectory(prefix=prefix)
        self.rule_file = Path(self.rule_dir.name) / "rule.json"
        self.digest = write_rule(self.rule_file, "lossless", {}, settings.seed)
        os.environ[RULE_FILE_ENV] = str(self.rule_file)


class VLLMUnavailable(RuntimeError):
    """vLLM or spectune's plugin is missing, or vLLM is not running the rule spectune asked for."""


class EngineDied(VLLMUnavailable):
    """vLLM's engine core died under a batch (a step past ``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS``, a worker
    or the core killed, for memory or otherwise): the requests in it failed, the engine is replaced."""


def lose_batch(order: list[int], results: list[Any], died: EngineDied, errors: str, runs: int) -> list[Any]:
    """Every request (``order``: their slots in ``results``) of a batch whose engine died under its last
    run fails with one EngineDied; ``errors="raise"`` raises it."""
    err = EngineDied(f"{len(order)} request(s) lost after {runs} run(s) of their batch, the last one on an "
                     f"engine that died: {died}")
    if errors == "raise":
        raise err from died
    for i in order:
        results[i] = err
    return results


def engine_dead(llm: Any) -> bool:
    """Whether vLLM marked this engine (offline ``LLM`` or ``AsyncLLM``) dead: its core process exited,
    or failed and said so. Never raises."""
    client = getattr(getattr(llm, "llm_engine", llm), "engine_core", None)
    return bool(getattr(getattr(client, "resources", None), "engine_dead", False))


def is_engine_death(err: BaseException, llm: Any) -> bool:
    """Whether ``err`` from a call into ``llm`` means its engine died (rather than refusing a request)."""
    return any(c.__name__ == "EngineDeadError" for c in type(err).__mro__) or engine_dead(llm)


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not: a container's init may never reap an orphan)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    return state not in ("Z", "X")


def reap_workers(pids: list[int], grace_s: float = 10.0) -> list[int]:
    """SIGKILL the workers of a dead engine still running after ``grace_s`` (returns their pids). vLLM's
    workers leave when their engine core does, unless they are stuck in a step — which is why a core
    dies of a step timeout — and then they keep their memory (a GPU's) from the replacement engine."""
    import signal

    deadline = time.monotonic() + grace_s
    left = [p for p in pids if p != os.getpid() and process_alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = [p for p in left if process_alive(p)]
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


class DeathWatch:
    """``with DeathWatch(llm): llm.generate(...)`` — raise vLLM's EngineDeadError in the generate if the
    engine core dies without a word. vLLM 0.32's sync client waits forever then: a core that fails by an
    exception (a step timeout, a worker that died) sends ENGINE_CORE_DEAD and ``generate`` raises, but
    for a core that exits on a signal (the OOM killer, SIGKILL) its process monitor marks the engine dead
    and stops the output thread without waking the reader blocked in ``get_output``. This thread checks
    once per ``period`` seconds and wakes it with the error."""

    def __init__(self, llm: Any, period: float = 1.0) -> None:
        self.llm, self.period = llm, period
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True, name="spectune-engine-death-watch")

    def _watch(self) -> None:
        queue = getattr(getattr(getattr(self.llm, "llm_engine", None), "engine_core", None), "outputs_queue", None)
        while queue is not None and not self.stop.wait(self.period):
            if engine_dead(self.llm):
                from vllm.v1.engine.exceptions import EngineDeadError

                queue.put_nowait(EngineDeadError())
                return

    def __enter__(self) -> DeathWatch:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.thread.join()


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


def check_patch_gates() -> None:
    """The installed vLLM is one the plugin patches safely (:mod:`workers.vllm.gates`: supported version, every
    patched symbol's signature as recorded), else :class:`~workers.vllm.gates.PatchGateError` naming the
    symbol and the expected and found signatures — before any vLLM process starts. vLLM's plugin loader
    only logs a plugin that raises, so this is where a mismatch stops a spectune engine."""
    from workers.vllm import gates

    if gates.FAILURES:  # register() already ran in this process and refused
        raise gates.PatchGateError(gates.message(gates.FAILURES))
    gates.verify()


def describe_rule(policy: Any) -> dict[str, Any]:
    """A Policy (or a rule name such as ``"vllm-native"``) as ``{"policy", "params"}``."""
    if policy == NATIVE:
        return {"policy": NATIVE, "params": {}}
    if hasattr(policy, "describe"):
        return policy.describe()
    return {"policy": policy.name, "params": policy.config.to_dict()}


def rule_spec(rule: Any, default_seed: int) -> dict[str, Any]:
    """One request's rule as the plugin reads it from ``extra_args``: validated here, where the error
    reaches the caller; JSON-able (it travels to vLLM's engine-core process). ``rule``: a Policy, a
    name, or ``{"policy", "params", "seed"}`` (the seed defaults to ``default_seed``)."""
    if isinstance(rule, dict):
        policy = make_policy(rule["policy"], **dict(rule.get("params") or {}))
        seed = int(rule.get("seed", default_seed))
    elif rule == NATIVE:
        raise ValueError(f"{NATIVE!r} cannot be a per-request rule: vLLM's own sampler decides whole steps")
    else:
        policy, seed = (make_policy(rule) if isinstance(rule, str) else rule), default_seed
    described = describe_rule(policy)
    return json.loads(json.dumps({"policy": described["policy"], "params": described["params"], "seed": seed}))


# vLLM waits 5 s for an engine core to leave after SIGTERM before it kills the process tree. On vLLM-CPU the
# core always waits out those 5 s (its worker does not leave on its own: every shutdown ends in the kill), so
# there the wait is cut to this; on a GPU vLLM's own default stands.
CPU_SHUTDOWN_GRACE_S = 1.0


def shutdown_grace_s() -> float | None:
    """How long an engine core gets to leave after SIGTERM before vLLM kills it: None (vLLM's default) on a GPU,
    :data:`CPU_SHUTDOWN_GRACE_S` on vLLM-CPU."""
    from workers.vllm.settings import _on_cpu

    return CPU_SHUTDOWN_GRACE_S if _on_cpu() else None


def shutdown_engine(llm: Any) -> None:
    """Stop an engine's engine-core (and worker) processes now (offline ``LLM`` or ``AsyncLLM``); their
    memory goes with them. The core gets :func:`shutdown_grace_s` to leave before vLLM kills it."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    try:
        if core is not None:
            core.shutdown(timeout=shutdown_grace_s())
        elif hasattr(llm, "shutdown"):
            llm.shutdown(timeout=shutdown_grace_s())
    except Exception:  # noqa: BLE001 - a dead engine's remains: nothing left to stop
        if not engine_dead(llm):
            raise
    import gc

    gc.collect()


def to_generation(out: Any, prompt: list[int], eos: list[int], call_wall: float | None, fallback_steps: int,
                  draft_len: int | None) -> Generation:
    """A finished vLLM ``RequestOutput`` as spectune's Generation (SpecDecoder's conventions: no EOS token
    in ``token_ids``; ``finish_reason`` eos/stop/length). ``call_wall``: the call's wall time for a lone
    request, else the request's own time in the engine; ``draft_len``: None for target-only."""
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
    stats = GenerationStats(num_generated=len(tokens), prompt_tokens=len(prompt))
    m = getattr(out, "metrics", None)
    scheduled = getattr(m, "scheduled_ts", 0.0) or 0.0
    first, last = getattr(m, "first_token_ts", 0.0) or 0.0, getattr(m, "last_token_ts", 0.0) or 0.0
    if call_wall is not None:  # one request: the call's wall time, as before
        stats.wall_time_s = call_wall
    elif scheduled and last >= scheduled:  # a batch: this request's own time in the engine
        stats.wall_time_s = last - scheduled
    if first and scheduled:
        stats.prefill_time_s = max(0.0, min(stats.wall_time_s, first - scheduled))
    stats.cached_prompt_tokens = int(getattr(out, "num_cached_tokens", 0) or 0)
    stats.verify_time_s = stats.decode_time_s  # target passes dominate; vLLM does not split them
    if draft_len is not None:
        st = stats
        st.draft_len = draft_len
        counts = spec_stats(getattr(completion, "spec_decode_metrics", None), st.draft_len)
        st.num_drafts, st.num_draft_tokens = counts["num_drafts"], counts["num_draft_tokens"]
        st.num_accepted_tokens = counts["num_accepted_tokens"]
        st.accepted_per_position = counts["accepted_per_position"]
        st.target_forwards, st.draft_forwards = st.num_drafts, st.num_draft_tokens
        st.lossless_fallback_steps = fallback_steps
    return Generation(token_ids=tokens, text=completion.text, finish_reason=finish, stats=stats)
