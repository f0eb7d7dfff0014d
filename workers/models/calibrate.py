"""Measure a pair's forward-pass costs on this machine: the draft/target cost ratio c and the
verify pass's cost per extra token, stored with the pair so modelled speedups can use them.

    python -m workers.models.calibrate --pair qwen2.5-coder-0.5b+1.5b [--dtype bf16] [--reps 15]

(``python -m workers.calibrate --engine cpu`` runs this; ``--engine vllm`` measures c through vLLM.)

Timings are taken the way the engine runs the models: batch 1, a warm KV cache of
``context`` tokens, the LM head on the last position for a 1-token step and on all positions for
a verify pass. Attention's share of a step grows with the context, so a workload is modelled with a profile
timed at its own context (:func:`workload_context`: its prompts' median length plus half its new tokens; a
sweep's 8-shot GSM8K prompts are ~1,410 tokens (1,536 positions), the bench's 0-shot ones ~110 (128)). The step
kinds are timed in rounds (:func:`_interleaved`). Stored at
``<pair cache>/cost-<dtype>-<machine>-<fingerprint>-<threads>t-<layers>-ctx<context>.json`` and reused by every later
run whose key is the same: the machine key is the CPU model and core count, since a ratio measured on one machine says
little about another; the fingerprint (:func:`fingerprint`) digests what else a step's time rests on (the CPU's flags,
the torch build and the kernels ATen dispatches to, transformers' version, the fast path's kernel version
``FAST_NUMERICS``, the draft's head); and a profile is kept per torch thread count (a sweep's actors run one each, a
bench every core), per way the fast path's layers run (``scripted`` or ``eager``, :mod:`workers.models.fast_step`) and
per context. A change to any of them measures again; nothing else does.

A profile is timed against a context of ``context`` positions: on the fast path the KV cache is filled with random
keys and values (a step's cost does not depend on what the cache holds, and prefilling 1,536 positions took 20-28 s a
model at one thread), elsewhere one prefill per model is shared by every step kind (each step crops back to it).
A calibration times contention where other processes take the CPUs while it runs: it measures the CPU time others
took during its rounds (``others_cpu``, from ``/proc/stat``), and one contended is used for its run and never stored
(:func:`get_profile`). While it runs it says how far it is (:mod:`workers.startup`).

The same ratio measured through vLLM on the device that serves (``python -m workers.calibrate --engine
vllm``) is stored next to it as ``cost-vllm-<dtype>-<device>.json`` (:func:`vllm_profile_path`); this
module only names, writes and reads that file (it knows no engine).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from workers import startup
from workers.cli import one_line_errors
from workers.models.fast import new_cache
from workers.models.pair import FAST_NUMERICS, ModelPair, dtype_tag, fast_path, load_pair

CONTEXT = 128  # the KV length a profile is timed at when no workload names its own (the bench's 0-shot prompts)


@dataclass(frozen=True)
class CostProfile:
    pair: str
    dtype: str
    machine: str
    context: int
    draft_step_s: float  # one draft token (decoder + LM head on one position)
    target_step_s: float  # one target token
    verify_s: dict[str, float]  # target pass over n tokens (n = L+1), LM head on all n
    load_1m: float  # machine load when measured
    # the draft step's LM head: "full", or "proposal-N" (greedy drafting over a proposal vocabulary of N ids,
    # workers.models.proposal, as the CPU engine drafts at T = 0); a stored profile of another kind is remeasured
    draft_head: str = "full"
    # the torch threads it timed with (a sweep's actors run 1 each, a bench both cores: c and v differ), 0 unknown
    threads: int = 0
    # how the fast path's layers ran: "scripted" (workers.models.fast_step) or "eager"; a profile timed otherwise
    # than the engine now runs is measured again
    layers: str = "eager"
    # the fast path's kernel version it timed (workers.models.pair.FAST_NUMERICS; 0 on other dtypes, or a profile
    # older than the field): a step's cost moves with its kernels, so a profile of another version is remeasured
    numerics: int = 0
    # CPUs' worth of other processes' work while the rounds were timed (/proc/stat's busy time less this process's
    # own); -1: not measured (a profile older than the field, or no /proc/stat)
    others_cpu: float = -1.0
    # the machine-and-kernels digest it was timed under (fingerprint()); "" before the field
    fingerprint: str = ""

    @property
    def cost_ratio(self) -> float:
        """c = draft forward / target forward."""
        return self.draft_step_s / self.target_step_s

    def verify_factor(self, draft_len: int) -> float:
        """Cost of a verify pass over L+1 tokens in target-step units (interpolated linearly)."""
        points = sorted((int(n), t) for n, t in self.verify_s.items())
        n = draft_len + 1
        for (n0, t0), (n1, t1) in zip(points, points[1:], strict=False):
            if n0 <= n <= n1:
                return (t0 + (t1 - t0) * (n - n0) / (n1 - n0)) / self.target_step_s
        (n0, t0), (n1, t1) = points[-2], points[-1]
        return (t1 + (t1 - t0) / (n1 - n0) * (n - n1)) / self.target_step_s

    def to_json(self) -> dict:
        return {**asdict(self), "cost_ratio": self.cost_ratio}


def machine_key() -> str:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    slug = re.sub(r"[^a-z0-9]+", "-", model.lower()).strip("-")[:48]
    return f"{slug}-{os.cpu_count()}cpu"


def device_key(count: int = 1) -> str:
    """The device a vLLM calibration ran on: the CUDA device's name and how many were used (the TP
    size), e.g. ``nvidia-h200-x2``; on a machine without CUDA (vLLM-CPU) the CPU's :func:`machine_key`.
    Initializes CUDA in this process: call it after vLLM's engines are stopped."""
    if torch.cuda.is_available():
        slug = re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(0).lower()).strip("-")[:48]
        return f"{slug}-x{count}"
    return machine_key()


