"""Launch a stock ``vllm serve`` of a draft/target pair with spectune's plugin, from the vLLM environment.

    # every request carries its own rule (vllm_xargs.spectune_rule); requests without one run vLLM's own rule
    python -m jobs.vllm_serve --pair tiny-random --per-request --port 8000 --max-model-len 2048
    # a rule file decides every request that carries none (python -m jobs.export_rule writes one)
    python -m jobs.vllm_serve --pair qwen2.5-coder-0.5b+1.5b --rule rule.json --port 8000
    # the same server without spectune's plugin (vLLM's own rule for every request): a baseline
    python -m jobs.vllm_serve --pair tiny-random --no-plugin --port 8001 --max-model-len 2048
    # only print the commands (this machine's, and a GPU node's)
    python -m jobs.vllm_serve --pair qwen2.5-coder-0.5b+1.5b --per-request --print

Any flag it does not know goes to ``vllm serve`` unchanged (``--max-model-len``, ``--max-num-seqs``, ...). What it
sets, and why:

- the entry point: ``vllm serve`` where the environment's ``vllm`` script starts; ``python -m workers.vllm.cli serve``
  (the same CLI) only where it cannot (vllm-cpu 0.32 installs its metadata as ``vllm-cpu``);
- ``--speculative-config``: draft-model speculation at ``--draft-len``, drafts sampled from the draft's
  distribution (``draft_sample_method: probabilistic``: the rules read it);
- ``--generation-config vllm``: without it ``vllm serve`` applies the target's ``generation_config.json`` (an
  instruct model's top_p 0.8, top_k 20, repetition penalty) to every request, and the output would follow neither
  model's distribution;
- ``--hf-overrides '{"spectune_draft_width": W}'`` where the draft's logits are narrower than the target's (Qwen2.5
  0.5B under 7B): vLLM refuses such a draft unless the plugin pads it;
- ``--worker-extension-cls``: the plugin's ledger (``POST /collective_rpc`` with ``VLLM_SERVER_DEV_MODE=1``);
- the environment: ``SPECTUNE_VLLM_RULE_FILE`` (``--rule``), ``VLLM_USE_V2_MODEL_RUNNER=0`` (the plugin patches the
  V1 runner), and on vLLM-CPU the thread binding, the step timeout, ``VLLM_CPU_KVCACHE_SPACE`` and
  ``--enforce-eager``.

Before it starts anything it checks the vLLM environment (a vLLM the plugin supports, spectune's entry point
installed and not filtered out by ``VLLM_PLUGINS``); once the server answers ``/health`` it prints one ``ready:``
line, which names the processes in which the plugin reported itself active, and serves until stopped (Ctrl-C or
SIGTERM stops the server with it). Errors are one line, exit code 2. ``--pair tiny-random`` (the test pair) is saved
to the asset cache first: vLLM loads models from disk.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from workers.vllm.settings import SPECULATIVE_METHODS

ACTIVE = "spectune rules plugin active in process"  # the line every process the plugin patched logs at start
# flags of `vllm serve` this command sets itself (they are named with their own flags here)
OWNED = ("--speculative-config", "--generation-config", "--hf-overrides", "--worker-extension-cls", "--host", "--port",
         "--served-model-name", "--dtype", "--tensor-parallel-size")
CPU_KV_CACHE_GB = 2.0  # vLLM-CPU's KV cache when --kv-cache-gb is not given
# the plugin alone (torch and vLLM, no Ray or MLflow) into a vLLM environment: jobs.plugin_wheel builds it
PLUGIN_INSTALL = "python -m jobs.plugin_wheel here, then pip install dist/spectune_vllm-*-py3-none-any.whl"
TINY_DIR = "tiny-random/vllm"  # under the asset cache: the test pair as vLLM loads it (head_dim 64: vLLM-CPU needs it)

# Run in the vLLM environment's Python, before anything starts: what it has (no vLLM import: fast)
PROBE = r"""
import importlib.metadata as md, importlib.util, json, os, sys
def ver(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
eps = md.entry_points()
groups = [g for g in eps.groups if g.startswith("vllm.")]
ours = [e for e in eps.select(group="vllm.general_plugins") if e.name == "spectune_rules"]
spec = importlib.util.find_spec("workers.vllm.plugin") if importlib.util.find_spec("workers") else None
print(json.dumps({"vllm": ver("vllm"), "vllm_cpu": ver("vllm-cpu"), "python": sys.executable,
                  "plugins": sorted({e.name for g in groups for e in eps.select(group=g)}),
                  "entry_point": ours[0].value if ours else None,
                  "dist": (ours[0].dist.name if ours and ours[0].dist else None),
                  "plugin_file": spec.origin if spec else None, "vllm_plugins": os.environ.get("VLLM_PLUGINS")}))
"""


def probe(python: str) -> dict[str, Any]:
    """What the vLLM environment at ``python`` holds (:data:`PROBE`)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # its own packages, as vLLM will see them
    env["PYTHONSAFEPATH"] = "1"  # not this folder's: a checkout would shadow what the environment installed
    try:
        got = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, timeout=120, env=env)
    except OSError as err:
        raise ValueError(f"--vllm-python {python}: cannot run it ({err.strerror})") from None
    if got.returncode != 0:
        raise ValueError(f"--vllm-python {python}: its check failed: {got.stderr.strip().splitlines()[-1:]}")
    info = json.loads(got.stdout.strip().splitlines()[-1])
    if not info["vllm"] and not info["vllm_cpu"]:
        raise ValueError(f"{python} has no vLLM installed (`make vllm-env` makes .vllm-venv with vLLM-CPU; on a GPU "
                         f"node: pip install vllm, then spectune's plugin: {PLUGIN_INSTALL})")
    return info


