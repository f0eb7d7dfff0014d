"""Which rule decides: the rule file and the rules requests carry, as the vLLM plugin reads them.

A rule is ``{"policy", "params", "seed"}``, named by its digest. The front end writes the engine's rule
file (:func:`write_rule`); the plugin re-reads it when it changes (:data:`RULE`) and reports what it
applied in ``<rule file>.seen.<pid>.json`` (:func:`seen_rules`). A request's own rule travels in
``SamplingParams.extra_args[RULE_ARG]`` (a dict, or its JSON string from a stock ``vllm serve``'s
``vllm_xargs``: :func:`parse_rule_arg`) and is built once per distinct rule (:data:`REQUEST_RULES`).
Nothing here raises inside a worker: an unreadable file keeps the last good rule, a bad request rule
becomes an invalid rule that the step decides losslessly. No vLLM import.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workers.vllm.step import _InvalidRule, _warn_once

RULE_FILE_ENV = "SPECTUNE_VLLM_RULE_FILE"
NATIVE = "vllm-native"  # a rule file naming this hands verification back to vLLM's own sampler (A/B runs)
TRACE_DIR_ENV = "SPECTUNE_VLLM_TRACE_DIR"
RULE_ARG = "spectune_rule"  # SamplingParams.extra_args key: {"policy", "params", "seed"} for one request
ENTRY_POINT = "spectune_rules"

def rule_digest(spec: dict[str, Any]) -> str:
    return hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def write_rule(path: str | os.PathLike[str], policy: str, params: dict[str, Any], seed: int = 0) -> str:
    """Atomically write the rule file the plugin reads; returns the rule's digest."""
    from policies import make_policy

    if policy != NATIVE:
        make_policy(policy, **params)  # validate here, where the error reaches the user
    spec = {"policy": policy, "params": params, "seed": int(seed)}
    path = Path(path)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(spec, sort_keys=True))
    tmp.replace(path)
    return rule_digest(spec)


