"""The sweep's command line: flags, their validation and the study's identity.

``build_parser`` / ``parse_settings`` turn arguments into validated settings (one-line errors
naming the flag, before Ray starts); ``study_name`` is what makes two invocations the same study
(rerunning resumes it); ``make_sampler`` the TPE sampler a (resumed) study uses. ``jobs.sweep``
runs what these describe.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from typing import Any

from jobs.records import slug
from jobs.search_space import DEFAULT_FAMILIES, check_families
from workers.benchmarks import BENCHMARKS, get_benchmark
from workers.cli import require_positive
from workers.engines import ENGINES, check_engine


def subset_seed(text: str) -> int | None:
    """``--subset-seed``: an integer seed (seeded item order) or ``file`` (the benchmark file's order)."""
    if text.strip().lower() == "file":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer seed or 'file', got {text!r}") from None


def load_config(path: str, ap: argparse.ArgumentParser) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """A sweep config file: the flags' values by name (``budgets: [0.02, 0.05]`` or ``confirm-items: 300``)
    plus an optional ``search:`` block of knob ranges (``jobs.search_space.search_ranges``). Returns
    (parser defaults, search overrides); ValueError naming the file and the key otherwise."""
    import yaml

    try:
        data = yaml.safe_load(open(path).read()) or {}
    except OSError as err:
        raise ValueError(f"--config {path}: cannot read it ({err.strerror})") from None
    except yaml.YAMLError as err:
        raise ValueError(f"--config {path}: not valid YAML ({str(err).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: must be a mapping of flag: value")
    actions = {a.dest: a for a in ap._actions if a.dest not in ("help", "config")}
    defaults: dict[str, Any] = {}
    search = data.pop("search", None)
    if "search_space" in data:  # the name other tools use for the same block
        if search is not None:
            raise ValueError(f"--config {path}: give search or search_space, not both")
        search = data.pop("search_space")
    for key, value in data.items():
        dest = str(key).replace("-", "_")
        action = actions.get(dest)
        if action is None:
            raise ValueError(f"--config {path}: {key}: unknown key; valid: search, {', '.join(sorted(actions))}")
        if isinstance(action, argparse._StoreTrueAction):
            if not isinstance(value, bool):
                raise ValueError(f"--config {path}: {key}: must be true or false, got {value!r}")
        elif isinstance(action, argparse._AppendAction):
            value = [str(v) for v in (value if isinstance(value, list) else [value])]
        else:
            if isinstance(value, list):
                value = ",".join(str(v) for v in value)
            if value is not None and action.type is not None:
                try:
                    value = action.type(str(value))
                except (ValueError, argparse.ArgumentTypeError):
                    kind = getattr(action.type, "__name__", "value")
                    raise ValueError(f"--config {path}: {key}: invalid {kind} value {value!r}") from None
        defaults[dest] = value
    if search is not None and not isinstance(search, dict):
        raise ValueError(f"--config {path}: search: expected a mapping of rule: {{knob: range}}, got {search!r}")
    return defaults, search


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, over a ``--config`` file's values where one is given (the command line wins)."""
    ap = build_parser()
    pre, _ = ap.parse_known_args(argv)
    search = None
    if pre.config:
        defaults, search = load_config(pre.config, ap)
        ap.set_defaults(**defaults)
    args = ap.parse_args(argv)
    args.search = search
    return args


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description="Calibrate lossy acceptance rules under quality budgets (Ray + Optuna + MLflow).")
    ap.add_argument("--config", default=None,
                    help="a YAML file of these flags' values (keys as the flags, e.g. confirm-items: 300) and an "
                         "optional search: block of knob ranges; flags given on the command line win (docs/sweep-config.md)")
    ap.add_argument("--benchmark", default="gsm8k", help=f"one of {sorted(BENCHMARKS)}, or a task file PATH.yaml (docs/tasks.md)")
    ap.add_argument("--pair", default="qwen2.5-coder-0.5b+1.5b", help="pair name (tiny-random for tests) or DRAFT+TARGET (local model directories or hub ids org/name[@revision] from the local Hugging Face cache)")
    ap.add_argument("--dtype", default="auto",
                    help="bf16, fp32 or auto (bf16 where the CPU has bf16 instructions or on a GPU, else fp32)")
    ap.add_argument("--judge-url", default=None,
                    help="a task file's judge scorer: the OpenAI-compatible base url (overrides judge.url; sets SPECTUNE_JUDGE_URL)")
    ap.add_argument("--budgets", default="0.01,0.02,0.05", help="accuracy-drop budgets, comma separated")
    ap.add_argument("--policies", default=",".join(DEFAULT_FAMILIES), help="rule families to search")
    ap.add_argument("--trials", type=int, default=16, help="total trials (finished + pruned) the study should reach")
    ap.add_argument("--items", type=int, default=40, help="search-split items per trial (0 = all)")
    ap.add_argument("--confirm-items", type=int, default=None,
                    help="items that certify a budget, the first N of the held-apart pool (the confirmation split "
                         "plus the search-split items the search did not use; default: --items; 0 = the whole pool)")
    ap.add_argument("--joint", action="store_true",
                    help="one family-wise statement across budgets: each budget confirmed at alpha / (number of "
                         "budgets) (Bonferroni), so P(any certified budget is wrong) <= alpha; default: per budget")
    ap.add_argument("--looks", type=int, default=1,
                    help="group-sequential confirmation: looks at 1/K, 2/K, ... of --confirm-items; each look's region "
                         "is calibrated exactly so the error spent by look k stays within alpha * (k/K)^2; a candidate "
                         "that certifies at a look stops there (default 1: one look at the whole set)")
    ap.add_argument("--search-only", action="store_true",
                    help="stop after the search (report written, nothing confirmed); the same command without it "
                         "resumes and confirms")
    ap.add_argument("--skip-noise-floor", action="store_true",
                    help="do not run lossless on the confirmation items (the noise-floor row: an arm as long as the "
                         "candidate's; certificates do not depend on it)")
    ap.add_argument("--confirm-candidates", type=int, default=3,
                    help="candidates per budget confirmed at most (fixed sequence, safest first)")
    ap.add_argument("--alpha", type=float, default=0.05, help="one-sided error level of every certificate")
    ap.add_argument("--subset-seed", type=subset_seed, default=0,
                    help="seeded item order before --items cuts it; 'file' = the file's order (first N items)")
    ap.add_argument("--draft-len", default="3,8", help="draft length search range LO,HI (or one value)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0, help="sampling seed and Optuna sampler seed")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default: the benchmark's own")
    ap.add_argument("--shots", type=int, default=0)
    ap.add_argument("--objective", choices=("vs-ar", "vs-lossless"), default="vs-ar", help="which modelled speedup to maximize")
    ap.add_argument("--cost-ratio", type=float, default=None, help="deployment c for modelled speedup (default: measured)")
    ap.add_argument("--actors", type=int, default=None, help="pair actors (default: sized to the cluster's memory/CPUs)")
    ap.add_argument("--cpus-per-actor", type=float, default=1)
    ap.add_argument("--gpus-per-actor", type=float, default=0)
    ap.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs per pair (vLLM engine)")
    ap.add_argument("--engine", choices=ENGINES, default="cpu",
                    help="cpu: transformers reference engine; vllm: vLLM with spectune's rules inside (GPU nodes)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=None,
                    help="vLLM: fraction of each GPU for weights + KV cache (default 0.85)")
    ap.add_argument("--max-model-len", type=int, default=None, help="vLLM: context length to plan for (default 4096)")
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="vLLM: requests decoded at once (default vLLM's); lower it when a large shard's batch runs "
                         "out of memory (the rules' full-vocabulary rows grow with it)")
    ap.add_argument("--enforce-eager", action="store_true", help="vLLM: no CUDA graphs (faster start, slower steps)")
    ap.add_argument("--kv-cache-gb", type=float, default=None,
                    help="vLLM: KV cache per engine in GiB (overrides the memory fraction; vLLM-CPU: size it, "
                         "the fraction counts the worker's own memory)")
    ap.add_argument("--vllm-python", default=None,
                    help="vLLM: the interpreter of the pair actors (default $SPECTUNE_VLLM_PYTHON, this one if it "
                         "imports vllm, else the checkout's .vllm-venv)")
    ap.add_argument("--actor-memory-gb", type=float, default=8.0, help="memory to plan per actor (bf16 real pair: ~7)")
    ap.add_argument("--min-items-to-prune", type=int, default=8, help="paired items needed before early stopping")
    ap.add_argument("--enqueue", action="append", default=[], metavar="RULE",
                    help="evaluate these settings first, e.g. dropmatch:k=5,p_drop=0.3,criterion=js "
                         "(repeatable; knobs not given take the rule's defaults; skipped if already in the study)")
    ap.add_argument("--trial-timeout", type=float, default=None,
                    help="seconds a search trial may run; its items not done by then are left out of that trial's "
                         "search figures (not retried). References and confirmation runs never time out")
    ap.add_argument("--address", default=None, help="Ray address (default: RAY_ADDRESS, else a local Ray)")
    ap.add_argument("--runs-root", default=None,
                    help="default $SPECTUNE_RUNS, else ./runs; in a Ray job $SPECTUNE_RUNS on the head "
                         "(scripts/ray-head: the checkout's runs/), else ~/spectune_runs")
    ap.add_argument("--run-dir", default=None, help="default <runs-root>/sweeps/<study name>")
    return ap


