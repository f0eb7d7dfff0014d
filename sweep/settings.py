"""The sweep's settings: its arguments validated (before Ray starts), resolved and typed, and what makes two
invocations the same study.

``parse_settings`` turns ``jobs.sweep_args``' arguments into :class:`Settings` (one-line ValueErrors naming the
flag or key): ``--dtype auto`` resolved to the dtype this machine runs, the vLLM actors' interpreter found, the
budgets, families, knob ranges and draft lengths checked. Its ``args`` are a resolved copy (the caller's are
never written). ``study_name`` is the study's identity (rerunning it resumes the study); ``make_sampler`` the
TPE sampler a (resumed) study uses.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
from dataclasses import dataclass
from typing import Any

from sweep.progress import log
from sweep.space import check_families, search_ranges
from workers.benchmarks import get_benchmark
from workers.cli import require_positive, sampling_settings
from workers.engine_registry import engine_traits
from workers.engines import check_engine
from workers.results.store import slug


@dataclass(frozen=True)
class Settings:
    """A sweep's validated settings: ``args`` (resolved: ``dtype`` is the one chosen, ``vllm_python`` the
    interpreter found) and what was derived from them."""

    args: argparse.Namespace
    bench: Any  # workers.benchmarks.base.Benchmark (or a task file's)
    budgets: list[float]
    families: list[str]
    draft_len: tuple[int, int]  # the search range LO, HI
    enqueue: list[dict[str, Any]]  # the study's parameters of each --enqueue
    ranges: dict[str, dict[str, Any]]  # family -> knob -> its search range
    search_overrides: dict[str, Any] | None  # --search-space as given (part of the study's identity)
    decode: dict[str, Any]  # temperature, seed, shots, max_new_tokens (top_k, top_p, sampler where not the default)

    @property
    def lengths(self) -> list[int]:
        """Every draft length of the search range (lossless runs at each: the fastest lossless)."""
        return list(range(self.draft_len[0], self.draft_len[1] + 1))




def endpoint_settings(args: argparse.Namespace) -> None:
    """``--engine openai``: the server's fields checked (one line each), the pair named by ``--pair-id`` (what the
    ledger and the study key on), the dtype the server's (``server``)."""
    from workers.endpoint import Endpoint, EndpointError

    if not args.base_url or not args.model or not args.pair_id:
        raise ValueError("--engine openai needs --base-url, --model and --pair-id (your name for the server's "
                         "pair and weights: the ledger keys certificates on it)")
    try:
        Endpoint(args.base_url, args.model, api_key_env=args.api_key_env, timeout_s=args.request_timeout,
                 retries=args.retries)
    except EndpointError as err:
        raise ValueError(str(err)) from None
    args.pair, args.dtype = args.pair_id, "server"


SERVER_FLAGS = ("server_config", "reference_url", "reference_model", "reference_config", "extra_body",
                "reference_extra_body")


def server_settings(args: argparse.Namespace) -> None:
    """``--server-config`` (a fixed server configuration certified as one candidate, ``sweep.server``): its JSON
    flags parsed into objects and ``--concurrency`` into levels, one line naming the flag otherwise; the fixed
    configuration's flags refused without it (they would be ignored)."""
    from workers.endpoint_cli import concurrency_values

    given = getattr(args, "server_config", None)
    if given is None:
        extra = [f"--{k.replace('_', '-')}" for k in SERVER_FLAGS if getattr(args, k, None) is not None]
        if extra:
            raise ValueError(f"{', '.join(extra)}: only with --server-config (a fixed server configuration)")
        levels = concurrency_values(getattr(args, "concurrency", "1"))
        if len(levels) > 1:
            raise ValueError(f"--concurrency {args.concurrency}: a sweep times its speed phase at one concurrency")
        from workers.models.pair import auto_dtype, fast_path

        rows = engine_traits(args.engine).batched_rows  # a concurrency timed as the batched engine's rows
        if levels != [1] and rows and not fast_path(auto_dtype() if args.dtype == "auto" else args.dtype):
            raise ValueError(f"--concurrency {args.concurrency}: the cpu engine times a concurrency as its batched rows, "
                             f"on the fast path only (--dtype int8 or int4+int8, not {args.dtype})")
        return
    if not engine_traits(args.engine).needs_server:
        raise ValueError("--server-config goes with --engine openai (a running server)")
    for flag in ("server_config", "reference_config", "extra_body", "reference_extra_body"):
        value = getattr(args, flag)
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"--{flag.replace('_', '-')} must be a JSON object, got {value!r}")
    if not args.server_config:
        raise ValueError("--server-config: state the configuration's settings (a non-empty JSON object): they are "
                         "what the certificate's scope names")
    concurrency_values(args.concurrency)  # one line naming the flag; sweep.server reads the levels