def check_plugin(info: dict[str, Any]) -> str:
    """The vLLM environment can load spectune's plugin; returns vLLM's version. One line otherwise."""
    from workers.vllm.gates import check_version

    version = info["vllm"] or f"{info['vllm_cpu']}+cpu"
    problem = check_version(version)
    if problem:
        raise ValueError(f"{problem} (in {info['python']}): see docs/vllm-engine.md for the supported versions, or "
                         "--no-plugin for vLLM's own rule")
    if not info["entry_point"]:
        raise ValueError(f"spectune's plugin is not installed in {info['python']} (no vllm.general_plugins entry point "
                         f"spectune_rules): `make vllm-env`, or there {PLUGIN_INSTALL}")
    allowed = info.get("vllm_plugins")
    if allowed is not None and "spectune_rules" not in allowed.split(","):
        raise ValueError(f"VLLM_PLUGINS={allowed!r} leaves spectune's plugin out: add spectune_rules to it, or unset it")
    return version


def tiny_pair_dirs(cache_dir: str | None = None) -> str:
    """The test pair saved where vLLM can load it (once), as DRAFT+TARGET."""
    from workers.models.assets import cache_root

    root = cache_root(cache_dir) / TINY_DIR
    draft, target = root / "draft", root / "target"
    if not (draft / "config.json").is_file() or not (target / "config.json").is_file():
        from workers.models.tiny import save_tiny_pair

        save_tiny_pair(root, head_dim=64)  # vLLM-CPU's attention rejects the in-memory pair's head_dim 16
    return f"{draft}+{target}"


