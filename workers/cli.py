"""What every command-line entry point shares: bad input is one line, never a traceback."""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from typing import Any


class InputError(RuntimeError):
    """Something the user can mend, said in a message that names it: a missing or corrupt asset
    (``workers.models.assets.AssetError``), a model directory that is not a model. Defined here, below
    every module that raises one, so that this module imports none of them."""


def one_line_errors(main: Callable[[list[str] | None], int]) -> Callable[[list[str] | None], int]:
    """Wrap a CLI ``main(argv) -> exit code``: a bad name or value (ValueError) or a missing or
    corrupt input (InputError, e.g. an AssetError) prints ``error: <what>`` naming the problem and exits 2."""

    @functools.wraps(main)
    def wrapper(argv: list[str] | None = None) -> int:
        try:
            return main(argv)
        except (ValueError, InputError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2

    return wrapper


def parse_params(pairs: list[str]) -> dict[str, Any]:
    """``["threshold=0.5", "criterion=js"]`` -> {"threshold": 0.5, "criterion": "js"} (JSON values)."""
    params: dict[str, Any] = {}
    for text in pairs:
        name, sep, raw = text.partition("=")
        if not sep or not name:
            raise ValueError(f"--param must look like NAME=VALUE, got {text!r}")
        try:
            params[name] = json.loads(raw)
        except json.JSONDecodeError:
            params[name] = raw
    return params


def parse_rule(text: str) -> tuple[str, dict]:
    """``kl_judge:threshold=0.5,confidence=0.9`` -> ("kl_judge", {...})."""
    name, _, rest = text.partition(":")
    try:
        return name.strip(), parse_params([p for p in rest.split(",") if p.strip()])
    except ValueError:
        raise ValueError(f"--rule must look like NAME or NAME:KNOB=VALUE,KNOB=VALUE, got {text!r}") from None


def require_positive(args: Any, *names: str) -> None:
    """``--name must be >= 1`` (ValueError naming the flag) for each integer option given."""
    for name in names:
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")


def parse_shard(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    i, sep, n = text.partition("/")
    if not sep or not i.isdigit() or not n.isdigit() or not (0 <= int(i) < int(n)):
        raise ValueError(f"--shard must look like I/N with 0 <= I < N, got {text!r}")
    return int(i), int(n)


def parse_batch_size(text: str | int) -> int | str:
    """``--batch-size``: a positive number of rows, or ``auto`` (the batched CPU engine measures and picks)."""
    if text == "auto":
        return "auto"
    try:
        value = int(text)
    except (TypeError, ValueError):
        raise ValueError(f"--batch-size must be a positive number or auto, got {text!r}") from None
    if value < 1 or str(value) != str(text).strip():
        raise ValueError(f"--batch-size must be a positive number or auto, got {text!r}")
    return value


def sampling_truncation(args: Any) -> dict[str, Any]:
    """``--top-k`` / ``--top-p`` where they truncate: ``{"top_k": k, "top_p": p}`` (the set ones), a decode setting
    then (every spec, a study's name); nothing where they are off, so a run without them keeps its keys. Refused at
    T = 0 (greedy decoding takes the argmax, which no truncation changes: they would only rename the run) and on an
    engine that cannot sample so (vLLM's plugin refuses them)."""
    from policies.truncation import check_truncation, truncates
    from workers.engine_registry import engine_traits

    top_k, top_p = getattr(args, "top_k", 0), getattr(args, "top_p", 1.0)
    try:
        check_truncation(top_k, top_p)
    except ValueError as err:
        raise ValueError(f"--{str(err).replace('_', '-', 1)}") from None
    if not truncates(top_k, top_p):
        return {}
    if args.temperature == 0.0:
        raise ValueError("--top-k/--top-p truncate sampling at T > 0; at --temperature 0 (greedy) they change "
                         "nothing: leave them out or set --temperature")
    engine = getattr(args, "engine", "cpu")
    if not engine_traits(engine).truncates_sampling:
        raise ValueError(f"--top-k/--top-p: --engine {engine} cannot sample with them (its plugin refuses top-k and "
                         "top-p at admission); use the CPU engine or a server (--engine openai)")
    return {k: v for k, v in (("top_k", top_k), ("top_p", top_p)) if v != (0 if k == "top_k" else 1.0)}


def sampling_settings(args: Any) -> dict[str, Any]:
    """:func:`sampling_truncation` and ``--sampler`` where it is not the standard one: the decode settings beyond
    the temperature (every spec's, a study's name). ``--sampler coupled`` is refused at T = 0 (greedy decoding
    draws nothing to couple) and on an engine that cannot sample so (it needs the CPU engine's own draws)."""
    from policies.coupling import check_sampler
    from workers.engine_registry import engine_traits

    out = sampling_truncation(args)
    sampler = getattr(args, "sampler", "standard")
    try:
        check_sampler(sampler)
    except ValueError as err:
        raise ValueError(f"--{err}") from None
    if sampler == "standard":
        return out
    if args.temperature == 0.0:
        raise ValueError("--sampler coupled couples the draws of sampling at T > 0; at --temperature 0 (greedy) "
                         "there are none: leave it out or set --temperature")
    engine = getattr(args, "engine", "cpu")
    if not engine_traits(engine).couples_sampling:
        raise ValueError(f"--sampler coupled: --engine {engine} draws its own tokens; the coupled sampler runs on "
                         "the CPU engine")
    return {**out, "sampler": sampler}
