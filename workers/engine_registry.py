"""Engines as declared capabilities: what each engine can do (``EngineTraits``), what the evaluation loop calls on
one (``Engine``, ``ItemEngine``) and the registry that names them (``register_engine`` / ``engine_traits`` /
``engine_names`` / ``engine_factory``).

The sweep, the actors, Serve and the commands ask an engine's traits ("does it stream", "is replay exact"), never
its name, so an engine joins with one ``register_engine`` line: its traits and a factory. Nothing heavy is imported
here: a factory given as ``"module:function"`` is imported at its first use. Ray actors and Serve replicas run in
other processes: an engine registered outside this module reaches them through ``$SPECTUNE_ENGINE_PLUGINS``
(comma-separated modules, imported at the first look-up; each registers its engines), which they inherit from a
driver that sets it before Ray starts. docs/design.md, "Adding an engine".
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

PLUGINS_ENV = "SPECTUNE_ENGINE_PLUGINS"


@dataclass(frozen=True)
class EngineTraits:
    """What an engine can do; each field answers one question the code asks of it."""

    reference: bool = False  # the reference engine: a study key, a reference store and a profile omit its name
    needs_server: bool = False  # requests to a running server (--base-url, --model): no pair loaded here, no threads
    own_interpreter: bool = False  # may run in its own Python (workers.engines.vllm_python): actors start there
    fixed_draft_len: bool = False  # fixes the draft length when it starts: one L per sweep
    default_draft_len: str = "1,12"  # --draft-len when none is given
    takes_vllm_settings: bool = False  # its options are VLLMSettings fields (--kv-cache-gb, --enforce-eager, ...)
    tensor_parallel: bool = False  # may spread one pair over several devices (--tensor-parallel-size)
    measures_cost: bool = False  # times its own draft and target steps: c comes from its profile, not --cost-ratio
    exact_replay: bool = False  # replays a rule from a target-only record's tokens at T = 0 (workers.replay)
    batched_rows: bool = False  # decodes items as rows of one batch, row for row exact (workers.cpu_batch)
    batches_shards: bool = False  # decodes a shard's items as one continuous batch (evaluate_items)
    streams: bool = False  # Serve replicas stream its tokens (an async engine)
    fast_path: bool = False  # runs the CPU fast path's dtypes (int8, int4+int8): --dtype auto is this machine's
    truncates_sampling: bool = False  # samples at T > 0 with top-k / top-p (--top-k, --top-p; policies.truncation)
    couples_sampling: bool = False  # samples with the coupled sampler (--sampler coupled; policies.coupling)


@runtime_checkable
class Engine(Protocol):
    """What the evaluation loop (``workers.evaluation.evaluate_item``) calls on a decoding engine."""

    pair: Any  # the loaded pair: its tokenizer encodes the prompts

    def generate(self, ids: Any, policy: Any, **kwargs: Any) -> Any: ...

    def autoregressive(self, ids: Any, **kwargs: Any) -> Any: ...


@runtime_checkable
class ItemEngine(Protocol):
    """An engine that evaluates a whole item itself (a server: requests, not decoding; ``workers.endpoint_engine``)."""

    def evaluate_item(self, bench: Any, item: Any, spec: Any, reference_outputs: Any = None) -> Any: ...


Factory = Callable[..., Any]  # (pair, dtype, *, cache_dir, prefix_cache, draft_len, tensor_parallel_size, vllm)


@dataclass(frozen=True)
class _Entry:
    traits: EngineTraits
    factory: Factory | str


_ENGINES: dict[str, _Entry] = {}
_plugins_loaded: set[str] = set()


def register_engine(name: str, traits: EngineTraits, factory: Factory | str) -> None:
    """Declare engine ``name``: its traits and its factory (a callable, or ``"module:function"`` imported at first
    use). Registering a name again replaces it (a plugin module imported twice)."""
    if not name or not isinstance(traits, EngineTraits):
        raise ValueError(f"register_engine({name!r}, ...): a name and an EngineTraits")
    _ENGINES[name] = _Entry(traits, factory)


def _load_plugins() -> None:
    for module in (m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(",")):
        if module and module not in _plugins_loaded:
            _plugins_loaded.add(module)
            importlib.import_module(module)


def engine_names() -> tuple[str, ...]:
    """The registered engines, in registration order (the built-in ones first)."""
    _load_plugins()
    return tuple(_ENGINES)


def _entry(name: str) -> _Entry:
    _load_plugins()
    if name not in _ENGINES:
        raise ValueError(f"unknown engine {name!r}; valid: {', '.join(_ENGINES)}")
    return _ENGINES[name]


def engine_traits(name: str) -> EngineTraits:
    """What engine ``name`` can do; ValueError naming the known engines for another name."""
    return _entry(name).traits


def engine_factory(name: str) -> Factory:
    """Engine ``name``'s factory, imported now where it was registered as ``"module:function"``."""
    factory = _entry(name).factory
    if isinstance(factory, str):
        module, _, attr = factory.partition(":")
        factory = getattr(importlib.import_module(module), attr)
    return factory


# the built-in engines, one line each (their factories live in workers.engines)
register_engine("cpu", EngineTraits(reference=True, measures_cost=True, exact_replay=True, batched_rows=True,
                                    fast_path=True, truncates_sampling=True,
                                    couples_sampling=True), "workers.engines:cpu_engine")
register_engine("vllm", EngineTraits(own_interpreter=True, fixed_draft_len=True, default_draft_len="5",
                                     takes_vllm_settings=True, tensor_parallel=True, batches_shards=True,
                                     streams=True), "workers.engines:vllm_engine")
register_engine("openai", EngineTraits(needs_server=True, truncates_sampling=True),  # sent as top_k / top_p
                "workers.engines:openai_engine")
