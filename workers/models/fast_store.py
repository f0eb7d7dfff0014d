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
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import Tensor

from workers import startup
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
# First-time ETAs (before a phase's own duration is kept, workers.startup), seconds per GB read, one thread, on the
# Xeon avx512_bf16 VM at load ~3 (2026-12-06): a store loads at ~6 s/GB (fbgemm's prepack of the int8 weights is
# most of it); converting reads the float weights at ~15 s/GB (int8: activation maxima, quantization, the write) and
# ~20 s/GB (4-bit: the clip search per group)
LOAD_S_PER_GB, CONVERT_S_PER_GB = 6.0, {8: 15.0, 4: 20.0}


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

    kind = "4-bit" if bits == 4 else "int8"
    where, role = store.parent.parent, store.name  # the pair's cache directory; draft or target
    if held():
        return _load_store(store, where, f"loading the {role} ({kind}, converted earlier)", f"load-{kind}-{role}")
    convert_key = f"convert-{kind}-{role}"
    try:
        store.parent.mkdir(parents=True, exist_ok=True)
        lock = open(store.with_name(store.name + ".lock"), "w")  # noqa: SIM115 - held until the store is written
    except OSError as err:
        print(f"fast path: {store} cannot be written ({err}); converting in memory", file=sys.stderr)
        return _convert(model_dir, load_float, calibration, bits, f"converting the {role} to {kind} (in memory)",
                        None, None)
    with lock:
        if not try_lock(lock):
            with startup.phase(f"waiting for another process converting the {role} to {kind}", every_s=15,
                               estimate_s=startup.last_time(where, convert_key), estimate="its conversion's last time"):
                fcntl.flock(lock, fcntl.LOCK_EX)
        if held():  # another process converted it while this one waited
            return _load_store(store, where, f"loading the {role} ({kind}, just converted by another process)",
                               f"load-{kind}-{role}")
        model = _convert(model_dir, load_float, calibration, bits,
                         f"converting the {role} to {kind} (once per pair, kept in {store})", where, convert_key,
                         lambda fast: save(fast, store, meta))
        return model


def try_lock(lock: Any) -> bool:
    """Take ``lock`` (an open file) exclusively if no other process holds it."""
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def converting(store: str | os.PathLike[str]) -> bool:
    """Whether another process is converting into ``store`` now (it holds the store's lock)."""
    path = Path(store).with_name(Path(store).name + ".lock")
    if not path.is_file():
        return False
    try:
        with open(path) as lock:
            return not try_lock(lock)
    except OSError:
        return False


def _gb(path: Path) -> float:
    files = [path] if path.is_file() else list(path.glob("*.safetensors")) + list(path.glob("*.bin"))
    try:
        return sum(p.stat().st_size for p in files) / 1e9
    except OSError:
        return 0.0


def _load_store(store: Path, where: Path, what: str, key: str) -> Int8CausalLM:
    estimate = LOAD_S_PER_GB * _gb(store) or None
    with startup.phase(what, key=key, where=where, estimate_s=estimate, estimate="from its size"):
        return load(store)


def _convert(model_dir: Path, load_float: Callable[[], Any], calibration: Tensor, bits: int, what: str,
             where: Path | None, key: str | None, save_it: Callable[[Any], Any] | None = None) -> Int8CausalLM:
    """``load_float()`` converted (and given to ``save_it``), said as one phase whose lines count the layers done."""
    estimate = CONVERT_S_PER_GB[bits] * _gb(model_dir) or None
    with startup.phase(what, key=key, where=where, estimate_s=estimate, estimate="from its size") as running:
        model = load_float()
        done = threading.Event()
        watcher = threading.Thread(target=_count_layers, args=(model, running, done), daemon=True)
        watcher.start()
        try:
            fast = quantize(model, calibration, consume=True, bits=bits)
        finally:
            done.set()
            watcher.join(timeout=2.0)
        del model  # its layers are emptied; the rest goes now, as before
        if save_it is not None:
            try:
                save_it(fast)
            except OSError as err:
                print(f"fast path: converted {model_dir.name}, not stored ({err})", file=sys.stderr)
        return fast


def _count_layers(model: Any, running: startup.Phase, done: threading.Event, every_s: float = 1.0) -> None:
    """How many of the float model's layers the conversion has rebuilt: it empties each one's weights when done
    (``quantize(consume=True)``); a model that does not say so leaves the phase on its time-based ETA."""
    try:
        layers = list(model.get_decoder().layers)
    except Exception:  # noqa: BLE001 - progress is a nicety
        return
    while not done.wait(every_s):
        try:
            n = sum(1 for layer in layers if next(iter(layer.parameters())).numel() == 0)
        except Exception:  # noqa: BLE001
            return
        running.progress(n, len(layers), "layers converted")