def _dtype_tag(dtype: torch.dtype) -> str:
    return dtype_tag(dtype)


def fingerprint_fields(pair: ModelPair) -> dict[str, Any]:
    """What a stored profile of ``pair`` is keyed by beyond its dtype, thread count, layers and context (which name
    its file): the host (CPU model, flags and count, torch, ATen's kernels, transformers; :func:`workers.startup.host`),
    the fast path's kernel version and the draft's head."""
    from workers.models.proposal import head_kind

    return {**startup.host(), "numerics": numerics_of(pair), "draft_head": head_kind(pair)}


def fingerprint(pair: ModelPair) -> str:
    """The machine-and-kernels digest a profile of ``pair`` is stored under (:func:`fingerprint_fields`)."""
    return startup.fingerprint(fingerprint_fields(pair))


def profile_path(pair: ModelPair, threads: int | None = None, layers: str | None = None,
                 context: int = CONTEXT, key: str | None = None) -> Path | None:
    """Where this pair's profile at this dtype, machine and kernels (``key``, default :func:`fingerprint`), thread
    count, layers (default: as they run now) and context is stored."""
    if pair.cache_dir is None:
        return None
    threads = torch.get_num_threads() if threads is None else threads
    layers = layers_kind(pair) if layers is None else layers
    key = fingerprint(pair) if key is None else key
    name = f"cost-{_dtype_tag(pair.dtype)}-{machine_key()}-{key}-{threads}t-{layers}-ctx{int(context)}.json"
    return Path(pair.cache_dir) / name


def numerics_of(pair: ModelPair) -> int:
    """The kernel version a profile of this pair times: ``FAST_NUMERICS`` on the fast path, else 0."""
    return FAST_NUMERICS if fast_path(pair.dtype) else 0


CONTEXT_STEP = 64


