"""The fast path's conversions, stored beside the pair (``<cache>/pairs/<pair>/int8/{draft,target}``, and
``int4/draft`` for the 4-bit draft): written once,
atomically, under a file lock, and loaded back bit-identical; converted again when the source weights, the
format, the calibration or SmoothQuant's alpha change. The model itself: :mod:`workers.models.fast`."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import Tensor

from workers.models.fast import (
    ALPHA,
    Q4_CLIPS,
    Q4_GROUPS,
    Int8CausalLM,
    _Decoder,
    _Layer,
    linear_from_state,
    quantize,
)

FORMAT = 1  # bump when what is stored, or how it is made, changes: older stores are converted again


def save(model: Int8CausalLM, directory: str | os.PathLike[str], meta: dict[str, Any]) -> Path:
    """Write ``model`` (its int8 weights and scales, norms, embedding, config) to ``directory``, atomically: a
    reader sees the old store or the new one, never half of one. ``meta`` is what :func:`load_cached` matches."""
    from safetensors.torch import save_file

    directory = Path(directory)
    tensors: dict[str, Tensor] = {"embed": model.decoder.embed, "norm": model.decoder.norm}
    tensors.update({f"lm_head.{k}": v for k, v in model.lm_head.state().items()})
    for i, layer in enumerate(model.decoder.layers):
        tensors[f"layers.{i}.norm1"], tensors[f"layers.{i}.norm2"] = layer.norm1, layer.norm2
        for name in _Layer.NAMES:
            tensors.update({f"layers.{i}.{name}.{k}": v for k, v in getattr(layer, name).state().items()})
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "model.safetensors"))
    model.config.save_pretrained(tmp)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(tmp)
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
    shutil.rmtree(directory, ignore_errors=True)
    tmp.rename(directory)
    return directory


def load(directory: str | os.PathLike[str]) -> Int8CausalLM:
    """A model :func:`save` wrote."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, GenerationConfig

    directory = Path(directory)
    config = AutoConfig.from_pretrained(str(directory), local_files_only=True)
    generation = None
    if (directory / "generation_config.json").is_file():
        generation = GenerationConfig.from_pretrained(str(directory), local_files_only=True)
    tensors = load_file(str(directory / "model.safetensors"))
    layers = [_Layer(config, {name: linear_from_state(tensors, f"layers.{i}.{name}") for name in _Layer.NAMES},
                     tensors[f"layers.{i}.norm1"], tensors[f"layers.{i}.norm2"])
              for i in range(int(config.num_hidden_layers))]
    decoder = _Decoder(config, tensors["embed"], layers, tensors["norm"])
    model = Int8CausalLM(config, generation, decoder, linear_from_state(tensors, "lm_head"))
    model.eval()
    model.requires_grad_(False)
    return model


def _source(model_dir: Path) -> list[list[Any]]:
    """What identifies a model directory's weights here: each weight and config file's name, size and mtime."""
    keep = (".safetensors", ".bin", ".json")
    return [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in sorted(model_dir.iterdir())
            if p.is_file() and p.name.endswith(keep)]


def load_cached(model_dir: str | os.PathLike[str], store: str | os.PathLike[str], calibration: Tensor,
                load_float: Callable[[], Any], bits: int = 8) -> Int8CausalLM:
    """The fast-path model of ``model_dir`` (``bits`` 8: int8; 4: 4-bit weights): read from ``store`` when it holds
    this very conversion (same weights, format, bits, calibration, alpha), else converted from ``load_float()`` (the
    float model, loaded only then and consumed layer
    by layer) and stored. One process converts at a time (a file lock beside the store): pair actors starting
    together load the fp32 model once, not once each. A store that cannot be written (a read-only asset volume)
    leaves the conversion in memory, said on stderr."""
    model_dir, store = Path(model_dir), Path(store)
    meta = {"format": FORMAT, "alpha": ALPHA, "source": _source(model_dir),
            "calibration": hashlib.sha256(json.dumps(calibration.flatten().tolist()).encode()).hexdigest()[:16]}
    if bits != 8:  # an int8 store's meta stays what it was: stores written before 4-bit weights are still held
        meta["bits"] = bits
        meta["q4"] = {"groups": list(Q4_GROUPS), "clips": list(Q4_CLIPS)}  # the recipe: a change converts again

    def held() -> bool:
        try:
            return json.loads((store / "meta.json").read_text()) == json.loads(json.dumps(meta))
        except (OSError, json.JSONDecodeError):
            return False

    if held():
        return load(store)
    try:
        store.parent.mkdir(parents=True, exist_ok=True)
        lock = open(store.with_name(store.name + ".lock"), "w")  # noqa: SIM115 - held until the store is written
    except OSError as err:
        print(f"fast path: {store} cannot be written ({err}); converting in memory", file=sys.stderr)
        return quantize(load_float(), calibration, consume=True, bits=bits)
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if held():  # another process converted it while this one waited
            return load(store)
        model = quantize(load_float(), calibration, consume=True, bits=bits)
        try:
            save(model, store, meta)
        except OSError as err:
            print(f"fast path: converted {model_dir.name}, not stored ({err})", file=sys.stderr)
        return model
