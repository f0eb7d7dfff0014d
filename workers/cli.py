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