def parse_settings(args: argparse.Namespace) -> dict[str, Any]:
    if args.judge_url:
        os.environ["SPECTUNE_JUDGE_URL"] = args.judge_url  # before Ray starts: the actors inherit it
    bench = get_benchmark(args.benchmark)
    from workers.models.pair import check_pair_name, native_dtype

    if args.dtype == "auto":
        args.dtype = native_dtype()  # resolved once: the dtype is part of the study's and references' identity
        log(f"--dtype auto: {args.dtype} on this machine")

    check_pair_name(args.pair)  # fail here, not inside every actor
    try:
        budgets = sorted({float(b) for b in args.budgets.split(",") if b.strip()})
    except ValueError:
        raise ValueError(f"--budgets must be comma-separated numbers, got {args.budgets!r}") from None
    if not budgets or any(not (0 < b < 1) for b in budgets):
        raise ValueError(f"--budgets must be in (0, 1), got {args.budgets!r}")
    families = check_families([p.strip() for p in args.policies.split(",") if p.strip()])
    from jobs.search_space import search_ranges

    ranges = search_ranges(families, getattr(args, "search", None))
    bounds = [int(x) for x in args.draft_len.split(",")]
    lo, hi = (bounds[0], bounds[-1])
    if not (1 <= lo <= hi <= 16):
        raise ValueError(f"--draft-len must be LO,HI with 1 <= LO <= HI <= 16, got {args.draft_len!r}")
    enqueued = [enqueued_params(text, families, (lo, hi)) for text in args.enqueue]
    if args.kv_cache_gb is not None and not args.kv_cache_gb > 0:
        raise ValueError(f"--kv-cache-gb must be > 0, got {args.kv_cache_gb}")
    check_engine(args.engine, draft_lens=(lo, hi), tensor_parallel_size=args.tensor_parallel_size,
                 vllm=vllm_options(args))
    if args.engine == "vllm":
        from workers.engines import vllm_python

        args.vllm_python = vllm_python(args.vllm_python)
    if args.engine == "vllm" and args.cost_ratio is None:
        raise ValueError("--engine vllm needs --cost-ratio: vLLM does not time draft and target steps apart "
                         "(measure c with `python -m workers.models.calibrate` or from your serving logs)")
    require_positive(args, "trials", "min_items_to_prune", "confirm_candidates", "looks")
    if args.items < 0:
        raise ValueError("--items must be >= 0 (0 = all)")
    if args.confirm_items is not None and args.confirm_items < 0:
        raise ValueError("--confirm-items must be >= 0 (0 = all)")
    if not 0 < args.alpha < 0.5:
        raise ValueError(f"--alpha must be in (0, 0.5), got {args.alpha}")
    return {"bench": bench, "budgets": budgets, "families": families, "draft_len": (lo, hi), "enqueue": enqueued,
            "ranges": ranges, "search_overrides": getattr(args, "search", None) or None,
            "decode": dict(temperature=args.temperature, seed=args.seed, shots=args.shots,
                           max_new_tokens=args.max_new_tokens or bench.default_max_new_tokens)}


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