def serve_argv(target: Path, draft: Path, *, draft_len: int, dtype: str, width: int, tensor_parallel_size: int = 1,
               method: str = "draft_model", host: str = "127.0.0.1", port: int = 8000,
               served_model_name: str = "spectune", plugin: bool = True, extra: list[str] | None = None,
               ) -> tuple[list[str], dict[str, Any]]:
    """``vllm serve ...`` for the pair (the argv as a GPU node runs it) and the speculative config in it."""
    from workers.vllm.common import WORKER_EXTENSION
    from workers.vllm.settings import PAD_ATTR

    spec_config = {"method": method, "model": str(draft), "num_speculative_tokens": draft_len,
                   "draft_tensor_parallel_size": tensor_parallel_size, "draft_sample_method": "probabilistic"}
    # --generation-config vllm: a stock `vllm serve` applies the model's generation_config.json to every request
    # by default (an HF instruct target's top_p 0.8, top_k 20 and repetition penalty), and the output would then
    # follow neither model's distribution; spectune's rules compare the raw distributions
    argv = ["vllm", "serve", str(target), "--dtype", dtype, "--generation-config", "vllm",
            "--speculative-config", json.dumps(spec_config)]
    if width:  # a narrower draft: vLLM refuses it unless the plugin pads it (without the plugin vLLM refuses it)
        argv += ["--hf-overrides", json.dumps({PAD_ATTR: width})]
    if tensor_parallel_size > 1:
        argv += ["--tensor-parallel-size", str(tensor_parallel_size)]
    argv += ["--served-model-name", served_model_name, "--host", host, "--port", str(port)]
    if plugin:
        argv += ["--worker-extension-cls", WORKER_EXTENSION]
    return argv + list(extra or []), spec_config


def plugin_env(rule_file: str | None, *, cpu: bool, tensor_parallel_size: int = 1,
               kv_cache_gb: float | None = None) -> dict[str, str]:
    """The environment a stock ``vllm serve`` with spectune's plugin starts with."""
    from workers.vllm.rules import RULE_FILE_ENV
    from workers.vllm.settings import CPU_BIND_ENV, CPU_STEP_TIMEOUT_S, STEP_TIMEOUT_ENV, cpu_thread_binding

    env = {RULE_FILE_ENV: str(rule_file)} if rule_file else {}
    env["VLLM_USE_V2_MODEL_RUNNER"] = "0"  # the plugin patches the V1 runner (vLLM 0.33 defaults to V2)
    if cpu:
        env[CPU_BIND_ENV] = cpu_thread_binding(None, 0, tensor_parallel_size)
        env[STEP_TIMEOUT_ENV] = str(CPU_STEP_TIMEOUT_S)
        if kv_cache_gb is not None:
            env["VLLM_CPU_KVCACHE_SPACE"] = f"{kv_cache_gb:g}"
    return env


def shell(env: dict[str, str], argv: list[str]) -> str:
    return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(argv)])


def read_rule_file(path: str) -> tuple[Path, dict[str, Any]]:
    """A hand-written or exported rule file (``{"policy", "params", "seed"}``), checked: the rule builds, and the
    plugin can write its ``.seen`` file beside it."""
    from policies import make_policy

    file = Path(path).expanduser().resolve()
    try:
        rule = json.loads(file.read_text())
    except OSError as err:
        raise ValueError(f"--rule {path}: cannot read it ({err.strerror})") from None
    except ValueError as err:
        raise ValueError(f"--rule {path}: not valid JSON ({err})") from None
    if not isinstance(rule, dict) or "policy" not in rule:
        raise ValueError(f'--rule {path}: a rule file is {{"policy": ..., "params": {{...}}, "seed": N}}')
    extra = sorted(set(rule) - {"policy", "params", "seed"})
    if extra:
        raise ValueError(f"--rule {path} has {', '.join(extra)}: a sweep's choice is no rule file; `python -m "
                         "jobs.export_rule --chosen FILE` writes its rule file and checks its certificate")
    if rule["policy"] != "vllm-native":
        try:
            make_policy(rule["policy"], **(rule.get("params") or {}))
        except (TypeError, ValueError, KeyError) as err:
            raise ValueError(f"--rule {path}: {err}") from None
    if not os.access(file.parent, os.W_OK):
        raise ValueError(f"--rule {path}: the plugin writes <rule file>.seen.<pid>.json beside it, and {file.parent} "
                         "is not writable")
    return file, rule