def endpoint_options(args: argparse.Namespace) -> dict[str, Any]:
    """The pair actors' ``workers.endpoint.Endpoint`` fields (``--engine openai``)."""
    return {"base_url": args.base_url, "model": args.model, "api_key_env": args.api_key_env,
            "timeout_s": args.request_timeout, "retries": args.retries}


def parse_settings(given: argparse.Namespace) -> Settings:
    """``given`` (``jobs.sweep_args.parse_args``) validated and resolved; ValueError, one line, naming the flag."""
    args = argparse.Namespace(**vars(given))  # resolved below; the caller's arguments stay as given
    if args.judge_url:
        os.environ["SPECTUNE_JUDGE_URL"] = args.judge_url  # before Ray starts: the actors inherit it
    bench = get_benchmark(args.benchmark)
    from workers.models.pair import auto_dtype, check_pair_name, fast_path

    traits = engine_traits(args.engine)  # what the engine can do (workers.engine_registry)
    if traits.needs_server:
        endpoint_settings(args)
    elif any(getattr(args, k, None) for k in ("base_url", "model", "pair_id")):
        raise ValueError("--base-url, --model and --pair-id go with --engine openai")
    if args.dtype == "auto":
        # resolved once: the dtype is part of the study's and references' identity. The CPU engine's fastest
        # dtype is int8 (the fast CPU path) on x86, resolved here because the actors run on this kind of machine.
        # vLLM runs on the GPU workers, not on this driver (a GPU-less head without bf16 instructions would
        # otherwise pick fp32 for them): bf16, which every GPU since Ampere runs natively.
        if traits.fast_path:
            args.dtype = auto_dtype()
            log(f"--dtype auto: {args.dtype} on this machine")
        else:
            args.dtype = "bf16"
            log("--dtype auto: bf16 for the vLLM engine's GPU workers (a GPU without bf16, e.g. V100 or T4: --dtype fp16)")
    if fast_path(args.dtype) and not traits.fast_path:
        raise ValueError(f"--dtype {args.dtype} is the CPU engine's fast path; --engine {args.engine} runs bf16, fp16 "
                         "or fp32")

    if not traits.needs_server:
        check_pair_name(args.pair)  # fail here, not inside every actor
    try:
        budgets = sorted({float(b) for b in args.budgets.split(",") if b.strip()})
    except ValueError:
        raise ValueError(f"--budgets must be comma-separated numbers, got {args.budgets!r}") from None
    if not budgets or any(not (0 < b < 1) for b in budgets):
        raise ValueError(f"--budgets must be in (0, 1), got {args.budgets!r}")
    gate = getattr(args, "gate", None)
    if gate is not None and not any(math.isclose(gate, b, rel_tol=0, abs_tol=1e-12) for b in budgets):
        raise ValueError(f"--gate {gate:g}: not one of --budgets ({', '.join(f'{b:g}' for b in budgets)}); the gate "
                         "reads a budget this run decides")
    families = check_families([p.strip() for p in args.policies.split(",") if p.strip()])
    ranges = search_ranges(families, getattr(args, "search_space", None))
    if args.draft_len is None:  # the vLLM engine fixes L when it starts: one L per sweep there
        args.draft_len = traits.default_draft_len
        if traits.fixed_draft_len:
            log(f"--draft-len: {args.draft_len} (the vllm engine fixes the draft length when it starts: one "
                "sweep per L; give --draft-len to choose it)")
    try:
        bounds = [int(x) for x in args.draft_len.split(",")]
    except ValueError:
        raise ValueError(f"--draft-len must be LO,HI integers, got {args.draft_len!r}") from None
    lo, hi = (bounds[0], bounds[-1])
    if not (1 <= lo <= hi <= 16):
        raise ValueError(f"--draft-len must be LO,HI with 1 <= LO <= HI <= 16, got {args.draft_len!r}")
    enqueued = [enqueued_params(text, families, (lo, hi)) for text in args.enqueue]
    if args.kv_cache_gb is not None and not args.kv_cache_gb > 0:
        raise ValueError(f"--kv-cache-gb must be > 0, got {args.kv_cache_gb}")
    from workers.cli import parse_batch_size

    args.batch_size = parse_batch_size(getattr(args, "batch_size", 1))
    check_engine(args.engine, draft_lens=(lo, hi), tensor_parallel_size=args.tensor_parallel_size,
                 vllm=vllm_options(args))
    if traits.own_interpreter:
        from workers.engines import vllm_python

        args.vllm_python = vllm_python(args.vllm_python)
    server_settings(args)
    if traits.needs_server and args.cost_ratio is None and args.server_config is None:
        raise ValueError("--engine openai needs --cost-ratio: a server's draft and target steps cannot be timed apart "
                         "from outside (measure c where the pair runs, or take it from the server's logs)")
    if not traits.needs_server and not traits.measures_cost and args.cost_ratio is None:
        raise ValueError("--engine vllm needs --cost-ratio: vLLM does not time draft and target steps apart "
                         "(measure c through vLLM with `python -m workers.calibrate --engine vllm --pair ...`, or from your serving logs)")
    require_positive(args, "trials", "min_items_to_prune", "confirm_candidates", "looks")
    if args.items < 0:
        raise ValueError("--items must be >= 0 (0 = all)")
    if args.confirm_items is not None and args.confirm_items < 0:
        raise ValueError("--confirm-items must be >= 0 (0 = all)")
    if args.speed_items < 0:
        raise ValueError("--speed-items must be >= 0 (0: no timed run)")
    if getattr(args, "verify_factor", None) is not None and not args.verify_factor > 0:
        raise ValueError(f"--verify-factor must be > 0, got {args.verify_factor}")
    if not 0 < args.alpha < 0.5:
        raise ValueError(f"--alpha must be in (0, 0.5), got {args.alpha}")
    return Settings(args=args, bench=bench, budgets=budgets, families=families, draft_len=(lo, hi), enqueue=enqueued,
                    ranges=ranges, search_overrides=getattr(args, "search_space", None) or None,
                    decode=dict(temperature=args.temperature, seed=args.seed, shots=args.shots,
                                max_new_tokens=args.max_new_tokens or bench.default_max_new_tokens,
                                **sampling_settings(args)))



