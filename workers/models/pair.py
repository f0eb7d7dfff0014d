"""Load a draft/target model pair that shares one vocabulary.

This module knows how to name and build pairs: the real Qwen2.5-Coder pair (from the directories
``workers.models.assets`` converted), the seeded ``tiny-random`` pair for fast tests (built by
``workers.models.tiny``), and any two local Hugging Face model directories. It checks that both models speak the same
vocabulary (the same token for the same id over the range both tokenizers have, the same special
tokens); a draft whose logits are narrower than the target's is allowed and recorded as
``draft_width``: engines pad its logits to the target's width (the ids past it are no tokens of the
tokenizer, so the draft gives them probability zero). It knows nothing about decoding, acceptance rules
or Ray; models come back in eval mode with gradients off, on CPU.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import torch

from workers import startup
from workers.models import assets
from workers.models.pair_base import TINY_PAIR, ModelPair, eos_token_ids, finish_pair  # noqa: F401 - pair.* names

REAL_PAIRS: dict[str, tuple[str, str]] = {
    # pair name -> (draft model dir name, target model dir name) under <cache>/models/
    assets.DEFAULT_PAIR: ("qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"),
}
PAIRS: tuple[str, ...] = (*REAL_PAIRS, TINY_PAIR)
LOCAL_FORM = ("DRAFT+TARGET or DRAFT,TARGET, each a local Hugging Face model directory or a hub id "
              "(org/name or org/name@revision, read from the local Hugging Face cache)")
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*(@[A-Za-z0-9_./-]+)?")

# torch.int8 names the fast CPU path (``workers.models.fast``): int8 linear weights per output channel, activations
# quantized per token on the fly, everything else fp32. It is a pair dtype, not a tensor dtype.
INT8 = torch.int8
# torch.quint4x2 names the same path with the draft in 4-bit weights and bf16 activations (``fast.Q4Linear``): half
# the draft's bytes a step; the target, and so target-only decoding and every lossless output, is int8's.
INT4_DRAFT = torch.quint4x2
FAST_DTYPES = (INT8, INT4_DRAFT)
_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16, "float": torch.float32,
           "int8": INT8, "int4+int8": INT4_DRAFT}
DTYPE_TAGS = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16", INT8: "int8",
              INT4_DRAFT: "int4+int8"}
FAST_TAGS = ("int8", "int4+int8")  # the CPU engine's fast path (workers.models.fast), nowhere else
# The fast path's arithmetic, as stores of its outputs key it (the reference cache, workers.results.store): bumped
# whenever a change moves any output. 2: grouped-query attention without expanding the keys (2026-12-05).
FAST_NUMERICS = 2


def fast_path(dtype: torch.dtype | str) -> bool:
    """Whether a pair dtype is the CPU engine's fast path (``int8`` or ``int4+int8``)."""
    try:
        return resolve_dtype(dtype) in FAST_DTYPES
    except ValueError:
        return False


BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
INT8_CPU_FLAGS = ("avx2", "avx512f")  # fbgemm's int8 GEMMs need one of these (x86)
AVX512_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq")  # what ATen's AVX512 kernels (the int4 GEMM's fast one) need


def _cpu_flags(cpuinfo: str | None) -> set[str] | None:
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    return set(cpuinfo.split())


def auto_dtype(cpuinfo: str | None = None, cuda: bool | None = None) -> str:
    """What ``--dtype auto`` means for the CPU engine: the fast CPU path on an x86 CPU that runs fbgemm's int8
    GEMMs, measured faster than both float dtypes on both of our VM kinds (docs/measurements.md): ``"int4+int8"``
    (the 4-bit draft) where ATen runs AVX-512 kernels, whose int4 GEMM reads half of int8's bytes in a draft step
    (17.6 ms against 26.4 ms a draft step on the EPYC avx512_bf16 VM); ``"int8"`` with AVX2 only, where the int4 GEMM is
    slower than fbgemm's int8 one; on a GPU, or a CPU without them, the :func:`native_dtype`."""
    if torch.cuda.is_available() if cuda is None else cuda:
        return "bf16"
    flags = _cpu_flags(cpuinfo)
    if flags is not None and any(f in flags for f in INT8_CPU_FLAGS) and "fbgemm" in torch.backends.quantized.supported_engines:
        from workers.models.fast import _int4_ready

        if cpuinfo is None:  # this machine: what ATen itself dispatches to (ATEN_CPU_CAPABILITY included)
            avx512 = torch.backends.cpu.get_cpu_capability().upper().startswith(("AVX512", "AMX"))
        else:
            forced = os.environ.get("ATEN_CPU_CAPABILITY", "").lower()  # ATen held to narrower kernels than the CPU's
            avx512 = all(f in flags for f in AVX512_FLAGS) and forced in ("", "avx512", "avx512_vnni", "avx512_bf16",
                                                                          "amx")
        return "int4+int8" if avx512 and _int4_ready() is None else "int8"
    return native_dtype(cpuinfo, cuda=False)