def resolve_pair(pair: str | None, cache_dir: str | None, tensor_parallel_size: int,
                 method: str = "draft_model") -> tuple[Path, Path, int]:
    """(draft dir, target dir, the draft's padded width or 0) of a pair vLLM loads from disk; with ``method``
    eagle3 the draft directory is an EAGLE-3 head for the target (workers.models.eagle.check_head_dir). Used by
    this command and by ``jobs.export_rule``, which imports it from here (this module imports no command back)."""
    from workers.models.pair import TINY_PAIR, pair_dirs
    from workers.vllm.settings import VLLMSettings, check_drafter_dirs

    if not pair:
        raise ValueError("the choice names no pair: pass --pair (a pair name or DRAFT+TARGET directories)")
    if pair == TINY_PAIR:
        raise ValueError(f"pair {TINY_PAIR!r} is built in memory and cannot be served by vLLM from disk: save it with "
                         "workers.models.tiny.save_tiny_pair(DIR) and pass --pair DIR/draft+DIR/target")
    try:
        draft, target, _ = pair_dirs(pair, cache_dir)
    except Exception as err:  # AssetError (a real pair not fetched) names the fix command
        raise ValueError(f"pair {pair!r}: {err}") from None
    settings = VLLMSettings(tensor_parallel_size=tensor_parallel_size, speculative_method=method)
    return Path(draft).resolve(), Path(target).resolve(), check_drafter_dirs(settings, Path(draft), Path(target))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="Any other flag goes to vllm serve.")
    ap.add_argument("--pair", required=True, help="a pair name (qwen2.5-coder-0.5b+1.5b, tiny-random) or DRAFT+TARGET "
                                                  "directories (or hub ids in the local Hugging Face cache)")
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--rule", metavar="FILE", help="a rule file: it decides every request that carries no rule")
    mode.add_argument("--per-request", action="store_true",
                      help="no rule file: a request's own rule (vllm_xargs.spectune_rule) decides it; requests "
                           "without one run vLLM's own (lossless) rule")
    mode.add_argument("--no-plugin", action="store_true",
                      help="the same server with spectune's plugin filtered out (VLLM_PLUGINS): vLLM's own rule")
    ap.add_argument("--draft-len", type=int, default=5, help="draft tokens a step (vLLM fixes it at start)")
    ap.add_argument("--dtype", help="bf16, fp16 or fp32 (default: fp32 for tiny-random, else bf16 where the device has "
                                    "it, else fp32)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--served-model-name", default="spectune", help="the model id clients send")
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--speculative-method", choices=SPECULATIVE_METHODS, default="draft_model",
                    help="what drafts: the pair's draft model, or an EAGLE-3 head (eagle3: --pair HEAD+TARGET)")
    ap.add_argument("--kv-cache-gb", type=float, help=f"vLLM-CPU: its KV cache (default {CPU_KV_CACHE_GB:g} GiB)")
    ap.add_argument("--cache-dir", help="the asset cache holding a real pair (default: spectune's)")
    ap.add_argument("--vllm-python", help="the vLLM environment's interpreter (default: $SPECTUNE_VLLM_PYTHON, this "
                                          "one where it imports vllm, else the checkout's .vllm-venv)")
    ap.add_argument("--print", action="store_true", help="print the commands and exit, starting nothing")
    return ap