def enqueued_params(text: str, families: list[str], draft_len: tuple[int, int]) -> dict[str, Any]:
    """``--enqueue`` text -> the study's parameter names (``family``, ``<family>.<knob>``, ``draft_len``)."""
    from policies import get_spec, make_policy
    from workers.cli import parse_rule

    name, params = parse_rule(text)
    if name not in families:
        raise ValueError(f"--enqueue {text!r}: {name!r} is not among the searched --policies {families}")
    length = params.pop("draft_len", draft_len[0])
    if not (isinstance(length, int) and draft_len[0] <= length <= draft_len[1]):
        raise ValueError(f"--enqueue {text!r}: draft_len must be an integer in --draft-len {draft_len[0]},{draft_len[1]}")
    config = make_policy(name, **params).config.to_dict()  # unknown knobs / bad values fail here
    out: dict[str, Any] = {"family": name} if len(families) > 1 else {}
    out.update({f"{name}.{knob}": config[knob] for knob in get_spec(name).config_cls.search_space()})
    if draft_len[1] > draft_len[0]:
        out["draft_len"] = length
    return out


def make_sampler(seed: int, existing_trials: int, trials: int) -> Any:
    """TPE over the families' knobs. A resumed study gets its seed offset by the trials it holds: the
    same seed would replay the first random suggestions (seen: two duplicate trials after a restart)."""
    import optuna

    return optuna.samplers.TPESampler(seed=seed + existing_trials, multivariate=True, group=True,
                                      n_startup_trials=max(4, min(10, trials // 2)))


def vllm_options(args: argparse.Namespace) -> dict[str, Any]:
    """The VLLMSettings fields given on the command line (the rest keep their defaults)."""
    given = {"gpu_memory_utilization": args.gpu_memory_utilization, "max_model_len": args.max_model_len,
             "enforce_eager": args.enforce_eager or None, "max_num_seqs": getattr(args, "max_num_seqs", None),
             "kv_cache_memory_bytes": None if args.kv_cache_gb is None else int(args.kv_cache_gb * 2**30)}
    return {k: v for k, v in given.items() if v is not None}


# how the confirmation pool is made (see sweep.state): its order is fixed by a salted hash, never by a seed
POOL = "held-apart: confirm split + unused search rows, in sha256('confirm/' + id) order; items per the ledger"


def study_name(s: Settings) -> str:
    """The study's name: the benchmark, pair, dtype and items, and a digest of everything that changes what is
    certified."""
    args = s.args
    # everything that changes what is certified: rerunning with any of it changed is another study (its own
    # run directory), never an overwrite of this one's certificates. --trials is not: a rerun with more trials
    # extends the search; a second confirmation of a budget is then caught by workers.results.ledger
    key = json.dumps({"families": s.families, "budgets": s.budgets, "draft_len": s.draft_len,
                      "decode": s.decode, "objective": args.objective, "cost_ratio": args.cost_ratio,
                      "subset_seed": args.subset_seed, "split": s.bench.split_info(), "pool": POOL,
                      "confirm_items": args.confirm_items, "alpha": args.alpha, "joint": args.joint,
                      "confirm_candidates": args.confirm_candidates,
                      **({"looks": args.looks} if args.looks != 1 else {}),
                      **({"verify_factor": args.verify_factor} if getattr(args, "verify_factor", None) else {}),
                      **({"search": s.search_overrides} if s.search_overrides else {}),
                      **({"engine": args.engine} if not engine_traits(args.engine).reference else {}),
                      **({"endpoint": [args.base_url, args.model]} if engine_traits(args.engine).needs_server else {})},
                     sort_keys=True)
    digest = hashlib.sha1(key.encode()).hexdigest()[:8]
    return slug(f"{args.benchmark}-{args.pair}-{args.dtype}-n{args.items}-{digest}")




def ledger_of(settings: Settings) -> Any:
    """The certificate ledger of the sweep's benchmark and pair (``workers.results.ledger.AttemptLedger``) at
    ``--ledger`` (a SQLAlchemy URL or a folder; default ``$SPECTUNE_LEDGER``, else the asset cache's). A server's
    weights are not here to fingerprint: the ledger keys on the pair id its user states."""
    from workers.results.ledger import ledger_for

    args = settings.args
    server = engine_traits(args.engine).needs_server
    return ledger_for(settings.bench, None if server else args.pair, args.pair_id if server else None,
                      getattr(args, "ledger", None))


def family_line(settings: Settings) -> str:
    """What the next confirmation attempt of this benchmark and pair gets, before any item is spent."""
    from workers.certify.family import family_alpha

    args = settings.args
    stated = args.alpha / len(settings.budgets) if args.joint else args.alpha
    server = engine_traits(args.engine).needs_server
    ledger = ledger_of(settings)
    k = ledger.next_number()
    return (f"certificate ledger {ledger.path}: {k - 1} earlier attempt(s) on this benchmark and pair; a new "
            f"confirmation attempt would be #{k} of the family, each budget tested at {stated:g} x 2^-{k} = "
            f"{family_alpha(stated, k):.4g} (a resumed attempt keeps its own number; `python -m jobs.plan "
            f"--benchmark {settings.bench.name} --pair {'...' if server else args.pair}` gives the "
            f"items that level needs)")