POOL = "held-apart: confirm split + unused search rows"  # how the confirmation pool is made (see jobs.sweep)


def study_name(args: argparse.Namespace, s: dict[str, Any]) -> str:
    # everything that changes what is certified: rerunning with any of it changed is another study (its own
    # run directory), never an overwrite of this one's certificates. --trials is not: a rerun with more trials
    # extends the search; a second confirmation of a budget is then caught by jobs.attempts
    key = json.dumps({"families": s["families"], "budgets": s["budgets"], "draft_len": s["draft_len"],
                      "decode": s["decode"], "objective": args.objective, "cost_ratio": args.cost_ratio,
                      "subset_seed": args.subset_seed, "split": s["bench"].split_info(), "pool": POOL,
                      "confirm_items": args.confirm_items, "alpha": args.alpha, "joint": args.joint,
                      "confirm_candidates": args.confirm_candidates,
                      **({"looks": args.looks} if args.looks != 1 else {}),
                      **({"search": s["search_overrides"]} if s.get("search_overrides") else {}),
                      **({"engine": args.engine} if args.engine != "cpu" else {})}, sort_keys=True)
    digest = hashlib.sha1(key.encode()).hexdigest()[:8]
    return slug(f"{args.benchmark}-{args.pair}-{args.dtype}-n{args.items}-{digest}")


def log(msg: str) -> None:
    print(f"[sweep {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)