def plan(args: argparse.Namespace, extra: list[str]) -> dict[str, Any]:
    """Everything about the server, checked, before anything starts."""
    from workers.engines import _VLLM_DTYPES, vllm_python
    from workers.models.pair import TINY_PAIR, native_dtype

    owned = sorted({f.split("=")[0] for f in extra if f.split("=")[0] in OWNED})
    if owned:
        raise ValueError(f"{', '.join(owned)}: set by this command (its own flags --pair, --draft-len, --dtype, --host, "
                         "--port, --served-model-name, --tensor-parallel-size)")
    stray = [f for f in extra if f.startswith("-") and not f.startswith("--")]
    if stray:
        raise ValueError(f"unknown flag {stray[0]}")
    if not 1 <= args.draft_len <= 32:
        raise ValueError(f"--draft-len must be in [1, 32], got {args.draft_len}")
    python = vllm_python(args.vllm_python) or sys.executable
    info = probe(python)
    version = info["vllm"] or f"{info['vllm_cpu']}+cpu"
    if not args.no_plugin:
        version = check_plugin(info)
    cpu = bool(info["vllm_cpu"]) and not info["vllm"]
    pair = tiny_pair_dirs(args.cache_dir) if args.pair == TINY_PAIR else args.pair
    draft, target, width = resolve_pair(pair, args.cache_dir, args.tensor_parallel_size, args.speculative_method)
    if width and args.no_plugin:
        raise ValueError(f"the draft's logits are narrower than the target's ({width}): vLLM refuses such a draft "
                         "without spectune's plugin, which pads it")
    dtype_name = args.dtype or ("fp32" if args.pair == TINY_PAIR else native_dtype())
    if dtype_name not in _VLLM_DTYPES:
        raise ValueError(f"--dtype {dtype_name!r}: one of {sorted(_VLLM_DTYPES)}")
    rule_file, rule = (read_rule_file(args.rule) if args.rule else (None, None))
    argv, spec_config = serve_argv(target, draft, draft_len=args.draft_len, dtype=_VLLM_DTYPES[dtype_name],
                                   width=width, tensor_parallel_size=args.tensor_parallel_size,
                                   method=args.speculative_method, host=args.host, port=args.port,
                                   served_model_name=args.served_model_name, plugin=not args.no_plugin, extra=extra)
    kv = args.kv_cache_gb if args.kv_cache_gb is not None else (CPU_KV_CACHE_GB if cpu else None)
    if kv is not None and not cpu:
        raise ValueError("--kv-cache-gb sets vLLM-CPU's KV cache; on a GPU vLLM sizes it (--gpu-memory-utilization)")
    env = {} if args.no_plugin else plugin_env(rule_file, cpu=cpu, tensor_parallel_size=args.tensor_parallel_size,
                                               kv_cache_gb=kv)
    if args.no_plugin:
        # every other vLLM plugin of the environment stays; spectune's alone is left out
        env = {"VLLM_PLUGINS": ",".join(p for p in info["plugins"] if p != "spectune_rules")}
        if cpu:
            env.update({k: v for k, v in plugin_env(None, cpu=True, tensor_parallel_size=args.tensor_parallel_size,
                                                    kv_cache_gb=kv).items() if k != "VLLM_USE_V2_MODEL_RUNNER"})
    script = Path(python).parent / "vllm"
    here = [str(script), *argv[1:]] if not cpu and script.is_file() else \
        [python, "-m", "workers.vllm.cli", *argv[1:]]
    if cpu and "--enforce-eager" not in extra:
        here.append("--enforce-eager")  # vLLM-CPU 0.32's compile cache fails to load: ~5 min per start without it
    gpu_env = {k: v for k, v in env.items() if not k.startswith(("VLLM_CPU_", "VLLM_EXECUTE_MODEL"))}
    return {"python": python, "vllm": version, "cpu": cpu, "env": env, "argv": argv, "launch": here,
            "command": shell(env, here), "gpu_command": shell(gpu_env, argv), "rule_file": str(rule_file or ""),
            "rule": rule, "plugin": not args.no_plugin, "speculative_config": spec_config, "draft_width": width,
            "url": f"http://{'127.0.0.1' if args.host in ('0.0.0.0', '::') else args.host}:{args.port}/v1",
            "model": args.served_model_name, "plugin_file": info["plugin_file"]}


