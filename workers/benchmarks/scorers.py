"""Scorers a task file names (``scorer:``): one small registry, each a function of (output, reference, row).

- ``exact``: the output, stripped, equals the reference, stripped.
- ``numeric``: the final number of the output (GSM8K's extractor: ``\\boxed{}``, "The answer is N",
  "#### N", else the last number; commas, ``$`` and units tolerated) equals the reference's number.
- ``regex:<pattern>``: the last match of ``pattern`` in the output (its first group if it has one),
  stripped, equals the reference, stripped.
- ``code``: the output's code (a fenced block if there is one) followed by the reference (test code that
  raises on failure) runs in the sandbox (``workers.benchmarks.sandbox``); passed = exit 0.
- ``similarity``: cosine similarity of the output and the reference under the pinned embedding model
  (``workers.benchmarks.similarity``), a score in [0, 1].
- ``python:<module>:<function>``: ``function(output, reference, row)`` returns a float in [0, 1], a
  (float, reason) pair or a ``Score``.

Knows nothing about models, Ray or MLflow.
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable
from typing import Any

from workers.benchmarks.base import Score

Scorer = Callable[[str, Any, dict], Score]
NAMES = ("exact", "numeric", "regex:<pattern>", "code", "similarity", "python:<module>:<function>")
_FENCE = re.compile(r"```(?:[A-Za-z0-9_+-]*)\n(.*?)```", re.DOTALL)


def _exact(output: str, reference: Any, row: dict) -> Score:
    got, want = output.strip(), str(reference).strip()
    ok = got == want
    return Score(1.0 if ok else 0.0, got, "exact match" if ok else f"mismatch, reference {want[:80]!r}")


def _numeric(output: str, reference: Any, row: dict) -> Score:
    from workers.benchmarks.gsm8k import extract_number, to_decimal

    want_text, _ = extract_number(str(reference))
    want = None if want_text is None else to_decimal(want_text)
    if want is None:
        return Score(0.0, None, f"the reference {str(reference)[:80]!r} holds no number", {"gold": None})
    got_text, rule = extract_number(output)
    if got_text is None:
        return Score(0.0, None, rule, {"gold": want_text, "rule": rule})
    got = to_decimal(got_text)
    ok = got is not None and got == want
    reason = f"{'exact match' if ok else 'mismatch'} {got_text} ({rule})" + ("" if ok else f", gold {want_text}")
    return Score(1.0 if ok else 0.0, got_text, reason, {"gold": want_text, "rule": rule})


def _regex(pattern: str) -> Scorer:
    try:
        compiled = re.compile(pattern)
    except re.error as err:
        raise ValueError(f"scorer regex:{pattern!r} is not a valid regular expression: {err}") from None

    def score(output: str, reference: Any, row: dict) -> Score:
        matches = list(compiled.finditer(output))
        if not matches:
            return Score(0.0, None, f"no match for {pattern!r}")
        last = matches[-1]
        got = (last.group(1) if compiled.groups else last.group(0)).strip()
        want = str(reference).strip()
        ok = got == want
        return Score(1.0 if ok else 0.0, got, "exact match" if ok else f"mismatch {got!r}, reference {want[:80]!r}")

    return score


def _code(output: str, reference: Any, row: dict) -> Score:
    from workers.benchmarks.sandbox import run_python

    blocks = _FENCE.findall(output)
    code = blocks[-1] if blocks else output
    res = run_python(f"{code}\n\n{reference}\n")
    reason = "passed" if res.passed else (res.reason if res.status == "timeout" else f"test failed: {res.reason}")
    return Score(1.0 if res.passed else 0.0, code, reason, {"status": res.status, "returncode": res.returncode,
                                                           "stderr_tail": res.stderr_tail[-2000:]})


def _similarity(output: str, reference: Any, row: dict) -> Score:
    from workers.benchmarks.similarity import similarity

    value = min(max(float(similarity(output, str(reference))), 0.0), 1.0)
    return Score(value, None, f"similarity {value:.3f}")


def _python(target: str) -> Scorer:
    module_name, _, function_name = target.partition(":")
    if not module_name or not function_name:
        raise ValueError(f"scorer python:{target!r} must be python:<module>:<function>")
    try:
        function = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"scorer python:{target}: cannot import {function_name!r} from {module_name!r} ({err})") from None

    def score(output: str, reference: Any, row: dict) -> Score:
        got = function(output, reference, row)
        if isinstance(got, Score):
            value, result = got.score, got
        else:
            value, why = (got if isinstance(got, tuple) else (got, ""))
            result = Score(float(value), None, str(why) or f"{function_name} = {float(value):g}")
        if not (isinstance(value, int | float) and math.isfinite(value) and 0.0 <= value <= 1.0):
            raise ValueError(f"scorer python:{target} returned {value!r}: a score must be a number in [0, 1]")
        return result

    return score


FIXED: dict[str, Scorer] = {"exact": _exact, "numeric": _numeric, "code": _code, "similarity": _similarity}


def make_scorer(spec: str) -> Scorer:
    """The scorer a task file's ``scorer:`` names; ValueError listing the valid names otherwise."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"scorer must be one of {', '.join(NAMES)}, got {spec!r}")
    if spec in FIXED:
        return FIXED[spec]
    kind, _, rest = spec.partition(":")
    if kind == "regex" and rest:
        return _regex(rest)
    if kind == "python" and rest:
        return _python(rest)
    raise ValueError(f"unknown scorer {spec!r}; valid: {', '.join(NAMES)}")