def context_bucket(positions: float) -> int:
    """The context a workload averaging ``positions`` KV positions per step is calibrated at: rounded up to a
    multiple of ``CONTEXT_STEP`` (so nearby workloads share one stored profile), at least ``CONTEXT_STEP``."""
    if not positions > 0:
        raise ValueError(f"a calibration context must be a positive number of positions, got {positions!r}")
    return max(CONTEXT_STEP, CONTEXT_STEP * -(-int(positions) // CONTEXT_STEP))


def workload_context(prompt_lengths: list[int], max_new_tokens: int) -> int:
    """The context to calibrate a workload at: the median prompt length plus half of ``max_new_tokens`` (a decode
    step's KV length runs from the prompt's to the prompt's plus what was generated), bucketed."""
    if not prompt_lengths:
        raise ValueError("no prompts to size the calibration context from")
    return context_bucket(statistics.median(prompt_lengths) + max(0, max_new_tokens) / 2)


def layers_kind(pair: ModelPair) -> str:
    """How the pair's layers run now: "scripted" where both models' fast-path decoders will run the scripted
    layers (:meth:`workers.models.fast._Decoder.uses_scripted`), else "eager"."""
    if not fast_path(pair.dtype):
        return "eager"
    uses = [getattr(m.get_decoder(), "uses_scripted", None) for m in (pair.draft, pair.target)]
    return "scripted" if all(u is not None and u() for u in uses) else "eager"


def load_profile(pair: ModelPair, context: int = CONTEXT) -> CostProfile | None:
    path = profile_path(pair, context=context)
    if path is None or not path.is_file():
        return None
    data = json.loads(path.read_text())
    data.pop("cost_ratio", None)
    return CostProfile(**data)


def _interleaved(fns: dict[str, Any], reps: int, warmup: int = 2, on_round: Any = None) -> dict[str, float]:
    """The median seconds of each of ``fns`` over ``reps`` rounds, each round calling every one of them once in turn
    (after ``warmup`` untimed rounds): a slow phase of the machine (another process, reclaim, a page-cache refill
    after loading) lands on every step kind alike instead of on whichever was being timed then. Timed one after
    another, a 1,536-position profile once put the target's one-token step at 114 ms beside a 2-token verify pass
    at 56 ms (a throwaway probe timed the same step at 63 ms a minute later). ``on_round(done, total)`` after each
    round, warm-up ones included."""
    total = warmup + reps
    for i in range(warmup):
        for fn in fns.values():
            fn()
        if on_round is not None:
            on_round(i + 1, total)
    times: dict[str, list[float]] = {k: [] for k in fns}
    for i in range(reps):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
        if on_round is not None:
            on_round(warmup + i + 1, total)
    return {k: statistics.median(v) for k, v in times.items()}


def _busy_s() -> float | None:
    """Seconds of CPU time the whole machine has spent busy (steal included: a VM's host taking the CPU) since boot;
    None without ``/proc/stat``."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 9:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class OthersCPU:
    """CPUs' worth of work other processes did between ``start`` and ``stop``: the machine's busy time less this
    process's own (every thread of it), over the wall time; -1 where it cannot be read."""

    def start(self) -> OthersCPU:
        self.t0, self.busy0, self.own0 = time.perf_counter(), _busy_s(), time.process_time()
        return self

    def stop(self) -> float:
        busy, own, wall = _busy_s(), time.process_time(), time.perf_counter() - self.t0
        if busy is None or self.busy0 is None or wall <= 0:
            return -1.0
        return round(max(0.0, (busy - self.busy0) - (own - self.own0)) / wall, 3)


def _context_cache(model: torch.nn.Module, context: int, prefix: torch.Tensor, g: torch.Generator) -> Any:
    """A KV cache holding ``context`` positions: the fast path's cache filled with random keys and values (what the
    cache holds does not change what a step costs, and a prefill of 1,536 positions is 20-28 s at one thread), any
    other one prefilled with ``prefix``."""
    cache = new_cache(model)
    if _fill(cache, context, g):
        return cache
    model.get_decoder()(input_ids=prefix, past_key_values=cache, use_cache=True)
    return cache


def _fill(cache: Any, context: int, g: torch.Generator) -> bool:
    """Fill a preallocated cache (per layer ``keys``/``values`` [kv_heads, capacity, head_dim], ``length``) with
    ``context`` random positions; False, cache untouched in length, for any cache not of that shape."""
    try:
        keys, values = cache.keys, cache.values
        if not (isinstance(keys, list) and isinstance(values, list) and keys and len(keys) == len(values)
                and isinstance(cache.length, int) and cache.length == 0 and hasattr(cache, "reserve")):
            return False
        cache.reserve(context)
        keys, values = cache.keys, cache.values
        if not all(isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[1] >= context for t in keys + values):
            return False
        for t in keys + values:
            t[:, :context].normal_(generator=g)
        cache.length = context
        return cache.get_seq_length() == context
    except (AttributeError, TypeError, RuntimeError):
        cache.length = 0
        return False


@torch.inference_mode()
def measure(pair: ModelPair, context: int = CONTEXT, reps: int = 15, verify_sizes: tuple[int, ...] = (2, 4, 6, 9),
            warmup: int = 2) -> CostProfile:
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, min(pair.vocab_size, 30_000), (1, context), generator=g)

    from workers.models import proposal as proposals

    proposal = proposals.for_pair(pair)
    where, tag = pair.cache_dir, _dtype_tag(pair.dtype)
    with startup.phase(f"calibrating: a {context:,}-position context for the draft and the target",
                       key=f"calibrate-context-{tag}-{torch.get_num_threads()}t-ctx{context}", where=where):
        caches = {"draft": _context_cache(pair.draft, context, prefix, g),
                  "target": _context_cache(pair.target, context, prefix, g)}

    def step_fn(role: str, n: int, all_positions: bool, head: Any = None):
        model = getattr(pair, role)
        decoder, head = model.get_decoder(), head or model.get_output_embeddings()
        cache = caches[role]  # one per model: each step kind appends, then crops back to the context
        ids = torch.randint(0, min(pair.vocab_size, 1000), (1, n), generator=g)

        def run() -> None:
            hidden = decoder(input_ids=ids, past_key_values=cache, use_cache=True).last_hidden_state
            head(hidden if all_positions else hidden[:, -1:])
            cache.crop(-n)  # back to the same context for the next repetition

        return run

    fns = {"draft": step_fn("draft", 1, False, None if proposal is None else proposal.logits),
           "target": step_fn("target", 1, False), **{str(n): step_fn("target", n, True) for n in verify_sizes}}
    with startup.phase(f"calibrating: timing the draft step, the target step and {len(verify_sizes)} verify passes "
                       f"at {context:,} positions, {warmup + reps} rounds",
                       key=f"calibrate-rounds-{tag}-{torch.get_num_threads()}t-ctx{context}", where=where) as running:
        others = OthersCPU().start()
        times = _interleaved(fns, reps, warmup, on_round=lambda done, total: running.progress(done, total, "rounds"))
        others_cpu = others.stop()
    draft_s, target_s = times.pop("draft"), times.pop("target")
    verify = times
    return CostProfile(pair.name, tag, machine_key(), context, draft_s, target_s, verify,
                       os.getloadavg()[0], proposals.head_kind(pair), torch.get_num_threads(), layers_kind(pair),
                       numerics_of(pair), others_cpu, fingerprint(pair))


def save_profile(pair: ModelPair, profile: CostProfile) -> Path | None:
    path = profile_path(pair, profile.threads or None, profile.layers, profile.context, profile.fingerprint or None)
    if path is None:
        return None
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(profile.to_json(), indent=2) + "\n")
    tmp.replace(path)
    return path