def describe(p: dict[str, Any]) -> str:
    why = ("vllm-cpu installs its metadata as 'vllm-cpu', so its `vllm` script cannot start: the same CLI through "
           "spectune's shim" if p["cpu"] else "the environment's `vllm` script")
    mode = ("spectune's plugin, rule file " + p["rule_file"] if p["rule_file"] else
            "spectune's plugin, a rule per request (requests without one: vLLM's own rule)" if p["plugin"] else
            "without spectune's plugin (vLLM's own rule)")
    return "\n".join([f"# vLLM {p['vllm']} in {p['python']}; {mode}",
                      f"# this machine ({why}):", p["command"], "",
                      "# a GPU node (the vllm wheel" + (f", and spectune's plugin: {PLUGIN_INSTALL}" if p["plugin"]
                                                        else "") + "; the pair's paths as that node has them):",
                      p["gpu_command"]])


def launch(p: dict[str, Any]) -> int:
    """Start the server, relay its log to stderr, print ``ready:`` once it answers, serve until it ends or this
    process is stopped (the server with it)."""
    import urllib.request

    from workers.vllm.orphans import OWNER_ENV
    from workers.vllm.rules import RULE_FILE_ENV

    # a rule file only where --rule names one; the environment's own packages (not PYTHONPATH's, nor this folder's
    # ahead of them: `-m workers.vllm.cli` would run a checkout's copy over what the environment installed)
    env = {k: v for k, v in os.environ.items() if k not in (RULE_FILE_ENV, "PYTHONPATH")}
    env.update(p["env"], PYTHONSAFEPATH="1")
    if p["plugin"]:
        env[OWNER_ENV] = str(os.getpid())  # the server's processes leave when this one is gone (workers.vllm.orphans)
    else:
        env.pop(OWNER_ENV, None)
    server = subprocess.Popen(p["launch"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              start_new_session=True)
    active: list[str] = []

    def relay() -> None:
        assert server.stdout is not None
        for raw in server.stdout:
            line = raw.decode(errors="replace")
            sys.stderr.write(line)
            if ACTIVE in line:
                active.append(re.sub(r".*" + ACTIVE + r" (\d+).*\n?", r"\1", line))
        sys.stderr.flush()

    reader = threading.Thread(target=relay, daemon=True)
    reader.start()

    def stop(*_: Any) -> None:
        try:
            os.killpg(server.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)

    def on_signal(signum: int, _: Any) -> None:
        # unwind first: the handler runs inside server.wait(), which holds the Popen's wait lock, so a wait here
        # could only time out (30 s, then SIGKILL); `finally` stops the server gracefully once the lock is free
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    print(f"starting (pid {server.pid}, its own session): {p['command']}", file=sys.stderr, flush=True)
    try:
        health = p["url"].removesuffix("/v1") + "/health"
        while server.poll() is None:
            try:
                with urllib.request.urlopen(health, timeout=5) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            time.sleep(1)
        if server.poll() is not None:
            reader.join(timeout=5)
            print(f"error: vllm serve exited with code {server.returncode} before it answered {health} (its log is "
                  "above)", file=sys.stderr)
            return 1
        if p["plugin"] and not active:
            print("error: vllm serve answers, but no process logged the plugin active ("
                  f"'{ACTIVE}'): its log above says why; stopping it", file=sys.stderr)
            return 1
        where = f"spectune's plugin active in processes {', '.join(active)}" if p["plugin"] else \
            "without spectune's plugin"
        print(f"ready: {p['url']} (model {p['model']}; {where})", flush=True)
        return server.wait()
    except KeyboardInterrupt:
        return 130
    finally:
        stop()
        reader.join(timeout=5)


def main(argv: list[str] | None = None) -> int:
    args, extra = build_parser().parse_known_args(argv)
    try:
        p = plan(args, extra)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.print:
        print(describe(p))
        return 0
    print(describe(p), file=sys.stderr, flush=True)
    return launch(p)


if __name__ == "__main__":
    raise SystemExit(main())