def dtype_tag(dtype: torch.dtype | str) -> str:
    """The short name of a pair dtype (``bf16``, ``fp32``, ``fp16``, ``int8``, ``int4+int8``)."""
    resolved = resolve_dtype(dtype)
    return DTYPE_TAGS.get(resolved, str(resolved).removeprefix("torch."))


def native_dtype(cpuinfo: str | None = None, cuda: bool | None = None) -> str:
    """``"bf16"`` where bf16 matmuls run natively (a GPU, or a CPU with avx512_bf16 / AMX), else
    ``"fp32"``: without those instructions bf16 is emulated, and an 8-shot prefill of the real pair
    took 13 s per 100 tokens in bf16 against 3.2 s in fp32 on an AVX2-only EPYC (2 threads)."""
    if torch.cuda.is_available() if cuda is None else cuda:
        return "bf16"
    flags = _cpu_flags(cpuinfo)
    if flags is None:
        return "bf16"  # not Linux: trust the default
    return "bf16" if any(f in flags for f in BF16_CPU_FLAGS) else "fp32"


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}")
    return _DTYPES[key]


def check_pair_name(name: str, dtype: torch.dtype | str | None = None) -> None:
    """Fail early (before Ray, before any actor) on a pair name or dtype no loader accepts."""
    if name not in PAIRS and _split_local(name) is None:
        raise ValueError(f"unknown pair {name!r}; valid names: {', '.join(PAIRS)}, or {LOCAL_FORM}")
    if dtype is not None:
        resolve_dtype(dtype)


def load_pair(name: str, dtype: torch.dtype | str = torch.bfloat16,
              cache_dir: str | os.PathLike[str] | None = None, *, seed: int = 0) -> ModelPair:
    """Load pair ``name``: one of ``PAIRS`` or two local model dirs (see ``LOCAL_FORM``).

    ``cache_dir`` is the asset cache (see ``workers.models.assets.cache_root``); ``seed`` only affects
    ``tiny-random``. Raises ``AssetError`` (with the fix command) if the real pair is not fetched,
    ``ValueError`` for an unknown name or two models that do not share a vocabulary.
    """
    torch_dtype = resolve_dtype(dtype)
    if torch_dtype in FAST_DTYPES:
        _check_int8(torch_dtype)
    if name == TINY_PAIR:
        from workers.models.tiny import tiny_random_pair

        pair = tiny_random_pair(torch.float32 if torch_dtype in FAST_DTYPES else torch_dtype, seed=seed)
        return to_int8(pair, torch_dtype) if torch_dtype in FAST_DTYPES else pair
    draft_dir, target_dir, pair_cache = pair_dirs(name, cache_dir)
    return _load_dirs(name, draft_dir, target_dir, torch_dtype, pair_cache)


def _check_int8(dtype: torch.dtype = INT8) -> None:
    tag = DTYPE_TAGS[dtype]
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        raise ValueError(f"dtype {tag} needs PyTorch's fbgemm int8 kernels (an x86 CPU build); this build has "
                         f"{torch.backends.quantized.supported_engines}: use bf16 or fp32")
    if dtype == INT4_DRAFT:
        from workers.models.fast import _int4_ready

        why = _int4_ready()
        if why is not None:
            raise ValueError(f"dtype {tag} needs PyTorch's int4 CPU GEMM: {why}; use int8")


def _draft_bits(dtype: torch.dtype) -> int:
    return 4 if dtype == INT4_DRAFT else 8


def to_int8(pair: ModelPair, dtype: torch.dtype = INT8) -> ModelPair:
    """``pair`` (loaded in fp32, in memory) on the fast CPU path: both models rebuilt by
    ``workers.models.fast.quantize``, smoothed with activation maxima over its fixed calibration text (``dtype``
    INT4_DRAFT: the draft in 4-bit weights). Pairs loaded from directories convert once and keep the result with
    the pair (``fast_store.load_cached``)."""
    from workers.models import fast

    _check_int8(dtype)
    calibration = fast.calibration_ids(pair.tokenizer)
    draft = fast.quantize(pair.draft, calibration, bits=_draft_bits(dtype))
    target = fast.quantize(pair.target, calibration)
    return ModelPair(name=pair.name, draft=draft, target=target, tokenizer=pair.tokenizer, dtype=dtype,
                     vocab_size=pair.vocab_size, eos_token_ids=pair.eos_token_ids, cache_dir=pair.cache_dir,
                     draft_width=pair.draft_width)