def seen_rules(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """What the plugin reported applying, one entry per vLLM process that ran a rule."""
    path = Path(path)
    out = []
    for f in sorted(path.parent.glob(f"{path.name}.seen.*.json")):
        try:
            out.append(json.loads(f.read_text()))
        except (OSError, json.JSONDecodeError):
            continue  # being rewritten; the next read sees it
    return out


@dataclass
class _Active:
    policy: Any
    spec: dict[str, Any]
    digest: str
    stamp: tuple[int, int]
    calls: int = 0


def _activate(spec: dict[str, Any], stamp: tuple[int, int]) -> _Active:
    """A rule file's spec built into the rule it names (None for vLLM's own); raises if it does not build."""
    from policies import make_policy

    policy = None if spec["policy"] == NATIVE else make_policy(spec["policy"], **spec.get("params", {}))
    return _Active(policy, spec, rule_digest(spec), stamp)


class _RuleState:
    """The rule named by this process's rule file, re-read when the file changes."""

    def __init__(self) -> None:
        self.active: _Active | None = None
        self.file_reads = 0  # times this process read the rule file (WorkerExtension.spectune_env reports it)
        self.lookups = 0  # steps that asked for the rule (spectune_env too): none in a target-only engine

    def shared(self, group: Any) -> _Active | None:
        """The step's rule under tensor parallelism (``group``: vLLM's TP group; None: :meth:`current`). Rank 0
        alone reads the rule file and every rank takes rank 0's rule, ``(spec, stamp)`` in one small
        broadcast per step (vLLM's ``broadcast_object``: its shared-memory queue where it has one), so the
        ranks decide, draft and keep their ledgers by the same rule in every step, a rewrite of the file
        between two ranks' reads included. Every rank calls it once per step. Never raises: a broadcast
        that fails is reported once and each rank reads the file itself (rank 0's tokens still decide,
        :func:`workers.vllm.heads.agree_across_ranks`)."""
        self.lookups += 1
        if group is None:
            return self.current()
        rank0 = int(getattr(group, "rank_in_group", 0)) == 0
        mine = self.current() if rank0 else None
        try:
            payload = group.broadcast_object(None if mine is None else (mine.spec, mine.stamp), src=0)
        except Exception as err:  # noqa: BLE001 - never a dead engine
            _warn_once(f"the rule could not be shared across tensor-parallel ranks ({type(err).__name__}); each "
                       "rank reads the rule file", str(err), fallback=False)
            return mine if rank0 else self.current()
        if rank0:
            return mine
        if payload is None:
            self.active = None
            return None
        spec, stamp = payload
        stamp = tuple(stamp)
        if self.active is None or self.active.stamp != stamp or self.active.spec != spec:
            try:
                self.active = _activate(spec, stamp)
            except Exception as err:  # noqa: BLE001 - rank 0 built it; keep the last rule rather than fail
                _warn_once(f"rank 0's rule does not build here ({type(err).__name__}); keeping the previous rule",
                           str(err), fallback=False)
        return self.active

    def current(self) -> _Active | None:
        """The rule to apply; never raises inside a worker. A rule file that cannot be read keeps the
        last good rule (none: vLLM's own), with one warning; the front end's check then sees that the
        rule it asked for did not run."""
        path = os.environ.get(RULE_FILE_ENV)
        if not path:
            return None
        try:
            st = os.stat(path)
            stamp = (st.st_mtime_ns, st.st_size)
            if self.active is None or self.active.stamp != stamp:
                spec = json.loads(Path(path).read_text())
                self.file_reads += 1
                self.active = _activate(spec, stamp)
        except Exception as err:  # noqa: BLE001
            _warn_once(f"rule file {path} unreadable ({type(err).__name__}); keeping the previous rule", str(err),
                       fallback=False)
        return self.active

    def report(self, active: _Active) -> None:
        active.calls += 1
        if (active.calls in (1, 10, 100) or active.calls % 1000 == 0) and os.environ.get(RULE_FILE_ENV):
            path = Path(os.environ[RULE_FILE_ENV])
            seen = path.parent / f"{path.name}.seen.{os.getpid()}.json"
            tmp = seen.with_suffix(".tmp")
            tmp.write_text(json.dumps({"pid": os.getpid(), "digest": active.digest, "calls": active.calls,
                                       **active.spec}))
            tmp.replace(seen)


RULE = _RuleState()

_IMPLICIT: list[_Active] = []


def implicit_rule() -> _Active:
    """The rule of a step in which a request carries its own rule but the rule file names none (no file, or
    ``vllm-native``): lossless for the requests without one (the same distribution as vLLM's own rule), so each
    request's own rule decides it rather than being ignored."""
    if not _IMPLICIT:
        _IMPLICIT.append(_activate({"policy": "lossless", "params": {}, "seed": 0,
                                    "why": "a request carries its own rule; the rule file names none"}, (0, 0)))
    return _IMPLICIT[0]


SAMPLING_EPS = 1e-5  # vLLM's _SAMPLING_EPS: a request with a lower temperature is decoded greedily
_CHILD = re.compile(r"(\d+)_.")  # vLLM names the children of an n > 1 request "<index>_<parent id>"


def request_seed(req_id: str, seed: int | None, temperature: float = 0.0) -> int:
    """The request's part of its random stream: ``SamplingParams.seed`` when set (vLLM gives the children of a
    seeded n > 1 request seed + index). Unseeded: at T = 0, 0, or index + 1 for the children of an n > 1
    request (``seed or 0`` once gave those children the same numbers), so a rule with its own seed decides
    the same in every batch and rerun (request ids are per call); at T > 0, a hash of the request's id, so
    that unseeded requests (a server's, which vLLM samples with its batched generator) draw independently of
    each other, not the same numbers at the same positions."""
    if seed is not None:
        return int(seed)
    if temperature >= SAMPLING_EPS:  # below it vLLM decodes greedily (temperature_cpu -1): a T = 0 request
        return int.from_bytes(hashlib.blake2b(req_id.encode(), digest_size=8).digest(), "little") >> 1
    child = _CHILD.match(req_id)
    return int(child.group(1)) + 1 if child else 0


def rule_spec_of(sampling_params: Any) -> Any:
    """A request's own rule as it carries it (``extra_args[RULE_ARG]``, not yet parsed), or None."""
    args = getattr(sampling_params, "extra_args", None)
    return args.get(RULE_ARG) if isinstance(args, dict) else None


def carries_rules(runner: Any, req_ids: list[str]) -> bool:
    """Whether any request of the step carries its own rule (one dict lookup per request)."""
    return any(rule_spec_of(getattr(runner.requests.get(rid), "sampling_params", None)) is not None
               for rid in req_ids)


def parse_rule_arg(spec: Any) -> dict[str, Any]:
    """A request's ``extra_args[RULE_ARG]`` as ``{"policy", "params", "seed"}`` (not yet built): the dict
    spectune's engines send, or the same as a JSON string — what an OpenAI request to a stock ``vllm serve``
    can carry (``"vllm_xargs": {"spectune_rule": "{\"policy\": \"kl_judge\", ...}"}``: vLLM's
    ``vllm_xargs`` holds scalars only). ValueError for anything else, ``vllm-native`` included."""
    if isinstance(spec, (str, bytes)):
        try:
            spec = json.loads(spec)
        except ValueError as err:
            raise ValueError(f"{RULE_ARG} is a string but not JSON ({err}): {str(spec)[:200]!r}") from None
    if not isinstance(spec, dict) or not isinstance(spec.get("policy"), str) or spec["policy"] == NATIVE:
        raise ValueError(f"{RULE_ARG} must be {{'policy', 'params', 'seed'}} (a dict or its JSON string) naming a "
                         f"spectune rule, got {spec!r}")
    params = spec.get("params") or {}
    if not isinstance(params, dict):
        raise ValueError(f"{RULE_ARG} params must be an object, got {params!r}")
    return {"policy": spec["policy"], "params": dict(params), "seed": int(spec.get("seed", 0))}


class _RequestRules:
    """Rules carried by requests (``extra_args[RULE_ARG]``), built once per distinct rule and looked up
    once per request (later steps of a request cost one dict lookup, not a JSON dump)."""

    CAP = 256

    def __init__(self) -> None:
        self.cache: OrderedDict[str, _Active] = OrderedDict()
        self.by_request: dict[str, tuple[Any, _Active]] = {}

    def for_request(self, req_id: str, spec: Any, live: int) -> _Active:
        hit = self.by_request.get(req_id)
        if hit is None or hit[0] is not spec:  # the same extra_args value object: the same request
            if len(self.by_request) > 4 * live + 1024:
                self.by_request.clear()  # finished requests; the live ones are looked up again once
            hit = self.by_request[req_id] = (spec, self.get(spec))
        return hit[1]

    def get(self, spec: Any) -> _Active:
        from policies import make_policy

        key = json.dumps(spec, sort_keys=True, default=str)
        hit = self.cache.get(key)
        if hit is None:
            try:
                norm = parse_rule_arg(spec)
                hit = _Active(make_policy(norm["policy"], **norm["params"]), norm, rule_digest(norm), (0, 0))
            except Exception as err:  # noqa: BLE001
                hit = _Active(_InvalidRule(f"{type(err).__name__}: {err}"), {"policy": "invalid", "params": {},
                                                                               "seed": 0}, "invalid", (0, 0))
            self.cache[key] = hit
            while len(self.cache) > self.CAP:
                self.cache.popitem(last=False)
        return hit


REQUEST_RULES = _RequestRules()
