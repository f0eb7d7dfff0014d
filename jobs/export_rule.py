"""Export a sweep's chosen rule for a stock ``vllm serve`` (spectune installed in vLLM's environment).

    # the rule a sweep chose for a 2% accuracy budget (its run directory, or its parent MLflow run id)
    python -m jobs.export_rule --from-sweep runs/sweeps/NAME --budget 2%
    # a chosen-policy JSON file (a sweep's report/chosen-budget-<b>.json, or hand-written)
    python -m jobs.export_rule --chosen chosen.json --out rule.json
    # a hand-written rule file ({"policy", "params", "seed"}): no certificate covers it, and the command says so
    python -m jobs.export_rule --rule rule.json --pair qwen2.5-coder-0.5b+1.5b --draft-len 5
    # the same pieces as JSON, for scripts
    python -m jobs.export_rule --chosen chosen.json --json

Writes the rule file (:func:`workers.vllm.rules.write_rule`: ``{"policy", "params", "seed"}``) and prints
the exact command: the environment the plugin needs (the rule file, vLLM's V1 model runner, vLLM-CPU's
thread binding and step timeout with ``--cpu``) and ``vllm serve <target> --dtype ... --speculative-config
'{"method": "draft_model", "model": <draft>, "num_speculative_tokens": L, "draft_sample_method":
"probabilistic", ...}'`` (plus ``--hf-overrides`` naming a narrower draft's width), then a curl request
that carries its own rule as a JSON string in ``vllm_xargs`` (``spectune_rule``), and the one command that starts
it from this checkout (``python -m jobs.vllm_serve --rule FILE ...``, which builds the same ``vllm serve``). An
uncertified choice is refused unless ``--allow-uncertified``. Errors are one line (exit 2). No vLLM import.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from pathlib import Path
from typing import Any

from workers.vllm.settings import SPECULATIVE_METHODS

CHOSEN_GLOB = "chosen-budget-*.json"


def chosen_files(run_dir: Path) -> dict[float, Path]:
    """A sweep run directory's chosen files by budget."""
    out: dict[float, Path] = {}
    for path in sorted((run_dir / "report").glob(CHOSEN_GLOB)):
        try:
            out[float(path.stem.removeprefix("chosen-budget-"))] = path
        except ValueError:
            continue
    return out


def _shim_needed(cpu: bool) -> str | None:
    """The vLLM environment's Python where its ``vllm`` script cannot start (vllm-cpu: its metadata is ``vllm-cpu``),
    else None."""
    if not cpu:
        return None
    from jobs.vllm_serve import probe
    from workers.engines import vllm_python

    try:
        python = vllm_python(None) or sys.executable
        info = probe(python)
    except ValueError:
        return None
    return python if info["vllm_cpu"] and not info["vllm"] else None


def load_choice(args: argparse.Namespace) -> tuple[dict[str, Any], str, Path]:
    """(the chosen JSON, a description for errors, the default output path)."""
    from jobs.serve import find_run_dir, parse_budget, read_choice

    if args.rule:
        from jobs.vllm_serve import read_rule_file

        path, rule = read_rule_file(args.rule)
        if not args.pair or not args.draft_len:
            raise ValueError("--rule FILE is a rule alone: give the pair it runs on (--pair) and the draft length "
                             "(--draft-len)")
        return {**rule, "_path": str(path), "_rule_file": True}, f"--rule {args.rule}", path
    if args.from_sweep:
        run_dir = find_run_dir(args.from_sweep, args.runs_root)
        budget = parse_budget(args.budget)
        files = chosen_files(run_dir)
        match = [p for b, p in files.items() if math.isclose(b, budget, rel_tol=1e-9, abs_tol=1e-12)]
        if not match:
            have = ", ".join(f"{b:g}" for b in sorted(files)) or "none"
            raise ValueError(f"sweep {run_dir} has no chosen rule for budget {budget:g} (report/{CHOSEN_GLOB}); "
                             f"budgets present: {have}")
        path, what, out = match[0], f"sweep {run_dir.name} budget {budget:g}", run_dir / "export" / f"rule-{budget:g}.json"
    else:
        path = Path(args.chosen)
        what, out = f"--chosen {args.chosen}", path.resolve().parent / f"rule-{path.stem}.json"
    choice = read_choice(path, what)
    choice["_path"] = str(path.resolve())
    return choice, what, out


def check_choice(choice: dict[str, Any], what: str, allow_uncertified: bool) -> None:
    """A sweep's choice is exported only when its confirmation certified it (jobs.serve's rule): a chosen
    file says ``certified``; an uncertified one (or one chosen before certification existed) needs
    ``--allow-uncertified``, and the refusal says why."""
    from jobs.serve import check_certified

    if choice.get("_rule_file"):
        return  # a rule file claims nothing: the command says no certificate covers it
    if "certified" in choice or choice.get("policy") is None:
        check_certified(choice, what, allow_uncertified)
    elif not allow_uncertified:
        if not SWEEP_FIELDS & set(choice):
            raise ValueError(f"{what} says nothing about certification (no \"certified\" field) and nothing of a "
                             "sweep: a hand-written choice, which no certificate covers. Export it as such with "
                             "--allow-uncertified, or its rule alone with --rule FILE --pair P --draft-len L")
        raise ValueError(f"{what} says nothing about certification (no \"certified\" field: a sweep from before "
                         "confirmation splits); its accuracy drop is not bounded: pass --allow-uncertified to export "
                         "it anyway")