def pair_dirs(name: str, cache_dir: str | os.PathLike[str] | None = None) -> tuple[Path, Path, Path]:
    """(draft dir, target dir, pair-level cache dir) of a real or local pair — for engines that load
    from disk themselves (vLLM). ``tiny-random`` lives in memory: save it with :func:`workers.models.tiny.save_tiny_pair`."""
    if name == TINY_PAIR:
        raise ValueError(f"{TINY_PAIR!r} is built in memory; write it to disk with save_tiny_pair() and pass "
                         f"the two directories as {LOCAL_FORM}")
    root = assets.cache_root(cache_dir)
    if name in REAL_PAIRS:
        draft_name, target_name = REAL_PAIRS[name]
        dirs = assets.model_dir(draft_name, cache_dir), assets.model_dir(target_name, cache_dir)
        pair_cache = root / "pairs" / name
    else:
        local = _split_local(name)
        if local is None:
            raise ValueError(f"unknown pair {name!r}; valid names: {', '.join(PAIRS)}, or {LOCAL_FORM}")
        dirs = local
        key = hashlib.sha1("\0".join(str(d) for d in dirs).encode()).hexdigest()[:12]
        pair_cache = root / "pairs" / f"local-{key}"
    try:
        pair_cache.mkdir(parents=True, exist_ok=True)
        if name not in REAL_PAIRS:
            (pair_cache / "pair.json").write_text(json.dumps({"draft": str(dirs[0]), "target": str(dirs[1])}) + "\n")
    except OSError:  # a read-only asset volume (KubeRay pods mount it so): what is derived there is kept in memory
        pass
    return dirs[0], dirs[1], pair_cache


def resolve_model(piece: str) -> Path | None:
    """A local model directory, or a hub id's snapshot in the local Hugging Face cache (never downloaded:
    as with ``HF_HUB_OFFLINE=1``); None when ``piece`` is neither a directory nor shaped like a hub id.
    ValueError naming the fix when it is a hub id the cache does not hold."""
    path = Path(piece).expanduser()
    if path.is_dir():
        return path.resolve()
    if path.exists() or not _HUB_ID.fullmatch(piece):
        return None
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RevisionNotFoundError

    repo, _, revision = piece.partition("@")
    try:
        return Path(snapshot_download(repo, revision=revision or None, local_files_only=True))
    except (LocalEntryNotFoundError, RevisionNotFoundError, FileNotFoundError, OSError):
        raise ValueError(f"{piece}: not in the local Hugging Face cache ({constants.HF_HUB_CACHE}; HF_HUB_CACHE moves "
                         f"it) and nothing is downloaded at run time: fetch it where there is network "
                         f"(`huggingface-cli download {repo}{f' --revision {revision}' if revision else ''}`) and "
                         "copy the cache here, or pass the model's local directory") from None


def _split_local(name: str) -> tuple[Path, Path] | None:
    # Paths may themselves contain the separator, so try every split point, not just the first.
    for sep in (",", "+"):
        pieces = name.split(sep)
        for i in range(1, len(pieces)):
            draft_text, target_text = sep.join(pieces[:i]), sep.join(pieces[i:])
            draft, target = Path(draft_text).expanduser(), Path(target_text).expanduser()
            if draft.is_dir() and target.is_dir():
                return draft.resolve(), target.resolve()
            if all(_HUB_ID.fullmatch(t) or Path(t).expanduser().is_dir() for t in (draft_text, target_text)):
                got = resolve_model(draft_text), resolve_model(target_text)
                if got[0] is not None and got[1] is not None:
                    return got[0], got[1]
    return None


