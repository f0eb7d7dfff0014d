"""What a model pair *is*, whatever it is called: a fingerprint of its weights, config and tokenizer.

The certificate ledger (``workers.results.ledger``) keys confirmation attempts on it, so that the same two models
spelled another way (the shipped pair's name, its two converted directories, hub ids whose snapshots hold
the same files, a symlink) or loaded in another dtype are one pair, and a second confirmation on items an
earlier attempt used is caught.

- the shipped pair (``qwen2.5-coder-0.5b+1.5b``): the pinned sha256 of its two GGUF sources (known without
  fetching anything);
- a model directory: its converted source's sha256 where spectune converted it (``spectune.json``), else
  sha256 over its ``config.json`` (without the keys that name a path, a dtype or a library version), its
  tokenizer files, and per weight file its size, its safetensors header and 16 MiB sampled at fixed
  offsets (two fine-tunes of one base share the config and tokenizer, not the weights; hashing a 7B
  checkpoint whole would take a minute);
- ``tiny-random``: built in code from a seed: its name and seed.

Knows files and hashes; nothing about decoding, benchmarks or Ray.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from workers.models import assets

_VOLATILE = ("_name_or_path", "transformers_version", "torch_dtype", "dtype", "_commit_hash", "quantization_config")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "tokenizer.model",
                    "special_tokens_map.json")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
_SAMPLES, _SAMPLE = 16, 1 << 20  # 16 windows of 1 MiB per weight file


def _sha(parts: list[str]) -> str:
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _sampled(path: Path) -> str:
    """sha256 of the file's size, its first 8 bytes + safetensors header (when it is one) and 16 windows."""
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with path.open("rb") as fh:
        if path.suffix == ".safetensors" and size >= 8:
            head = int.from_bytes(fh.read(8), "little")
            digest.update(fh.read(min(head, size - 8)))
        step = max(1, size // _SAMPLES)
        for offset in range(0, size, step):
            fh.seek(offset)
            digest.update(fh.read(_SAMPLE))
    return digest.hexdigest()


def model_fingerprint(directory: str | os.PathLike[str]) -> str:
    """The fingerprint of one Hugging Face model directory (see the module docstring)."""
    root = Path(directory).expanduser().resolve()
    meta = root / "spectune.json"
    if meta.is_file():
        source = json.loads(meta.read_text()).get("source_sha256")
        if source:
            return f"source:{source}"
    parts = []
    config = root / "config.json"
    if config.is_file():
        data = json.loads(config.read_text())
        parts.append("config " + json.dumps({k: v for k, v in data.items() if k not in _VOLATILE}, sort_keys=True))
    for name in _TOKENIZER_FILES:
        if (root / name).is_file():
            parts.append(f"{name} {hashlib.sha256((root / name).read_bytes()).hexdigest()}")
    weights = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in _WEIGHT_SUFFIXES)
    if not weights and not parts:
        raise ValueError(f"{root}: no config.json, tokenizer or weight files: not a model directory")
    parts += [f"{p.relative_to(root).as_posix()} {_sampled(p)}" for p in weights]
    return "files:" + _sha(parts)


def pair_fingerprint(pair: str, *, seed: int = 0) -> str:
    """The fingerprint of pair ``pair`` (a name ``load_pair`` accepts): equal for every spelling of the
    same two models, different for any other draft or target."""
    from workers.models.pair import REAL_PAIRS, TINY_PAIR, check_pair_name, pair_dirs

    check_pair_name(pair)
    if pair == TINY_PAIR:
        return f"builtin:{TINY_PAIR}/seed{seed}"
    if pair in REAL_PAIRS:
        found = assets.pair_assets(pair)
        draft, target = f"source:{found.draft.sha256}", f"source:{found.target.sha256}"
    else:
        draft_dir, target_dir, _ = pair_dirs(pair)
        draft, target = model_fingerprint(draft_dir), model_fingerprint(target_dir)
    return "pair:" + _sha([f"draft {draft}", f"target {target}"])[:32]