SWEEP_FIELDS = {"sweep", "parent_run_id", "budget", "certification", "trial", "metrics", "benchmark"}


def export(args: argparse.Namespace) -> dict[str, Any]:
    from jobs.vllm_serve import plugin_env, resolve_pair, serve_argv, shell
    from workers.engines import _VLLM_DTYPES
    from workers.vllm.rules import RULE_ARG, rule_digest, write_rule

    choice, what, default_out = load_choice(args)
    check_choice(choice, what, args.allow_uncertified)
    policy, params = choice["policy"], dict(choice.get("params") or {})
    draft_len = int(args.draft_len or choice.get("draft_len") or 0)
    if not 1 <= draft_len <= 32:
        raise ValueError(f"{what} gives no draft length in [1, 32] (draft_len {choice.get('draft_len')!r}): pass "
                         "--draft-len")
    dtype_name = args.dtype or choice.get("dtype") or "bf16"
    if dtype_name not in _VLLM_DTYPES:
        raise ValueError(f"dtype {dtype_name!r} has no vLLM equivalent; use one of {sorted(_VLLM_DTYPES)}")
    seed = args.seed if args.seed is not None else int(choice.get("seed", 0) or 0) if choice.get("_rule_file") else \
        int((choice.get("decode") or {}).get("seed", 0) or 0)
    tp = args.tensor_parallel_size
    draft, target, width = resolve_pair(args.pair or choice.get("pair"), args.cache_dir, tp, args.speculative_method)
    from workers.results.scope import changes, check_scope, covers

    outside = {} if choice.get("_rule_file") else \
        check_scope(choice, what, changes(choice, pair=(draft, target) if args.pair else None, dtype=dtype_name,
                                          draft_len=draft_len, drafter=args.speculative_method, engine="vllm",
                                          cache_dir=args.cache_dir),
                    args.allow_uncertified)

    rule = {"policy": policy, "params": params, "seed": seed}
    if choice.get("_rule_file") and args.seed is None and not args.out:  # the file itself is what the server reads
        out, digest = Path(choice["_path"]), rule_digest(rule)
    else:
        out = Path(args.out or default_out).expanduser().resolve()
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            digest = write_rule(out, policy, params, seed)  # validates the rule
        except (TypeError, ValueError, KeyError) as err:
            raise ValueError(f"{what}: rule {policy} {params} does not build: {err}") from None

    env = plugin_env(str(out), cpu=args.cpu, tensor_parallel_size=tp, kv_cache_gb=args.kv_cache_gb)
    extra = []
    for flag, value in (("--max-model-len", args.max_model_len), ("--max-num-seqs", args.max_num_seqs),
                        ("--gpu-memory-utilization", args.gpu_memory_utilization)):
        if value is not None:
            extra += [flag, str(value)]
    if args.enforce_eager:
        extra.append("--enforce-eager")
    argv, spec_config = serve_argv(target, draft, draft_len=draft_len, dtype=_VLLM_DTYPES[dtype_name], width=width,
                                   tensor_parallel_size=tp, method=args.speculative_method, host=args.host,
                                   port=args.port, served_model_name=args.served_model_name, extra=extra)
    command = shell(env, argv)
    notes = []
    python = _shim_needed(args.cpu)
    if python:
        notes.append("vllm-cpu installs its metadata as 'vllm-cpu', and its `vllm` script then fails on "
                     "importlib.metadata.version('vllm'); the same CLI through spectune's shim: "
                     + shell(env, [python, "-m", "workers.vllm.cli", *argv[1:]]))
    pair_arg = f"{draft}+{target}"
    launch = ["python", "-m", "jobs.vllm_serve", "--pair", pair_arg, "--rule", str(out), "--draft-len", str(draft_len),
              "--dtype", dtype_name, "--port", str(args.port), "--host", args.host, "--served-model-name",
              args.served_model_name, *(["--tensor-parallel-size", str(tp)] if tp > 1 else []),
              *(["--speculative-method", args.speculative_method] if args.speculative_method != "draft_model" else []),
              *(["--kv-cache-gb", f"{args.kv_cache_gb:g}"] if args.kv_cache_gb is not None else []), *extra]

    host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    url = f"http://{host}:{args.port}/v1/completions"
    body = {"model": args.served_model_name, "prompt": "def fibonacci(n):", "max_tokens": 64,
            "temperature": float(covers(choice).get("temperature", 0.0)) if not choice.get("_rule_file") else 0.0,
            "vllm_xargs": {RULE_ARG: json.dumps(rule, sort_keys=True)}}
    curl = f"curl -s {url} -H 'Content-Type: application/json' -d {shlex.quote(json.dumps(body))}"
    return {"rule_file": str(out), "digest": digest, "rule": rule, "draft_len": draft_len, "draft_dir": str(draft),
            "target_dir": str(target), "draft_width": width, "dtype": _VLLM_DTYPES[dtype_name], "env": env,
            "argv": argv, "speculative_config": spec_config, "command": command, "url": url,
            "launch": shlex.join(launch), "request_example": body, "curl": curl, "rule_arg": RULE_ARG,
            "source": {"what": what, "path": choice["_path"], "certified": choice.get("certified"),
                       "hand_written": bool(choice.get("_rule_file")),
                       "covers": {} if choice.get("_rule_file") else covers(choice), **outside},
            "notes": notes}