def _load_dirs(name: str, draft_dir: Path, target_dir: Path, dtype: torch.dtype, pair_cache: Path) -> ModelPair:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(target_dir), local_files_only=True)
    if not all(_same_file(draft_dir / f, target_dir / f) for f in ("tokenizer.json", "tokenizer_config.json")):
        # Byte-identical tokenizer files (the real pair) make this check free; otherwise compare.
        draft_tok = AutoTokenizer.from_pretrained(str(draft_dir), local_files_only=True)
        check_same_vocab(draft_tok.get_vocab(), tokenizer.get_vocab(), draft_dir, target_dir)
        check_same_specials(special_tokens(draft_tok), special_tokens(tokenizer), draft_dir, target_dir)
    if dtype in FAST_DTYPES:  # the fast CPU path: converted once per pair and kept beside it
        from workers.models import fast, fast_store

        calibration = fast.calibration_ids(tokenizer)

        def convert(model_dir: Path, role: str, bits: int = 8) -> Any:
            return fast_store.load_cached(model_dir, pair_cache / f"int{bits}" / role, calibration,
                                          lambda: AutoModelForCausalLM.from_pretrained(
                                              str(model_dir), dtype=torch.float32, local_files_only=True), bits)

        # Pair actors starting together: one converting the draft, the next takes the target rather than wait on
        # the draft's lock, so a first start converts the two side by side (one float model each in memory)
        bits = _draft_bits(dtype)
        if fast_store.converting(pair_cache / f"int{bits}" / "draft"):
            target = convert(target_dir, "target")
            draft = convert(draft_dir, "draft", bits)
        else:
            draft, target = convert(draft_dir, "draft", bits), convert(target_dir, "target")
    else:
        def load(model_dir: Path, role: str) -> Any:
            with startup.phase(f"loading the {role} ({dtype_tag(dtype)})", key=f"load-{dtype_tag(dtype)}-{role}",
                               where=pair_cache):
                return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, local_files_only=True)

        draft, target = load(draft_dir, "draft"), load(target_dir, "target")
    return finish_pair(name, draft, target, tokenizer, dtype, pair_cache, (draft_dir, target_dir))


def _same_file(a: Path, b: Path) -> bool:
    return a.is_file() and b.is_file() and a.stat().st_size == b.stat().st_size and a.read_bytes() == b.read_bytes()


def flat_config(config: dict[str, Any]) -> dict[str, Any]:
    """A ``config.json``'s fields on one level: a multimodal model's language model (``text_config``, its
    fields winning) and an EAGLE-3 head in the speculators library's layout (``transformer_layer_config``,
    the head's own top-level fields winning)."""
    out = dict(config)
    layer = out.pop("transformer_layer_config", None)
    if isinstance(layer, dict):
        out = {**layer, **out}
    text = out.get("text_config")
    return {**out, **text} if isinstance(text, dict) else out


def model_config(model_dir: str | os.PathLike[str], role: str = "") -> dict[str, Any]:
    """A Hugging Face model directory's config.json, on one level (:func:`flat_config`); a ValueError naming
    the directory (and its ``role``: draft, target, EAGLE-3 head) when it has none readable."""
    model_dir = Path(model_dir)
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{role + ' ' if role else ''}{model_dir}: no readable config.json ({err}); vLLM needs a "
                         "Hugging Face model directory") from None
    return flat_config(config)


def check_same_vocab(draft_vocab: dict[str, int], target_vocab: dict[str, int], draft_src: Any, target_src: Any) -> None:
    """Raise ValueError describing how two token->id maps differ over the ids both have, if they do.

    Speculative decoding compares token ids, so every id below the smaller tokenizer's size must be
    the same token in both. Ids only the larger one has are allowed here (a target with added tokens);
    :func:`workers.models.pair_base.finish_pair` checks the draft's embedding can still read them."""
    if draft_vocab == target_vocab:
        return
    draft_ids = {i: t for t, i in draft_vocab.items()}
    target_ids = {i: t for t, i in target_vocab.items()}
    shared = min(max(draft_ids, default=-1), max(target_ids, default=-1)) + 1
    differ = [i for i in range(shared) if draft_ids.get(i) != target_ids.get(i)]
    if differ:
        shown = ", ".join(f"{i}: {draft_ids.get(i)!r} vs {target_ids.get(i)!r}" for i in differ[:5])
        raise ValueError(
            f"draft {draft_src} and target {target_src} do not share a tokenizer vocabulary (speculative decoding "
            f"compares token ids, so the same id must be the same token in both): {len(differ)} of the "
            f"{shared} ids both have differ ({shown}); draft has {len(draft_vocab)} tokens, target {len(target_vocab)}")


def special_tokens(tokenizer: Any) -> dict[str, Any]:
    """The special tokens that decide how prompts are built and where generation ends."""
    names = ("bos_token", "eos_token", "pad_token", "unk_token")
    found: dict[str, Any] = {n: getattr(tokenizer, n, None) for n in names}
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    found["special ids"] = {int(i): str(t.content) for i, t in added.items() if getattr(t, "special", False)}
    return found


def check_same_specials(draft: dict[str, Any], target: dict[str, Any], draft_src: Any, target_src: Any) -> None:
    """Raise ValueError naming the special tokens two tokenizers disagree on, if any."""
    differ = {k: (draft.get(k), target.get(k)) for k in sorted(set(draft) | set(target)) if draft.get(k) != target.get(k)}
    if differ:
        shown = "; ".join(f"{k}: draft {d!r}, target {t!r}" for k, (d, t) in differ.items())
        raise ValueError(f"draft {draft_src} and target {target_src} have different special tokens ({shown}): prompts "
                         "and stops would differ between the two models; use a draft of the target's family")