def vllm_profile_path(pair_cache: str | os.PathLike[str], dtype: str, device: str) -> Path:
    """Where ``workers.calibrate --engine vllm`` stores the ratio it measured: with the pair, per dtype
    (``bf16``, ``fp32``) and device (:func:`device_key`)."""
    return Path(pair_cache) / f"cost-vllm-{dtype}-{device}.json"


def write_json(path: str | os.PathLike[str], data: dict) -> Path:
    """Write ``data`` to ``path`` atomically (parent directories made), so a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)
    return path


def read_cost_ratio(path: str | os.PathLike[str]) -> float:
    """The ``cost_ratio`` of a stored profile (either engine's); ValueError naming the file if it has
    none or an impossible one."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not a readable cost profile ({err})") from None
    c = data.get("cost_ratio") if isinstance(data, dict) else None
    if not isinstance(c, (int, float)) or not 0 < c < 100:
        raise ValueError(f"{path}: no valid cost_ratio in it (got {c!r})")
    return float(c)


LOADED = 0.75  # a 1-minute load above this share of the CPUs, before measuring: the machine is busy


def under_load(load_1m: float, cpus: int | None = None) -> bool:
    """Whether a calibration at this load would time contention, not the models."""
    return load_1m > LOADED * (cpus or os.cpu_count() or 1)


OTHERS = 0.25  # other processes' work while the rounds ran, above this share of the CPUs: the calibration is contended


def contended(profile: CostProfile, cpus: int | None = None) -> bool:
    """Whether ``profile`` timed contention: other processes took more than ``OTHERS`` of the CPUs while its rounds ran
    (``others_cpu``). A profile from before that was measured is judged as it was then, by the 1-minute load at its
    start (:func:`under_load`). The load average is not the test any more: it lags by a minute, so a calibration that
    starts right after the pair was converted or loaded (a sweep's actors, or ``make main``'s set-up) read the
    machine's own past work as a busy machine and was never stored."""
    if profile.others_cpu >= 0:
        return profile.others_cpu > OTHERS * (cpus or os.cpu_count() or 1)
    return under_load(profile.load_1m, cpus)