def _covers_line(c: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in c.items()) + " (requests at another temperature run outside it)"


def describe(res: dict[str, Any]) -> str:
    rule = res["rule"]
    cert = res["source"]["certified"]
    return "\n".join([
        f"# rule {rule['policy']} {json.dumps(rule['params'], sort_keys=True)} seed {rule['seed']} "
        f"(digest {res['digest']}) from {res['source']['what']}"
        + ("" if cert is True else "  -- a hand-written rule: no certificate covers it"
           if res["source"].get("hand_written") else "  -- NOT certified (--allow-uncertified)"),
        *([f"# outside its certificate: {'; '.join(res['source']['outside_certificate'])}"]
          if res["source"].get("outside_certificate") else []),
        *([f"# its certificate covers: {_covers_line(res['source']['covers'])}"] if cert is True else []),
        f"# {'rule file' if res['source'].get('hand_written') else 'wrote'} {res['rule_file']}",
        "# serve it (spectune installed in vLLM's environment: its plugin decides every verify step with this rule;",
        "# requests keep top_p=1, top_k and min_p off):",
        res["command"],
        "",
        "# or, from this checkout, the same server started and checked (the vLLM environment's entry point found):",
        res["launch"],
        "",
        f"# a request with its own rule (a JSON string under vllm_xargs.{res['rule_arg']}; without one, the rule file's):",
        res["curl"],
        *[f"\n# note: {note}" for note in res["notes"]],
    ])


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--from-sweep", metavar="RUN", help="a sweep's run directory, or its parent MLflow run id")
    src.add_argument("--chosen", metavar="FILE", help="a chosen-policy JSON file")
    src.add_argument("--rule", metavar="FILE", help="a rule file ({\"policy\", \"params\", \"seed\"}, e.g. hand-written): "
                                                    "needs --pair and --draft-len; no certificate covers it")
    ap.add_argument("--budget", help="with --from-sweep: the accuracy budget, e.g. 0.02 or 2%%")
    ap.add_argument("--allow-uncertified", action="store_true",
                    help="export a choice its confirmation did not certify (its accuracy drop is not bounded)")
    ap.add_argument("--out", help="the rule file (default RUN/export/rule-<budget>.json, or beside --chosen)")
    ap.add_argument("--pair", help="override the choice's pair (a pair name or DRAFT+TARGET directories)")
    ap.add_argument("--cache-dir", help="the asset cache holding a real pair (default: spectune's)")
    ap.add_argument("--dtype", help="override the choice's dtype (bf16, fp16, fp32)")
    ap.add_argument("--draft-len", type=int, help="override the choice's draft length")
    ap.add_argument("--seed", type=int, help="the rule's seed (default: the sweep's decode seed, a rule file's own, "
                                             "else 0)")
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--speculative-method", choices=SPECULATIVE_METHODS, default="draft_model",
                    help="what drafts: the pair's draft model, or an EAGLE-3 head (eagle3: --pair HEAD+TARGET)")
    ap.add_argument("--served-model-name", default="spectune", help="the OpenAI model id clients send")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--max-model-len", type=int)
    ap.add_argument("--max-num-seqs", type=int)
    ap.add_argument("--gpu-memory-utilization", type=float)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--cpu", action="store_true",
                    help="vLLM-CPU: also set the thread binding (this machine's CPUs) and the step timeout")
    ap.add_argument("--kv-cache-gb", type=float, help="with --cpu: VLLM_CPU_KVCACHE_SPACE (GiB)")
    ap.add_argument("--runs-root", help="where sweeps live (default ./runs), for a run id")
    ap.add_argument("--json", action="store_true", help="print the pieces as one JSON object")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.from_sweep and not args.budget:
            raise ValueError("--from-sweep needs --budget (e.g. 2% or 0.02)")
        if args.budget and not args.from_sweep:
            raise ValueError("--budget goes with --from-sweep")
        if args.kv_cache_gb is not None and not args.cpu:
            raise ValueError("--kv-cache-gb sets vLLM-CPU's VLLM_CPU_KVCACHE_SPACE: add --cpu")
        if args.tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size must be >= 1, got {args.tensor_parallel_size}")
        res = export(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(res, indent=1) if args.json else describe(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
