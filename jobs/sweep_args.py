"""The sweep's command line: its flags and how a config file sets them.

``build_parser`` is a jsonargparse parser: every flag is also a key of a ``--config`` YAML file
(docs/sweep-config.md), with a ``search_space:`` block of knob ranges. ``parse_args`` turns the command
line into arguments (one-line errors naming the flag or key); ``sweep.settings.parse_settings`` validates
them before Ray starts; ``effective_config`` is the merged options as YAML (the run directory's
``config.yaml``). ``jobs.sweep`` runs what these describe.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import jsonargparse
import yaml

from sweep.space import DEFAULT_FAMILIES
from workers.benchmarks import BENCHMARKS
from workers.engine_registry import engine_names


class _ValueError(argparse.ArgumentTypeError, ValueError):
    """A bad value: argparse shows its message for a flag, jsonargparse names the config key."""


def subset_seed(text: Any) -> int | None:
    """``--subset-seed``: an integer seed (seeded item order) or ``file`` (the benchmark file's order)."""
    if text is None or (isinstance(text, int) and not isinstance(text, bool)):
        return text  # a config file's (or a dumped config's) value, already resolved
    if isinstance(text, str):
        if text.strip().lower() == "file":
            return None
        try:
            return int(text)
        except ValueError:
            pass
    raise _ValueError(f"expected an integer seed or 'file', got {text!r}")


def comma_list(value: Any) -> str:
    """A comma-separated flag (``--budgets``, ``--policies``, ``--draft-len``): a config file may give a
    YAML list or one number instead; the value is the comma-separated text either way."""
    if isinstance(value, list | tuple):
        value = ",".join(str(v) for v in value)
    elif isinstance(value, int | float) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        raise _ValueError(f"expected a comma-separated list (or a YAML list), got {value!r}")
    return value


def json_object(value: Any) -> dict[str, Any] | None:
    """A JSON-object flag (``--server-config``, ``--extra-body``, ...): a JSON text on the command line, a mapping in
    a config file; anything else is one line saying what was wrong (not jsonargparse's list of Union subtypes)."""
    import json

    if value is None or isinstance(value, dict):
        return value
    if not isinstance(value, str):
        raise _ValueError(f"expected a JSON object such as '{{\"key\": 1}}', got {value!r}")
    try:
        got = json.loads(value)
    except ValueError as err:
        raise _ValueError(f"not valid JSON ({err}): {value[:80]!r}; write a JSON object in single quotes, e.g. "
                          "'{\"rejection_sample_method\": \"fly\"}'") from None
    if not isinstance(got, dict):
        raise _ValueError(f"expected a JSON object ({{...}}), got {type(got).__name__} {value[:80]!r}")
    return got


def rules(value: Any) -> list[str]:
    """``--enqueue``: one rule per flag on the command line; in a config file one rule or a list."""
    items = list(value) if isinstance(value, list | tuple) else [value]
    if not all(isinstance(v, str) for v in items):
        raise _ValueError(f"expected a rule such as kl_judge:threshold=0.5 or a list of them, got {value!r}")
    return items


class _AppendRules(argparse._AppendAction):
    """Repeatable ``--enqueue``: each flag adds its rule to those given so far (a config file's too)."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, [*(getattr(namespace, self.dest, None) or []), *values])


# what --help says a flag of these types takes (jsonargparse would print the function itself, <function ... at 0x...>)
TYPE_NAMES: tuple[tuple[Any, str], ...] = (
    (comma_list, "comma-separated list"), (subset_seed, "int or 'file'"), (rules, "rule[:knob=value,...]"),
    (json_object, "JSON object"))


class HelpFormatter(jsonargparse.DefaultHelpFormatter):
    """jsonargparse's help, with a type a person can read beside every flag: jsonargparse prints a ``type``
    function as itself (``<function comma_list at 0x...>``), and a flag with ``choices`` as its own wrapper."""

    def _get_type_str(self, action: argparse.Action) -> str | None:  # jsonargparse's "type: ..." of a flag
        name = next((text for func, text in TYPE_NAMES if action.type is func), None)
        if name is not None:
            return name
        if action.choices is not None:  # the choices are shown too: {a,b,c}
            return " | ".join(sorted({type(c).__name__ for c in action.choices}))
        text = super()._get_type_str(action)
        if text is not None and text.startswith("<"):  # any other function or class: its name, else nothing
            name = getattr(action.type, "__name__", "")
            return name if name.isidentifier() else None
        return text


class SweepParser(jsonargparse.ArgumentParser):
    """jsonargparse's parser, returning a plain ``argparse.Namespace``: jsonargparse's own Namespace has
    an ``items()`` method, which would hide the ``--items`` option (``args.items``); its help says each
    flag's type in words (:class:`HelpFormatter`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def parse_args(self, *args: Any, **kwargs: Any) -> argparse.Namespace:  # type: ignore[override]
        return super().parse_args(*args, **kwargs).as_flat()


def one_line(message: str) -> str:
    return " ".join(str(message).split())


def check_config_keys(ap: argparse.ArgumentParser, argv: list[str]) -> None:
    """A config file that names one option twice (``search:`` and ``search_space:``, or ``confirm-items:`` and
    ``confirm_items:``) is refused, naming both keys: jsonargparse would keep whichever came last, silently."""
    spellings: dict[str, str] = {}
    for action in ap._actions:
        for opt in action.option_strings:
            if opt.startswith("--"):
                spellings[opt[2:]] = spellings[opt[2:].replace("-", "_")] = action.dest
    for i, arg in enumerate(argv):
        path = arg.split("=", 1)[1] if arg.startswith("--config=") else (
            argv[i + 1] if arg == "--config" and i + 1 < len(argv) else None)
        if path is None or not Path(path).is_file():
            continue  # not a file (jsonargparse also takes inline YAML, and names a missing file itself)
        try:
            data = yaml.safe_load(Path(path).read_text())
        except yaml.YAMLError:
            continue  # jsonargparse names the parse error
        seen: dict[str, str] = {}
        for key in data if isinstance(data, dict) else ():
            dest = spellings.get(str(key))
            if dest is not None and dest in seen:
                raise ValueError(f"{path}: {seen[dest]!r} and {key!r} are the same option; give it once")
            if dest is not None:
                seen[dest] = str(key)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line through jsonargparse: ``--config FILE`` sets options from a YAML file, applied
    where it stands, so flags after it override it (docs/sweep-config.md). ValueError, one line naming
    the flag or the config key, when something is wrong."""
    ap = build_parser()
    ap.exit_on_error = False
    check_config_keys(ap, list(sys.argv[1:] if argv is None else argv))
    try:
        return ap.parse_args(argv)
    except argparse.ArgumentError as err:
        raise ValueError(one_line(str(err))) from None


def effective_config(args: argparse.Namespace) -> str:
    """Every option, after the config files and the flags are merged (and as ``parse_settings``
    resolved them: ``--dtype auto`` is the dtype it chose), as YAML: ``--config`` it to rerun."""
    return build_parser().dump(jsonargparse.Namespace(**vars(args)), skip_unset=False)


def build_parser() -> SweepParser:
    """The sweep's options (a ``jsonargparse.ArgumentParser``, an argparse subclass): each flag is also a
    config key (``confirm-items`` or ``confirm_items``); ``--print_config`` prints the merged options."""
    ap = SweepParser(description="Calibrate lossy acceptance rules under quality budgets (Ray + Optuna + MLflow).",
                        default_env=False)  # options from flags and files only, never the environment
    ap.add_argument("--config", action=jsonargparse.ActionConfigFile,
                    help="a YAML file of these options (keys as the flags, e.g. confirm-items: 300, and a "
                         "search_space: block of knob ranges), applied where it stands: give it first, flags after "
                         "it override it (docs/sweep-config.md)")
    ap.add_argument("--benchmark", type=str, default="gsm8k", help=f"one of {sorted(BENCHMARKS)}, or a task file PATH.yaml (docs/tasks.md)")
    ap.add_argument("--pair", type=str, default="qwen2.5-coder-0.5b+1.5b", help="pair name (tiny-random for tests) or DRAFT+TARGET (local model directories or hub ids org/name[@revision] from the local Hugging Face cache)")
    ap.add_argument("--dtype", type=str, default="auto",
                    help="bf16, fp32, int8 (the CPU engine's fast path: int8 weights, activations quantized per "
                         "token), int4+int8 (the same target with a 4-bit draft) or auto (the CPU engine: int4+int8 "
                         "where ATen runs AVX-512 kernels, else int8 on an x86 CPU; vLLM: bf16 where the CPU has "
                         "bf16 instructions or on a GPU, else fp32)")
    ap.add_argument("--judge-url", type=str | None, default=None,
                    help="a task file's judge scorer: the OpenAI-compatible base url (overrides judge.url; sets SPECTUNE_JUDGE_URL)")
    ap.add_argument("--budgets", type=comma_list, default="0.01,0.02,0.05", help="accuracy-drop budgets, comma separated")
    ap.add_argument("--gate", type=float | None, default=None, metavar="BUDGET",
                    help="one of --budgets: the run's exit code is that budget's verdict, for a deployment's CI: 0 "
                         "certified, 10 refuted (the drop shown above it), 11 undecided (2 bad input, 3 knobs not "
                         "applied, as without it); without --gate a finished run exits 0")
    ap.add_argument("--policies", type=comma_list, default=",".join(DEFAULT_FAMILIES), help="rule families to search")
    ap.add_argument("--trials", type=int, default=32, help="total trials (finished + pruned) the study should reach "
                    "(default 32: enough to rank the families against each other)")
    ap.add_argument("--items", type=int, default=200, help="search-split items per trial (0 = all; default 200: a few "
                    "discordant items in tens cannot rank rules; replay makes hundreds affordable at T = 0)")
    ap.add_argument("--confirm-items", type=int | None, default=None,
                    help="items that certify a budget, the first N of the held-apart pool (the confirmation split "
                         "plus the search-split items the search did not use; default: --items; 0 = the whole pool)")
    ap.add_argument("--joint", type=bool, nargs="?", const=True, default=False,
                    help="one family-wise statement across budgets: each budget confirmed at alpha / (number of "
                         "budgets) (Bonferroni), so P(any certified budget is wrong) <= alpha; default: per budget")
    ap.add_argument("--looks", type=int, default=1,
                    help="group-sequential confirmation: looks at 1/K, 2/K, ... of --confirm-items; each look's region "
                         "is calibrated exactly so the error spent by look k stays within alpha * (k/K)^2; a candidate "
                         "that certifies at a look stops there (default 1: one look at the whole set)")
    ap.add_argument("--search-only", type=bool, nargs="?", const=True, default=False,
                    help="stop after the search (report written, nothing confirmed); the same command without it "
                         "resumes and confirms (give --confirm-items now: it is part of the study's identity)")
    ap.add_argument("--skip-noise-floor", type=bool, nargs="?", const=True, default=False,
                    help="do not run lossless on the confirmation items (the noise-floor row: an arm as long as the "
                         "candidate's; certificates do not depend on it)")
    ap.add_argument("--new-items", type=bool, nargs="?", const=True, default=False,
                    help="confirm on the first items of the pool's fixed order that no earlier attempt on this pair and "
                         "benchmark used (the ledger refuses a new attempt on used items otherwise); the certificate "
                         "lists the earlier attempts")
    ap.add_argument("--confirm-candidates", type=int, default=3,
                    help="candidates per budget confirmed at most (fixed sequence, safest first)")
    ap.add_argument("--alpha", type=float, default=0.05, help="one-sided error level of every certificate")
    ap.add_argument("--subset-seed", type=subset_seed, default=0,
                    help="seeded item order before --items cuts it; 'file' = the file's order (first N items)")
    ap.add_argument("--draft-len", type=comma_list, default=None,
                    help="draft length search range LO,HI (or one value); the best lossless is sought over it too "
                         "(default 1,12 on the CPU engine; 5 on vLLM, which fixes L when it starts: one sweep per L)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0,
                    help="nucleus sampling at T > 0: every arm (target-only, lossless, each rule) samples the "
                         "target's distribution cut to this mass, and the rules judge that distribution "
                         "(1: off; Qwen2.5 recommends T 0.7, top-p 0.8, top-k 20)")
    ap.add_argument("--top-k", type=int, default=0, help="top-k sampling at T > 0, as --top-p (0: off)")
    ap.add_argument("--sampler", default="standard",
                    help="standard, or coupled (T > 0, CPU engine): every arm draws token t by Gumbel-max with noise "
                         "keyed by --seed, the item and t, so lossless output equals target-only's, a lossy rule is "
                         "the only source of a difference, and rules replay from one pass per item as at T = 0; the "
                         "search's modelled speeds are the coupled sampler's (it accepts less than the standard one), "
                         "and a certificate's timed speed is the standard sampler's")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed and Optuna sampler seed")
    ap.add_argument("--max-new-tokens", type=int | None, default=None, help="default: the benchmark's own")
    ap.add_argument("--shots", type=int, default=0)
    ap.add_argument("--objective", type=str, choices=("vs-best-lossless", "vs-ar", "vs-lossless"), default="vs-best-lossless",
                    help="which modelled speedup to maximize: over lossless at its fastest L in --draft-len's range on the "
                         "same items (default), over target-only, or over lossless at the trial's own L; all three are "
                         "reported")
    ap.add_argument("--speed-items", type=int, default=8,
                    help="per chosen candidate, time this many of its confirmation items like for like: target-only, "
                         "lossless at the best L and the candidate, each decoded in full, one after another per item "
                         "on one actor (0: modelled speed only)")
    ap.add_argument("--replay", type=str, choices=("auto", "off"), default="auto",
                    help="auto: at T = 0 on the CPU engine, replay each rule from the target-only output (decoding "
                         "only from the round that leaves it): the search in every dtype, confirmation only on int8 at one thread per actor, "
                         "where replay equals full decoding by construction; off: decode every item in full")
    ap.add_argument("--cost-ratio", type=float | None, default=None, help="deployment c for modelled speedup (default: measured)")
    ap.add_argument("--verify-factor", type=float | None, default=None,
                    help="deployment v: a verify pass over L + 1 positions costs v target steps at every L (default: "
                         "v(L) as the pair's calibration measured it; 1 where nothing was timed, e.g. vLLM)")
    ap.add_argument("--actors", type=int | None, default=None, help="pair actors (default: sized to the cluster's memory/CPUs)")
    ap.add_argument("--cpus-per-actor", type=float, default=1)
    ap.add_argument("--batch-size", type=str, default="auto",
                    help="CPU engine: items each actor decodes at once, every row exact to batch 1 (workers/cpu_batch.py); "
                         "auto (default) times the step at 1..32 rows at the items' context and picks, 1 is one item "
                         "after another. Like-for-like timing (--speed-items) stays at batch 1 or --concurrency")
    ap.add_argument("--gpus-per-actor", type=float, default=0)
    ap.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs per pair (vLLM engine)")
    ap.add_argument("--engine", type=str, choices=engine_names(), default="cpu",
                    help="cpu: transformers reference engine; vllm: vLLM with spectune's rules inside (GPU nodes); "
                         "openai: a running server with spectune's rule fields (jobs.serve) at --base-url")
    ap.add_argument("--base-url", type=str | None, default=None,
                    help="openai: the server's OpenAI base url, e.g. http://127.0.0.1:8000/v1")
    ap.add_argument("--model", type=str | None, default=None, help="openai: the model name /v1/models lists")
    ap.add_argument("--api-key-env", type=str | None, default=None, help="openai: the environment variable of the key")
    ap.add_argument("--pair-id", type=str | None, default=None,
                    help="openai: the name you give the server's draft/target pair and weights (the ledger keys "
                         "certificates on it: the weights are not local, so spectune cannot fingerprint them)")
    ap.add_argument("--request-timeout", type=float, default=600.0,
                    help="openai: seconds to wait for a server's next bytes")
    ap.add_argument("--retries", type=int, default=4, help="openai: retries per request (5xx, timeouts, drops)")
    ap.add_argument("--server-config", type=json_object, default=None,
                    help="openai: certify the server at --base-url as it is configured, with no search: its lossy "
                         "settings as you state them (a JSON object recorded in the certificate's scope, e.g. "
                         "'{\"rejection_sample_method\": \"fly\", \"fly_window_size\": 6}'), against --reference-url")
    ap.add_argument("--reference-url", type=str | None, default=None,
                    help="openai, --server-config: the lossless server of the same model (default: --base-url, "
                         "told apart by --reference-extra-body)")
    ap.add_argument("--reference-model", type=str | None, default=None, help="openai: the reference's model name")
    ap.add_argument("--reference-config", type=json_object, default=None,
                    help="openai, --server-config: the reference server's settings as you state them (JSON, recorded)")
    ap.add_argument("--extra-body", type=json_object, default=None,
                    help="openai, --server-config: JSON fields every candidate request carries")
    ap.add_argument("--reference-extra-body", type=json_object, default=None,
                    help="openai, --server-config: JSON fields every reference request carries")
    ap.add_argument("--concurrency", type=str, default="1",
                    help="requests in flight. A sweep (--engine openai or vllm): the speed phase's, one value. "
                         "--server-config: comma separated; the evidence runs at the first (the deployment's), each "
                         "further level is timed on --speed-items items")
    ap.add_argument("--gpu-memory-utilization", type=float | None, default=None,
                    help="vLLM: fraction of each GPU for weights + KV cache (default 0.85)")
    ap.add_argument("--max-model-len", type=int | None, default=None, help="vLLM: context length to plan for (default 4096)")
    ap.add_argument("--max-num-seqs", type=int | None, default=None,
                    help="vLLM: requests decoded at once (default vLLM's); lower it when a large shard's batch runs "
                         "out of memory (the rules' full-vocabulary rows grow with it)")
    ap.add_argument("--enforce-eager", type=bool, nargs="?", const=True, default=False, help="vLLM: no CUDA graphs (faster start, slower steps)")
    ap.add_argument("--kv-cache-gb", type=float | None, default=None,
                    help="vLLM: KV cache per engine in GiB (overrides the memory fraction; vLLM-CPU: size it, "
                         "the fraction counts the worker's own memory)")
    ap.add_argument("--vllm-python", type=str | None, default=None,
                    help="vLLM: the interpreter of the pair actors (default $SPECTUNE_VLLM_PYTHON, this one if it "
                         "imports vllm, else the checkout's .vllm-venv)")
    ap.add_argument("--actor-memory-gb", type=float, default=8.0, help="memory to plan per actor (bf16 real pair: ~7)")
    ap.add_argument("--min-items-to-prune", type=int, default=8, help="paired items needed before early stopping")
    ap.add_argument("--enqueue", action=_AppendRules, type=rules, default=[], metavar="RULE",
                    help="evaluate these settings first, e.g. dropmatch:k=5,p_drop=0.3,criterion=js "
                         "(repeatable; knobs not given take the rule's defaults; skipped if already in the study)")
    ap.add_argument("--trial-timeout", type=float | None, default=None,
                    help="seconds a search trial may run; its items not done by then are left out of that trial's "
                         "search figures (not retried). References and confirmation runs never time out")
    ap.add_argument("--address", type=str | None, default=None, help="Ray address (default: RAY_ADDRESS, else a local Ray)")
    ap.add_argument("--runs-root", type=str | None, default=None,
                    help="default $SPECTUNE_RUNS, else ./runs; in a Ray job $SPECTUNE_RUNS on the head "
                         "(scripts/ray-head: the checkout's runs/), else ~/spectune_runs")
    ap.add_argument("--run-dir", type=str | None, default=None, help="default <runs-root>/sweeps/<study name>")
    ap.add_argument("--ledger", type=str | None, default=None,
                    help="the certificate ledger: a SQLAlchemy URL (a team's Postgres: postgresql+psycopg://user@host/db) "
                         "or a folder for a sqlite file (default: $SPECTUNE_LEDGER, else <asset cache>/ledger)")
    ap.add_argument("--optuna-storage", type=str | None, default=None,
                    help="Optuna's storage URL (a team's server: postgresql+psycopg://...; default: sqlite "
                         "<run-dir>/optuna.db)")
    ap.add_argument("--tracking-uri", type=str | None, default=None,
                    help="MLflow's tracking URI (a team's server: http://host:5000 or a database URL; default: sqlite "
                         "<run-dir>/mlflow.db, artifacts under <run-dir>/mlartifacts)")
    ap.add_argument("--search-space", "--search", type=dict[str, dict[str, Any]] | None, default=None,
                    help="knob ranges in place of the rules' own, {rule: {knob: [low, high] | {low, high, log} | "
                         "[choice, ...]}}, checked against each rule's bounds; in a config file a search_space: "
                         "block (search: is the same key) (docs/sweep-config.md)")
    return ap