def get_profile(pair: ModelPair, remeasure: bool = False, context: int = CONTEXT) -> CostProfile:
    """The stored profile for this pair, dtype, machine and kernels (:func:`fingerprint`), thread count, layers and
    ``context`` (:func:`workload_context`); measured (and stored) if absent.

    A contended calibration (:func:`contended`: other processes took more than ``OTHERS`` of the CPUs while it was
    timed) is used for this run only (said on stderr and to :mod:`workers.startup`'s listeners) and never stored, so
    the next run measures again: a c timed under contention made the modelled speed disagree with the measured one by
    2-4x, and the contention of one moment says nothing of the next run's. A stored contended one (from before
    ``others_cpu``: judged by its load) is measured again. Stored with its load and ``others_cpu`` either way."""
    if not (isinstance(context, int) and context > 0):
        raise ValueError(f"a calibration context must be a positive number of positions, got {context!r}")
    limit = min(int(getattr(m.config, "max_position_embeddings", 0) or 1 << 30) for m in (pair.draft, pair.target))
    if context + 16 > limit:
        raise ValueError(f"a calibration context of {context} positions does not fit the pair's {limit}")
    profile = None if remeasure else load_profile(pair, context)
    from workers.models.proposal import head_kind

    if profile is not None and profile.draft_head != head_kind(pair):
        startup.warn(f"calibrate: the stored profile timed the draft with a {profile.draft_head} head: measuring again")
        profile = None
    if profile is not None and (profile.threads, profile.layers) != (torch.get_num_threads(), layers_kind(pair)):
        startup.warn(f"calibrate: the stored profile timed {profile.layers} layers at {profile.threads or '?'} "
                     f"threads, this run {layers_kind(pair)} at {torch.get_num_threads()}: measuring again")
        profile = None
    if profile is not None and profile.numerics != numerics_of(pair):
        startup.warn(f"calibrate: the stored profile timed the fast path's kernels version {profile.numerics}, this "
                     f"code runs {numerics_of(pair)}: measuring again")
        profile = None
    if profile is not None and contended(profile):
        startup.warn(f"calibrate: the stored profile was timed under contention (load {profile.load_1m:.2f}, others "
                     f"{profile.others_cpu:.2f} CPUs): measuring again")
        profile = None
    if profile is not None:
        startup.say(f"calibrate: c = {profile.cost_ratio:.3f} at {context:,} positions, stored earlier for this "
                    f"machine and kernels ({profile_path(pair, context=context).name})")
        return profile
    load = os.getloadavg()[0]
    profile = measure(pair, context=context)
    profile = CostProfile(**{**asdict(profile), "load_1m": load})  # the load it was started at
    if contended(profile):
        startup.warn(f"calibrate: measured c = {profile.cost_ratio:.3f} while other processes took "
                     f"{profile.others_cpu:.2f} of {os.cpu_count()} CPUs (load {load:.2f} at the start): used for this "
                     "run, not stored (busy machine); measured again next time")
        return profile
    try:
        path = save_profile(pair, profile)
        startup.say(f"calibrate: c = {profile.cost_ratio:.3f} at {context:,} positions (others took "
                    f"{profile.others_cpu:.2f} CPUs), stored for this machine and kernels: {path}")
    except OSError as err:  # a read-only asset volume (KubeRay pods mount it so): use it unstored
        startup.warn(f"calibrate: measured c = {profile.cost_ratio:.3f}, not stored ({err})")
    return profile


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Measure and store a pair's draft/target cost ratio on this machine.")
    ap.add_argument("--pair", default="qwen2.5-coder-0.5b+1.5b", help="pair name or DRAFT+TARGET (local model directories or hub ids org/name[@revision] from the local Hugging Face cache)")
    ap.add_argument("--dtype", default="bf16", help="bf16, fp32, int8 or int4+int8 (the fast CPU path)")
    ap.add_argument("--cache-dir", default=None, help="asset cache (default: $SPECTUNE_CACHE or ~/.cache/spectune)")
    ap.add_argument("--context", type=int, default=CONTEXT, help="KV-cache length the steps run against")
    ap.add_argument("--reps", type=int, default=15, help="timed repetitions (median reported)")
    args = ap.parse_args(argv)
    with startup.to_stderr("calibrate: "):
        pair = load_pair(args.pair, dtype=args.dtype, cache_dir=args.cache_dir)
        profile = measure(pair, context=args.context, reps=args.reps)
    path = save_profile(pair, profile)
    print(f"pair={profile.pair} dtype={profile.dtype} machine={profile.machine} threads={profile.threads} "
          f"layers={profile.layers} load(1m)={profile.load_1m:.2f} others={profile.others_cpu:.2f} CPUs"
          f"{' (contended: get_profile measures again)' if contended(profile) else ''}")
    print(f"draft step {profile.draft_step_s * 1e3:.1f} ms, target step {profile.target_step_s * 1e3:.1f} ms "
          f"-> c = {profile.cost_ratio:.3f}")
    for n, t in profile.verify_s.items():
        print(f"verify pass over {n} tokens: {t * 1e3:.1f} ms = {t / profile.target_step_s:.2f} target steps")
    print(f"stored: {path}" if path else "not stored (pair has no cache dir)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
