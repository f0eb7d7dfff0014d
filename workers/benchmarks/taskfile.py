"""Your own evaluation set as a task file: ``--benchmark PATH.yaml`` wherever a command takes ``--benchmark``.

In the spirit of lm-evaluation-harness's YAML tasks::

    name: my-arith
    data: items.jsonl                      # .jsonl / .json / .csv / .parquet, relative to this file (read with `datasets`)
    prompt: "Question: {question}\\nAnswer:" # a format string over the row's fields (the user turn of a chat model)
    reference: answer                      # the field holding the reference
    scorer: numeric                        # exact | numeric | regex:<pattern> | code | similarity | judge | python:<module>:<function>
    # optional
    id: qid                                # the field naming each row (default: its row index); ids must be unique
    fewshot: 4                             # the first n rows are exemplars, reserved out of both splits (or a file of rows)
    fewshot_target: "{answer}"             # an exemplar's answer turn (default: its reference)
    system: "You are a careful solver."    # a system turn
    stop: ["\\n\\n"]                       # stop strings
    max_new_tokens: 256
    split: part                            # a column naming each row's split: search / confirm (default: a seeded half each)
    chat: auto                             # true: the pair's chat template; false: the plain prompt; auto: the template if the tokenizer has one
    judge: {url: "http://127.0.0.1:8000/v1", model: judge-model, rubric: "...{prompt}...{reference}...{output}...", scale: 10}

A bad task file is one ``ValueError`` naming the file, the key and the problem. Items are
``<name>/<id>``. The task's identity (its caches, its sweeps' study names) includes a hash of the task
file and the data file, so editing either starts afresh instead of mixing results.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import string
from pathlib import Path
from typing import Any

from workers.benchmarks.base import BENCHMARKS, SPLITS, BenchmarkBase, Item, Score, assistant, user
from workers.benchmarks.scorers import make_scorer

KEYS = ("name", "data", "prompt", "reference", "scorer", "id", "fewshot", "fewshot_target", "system", "stop",
        "max_new_tokens", "split", "chat", "judge")
REQUIRED = ("name", "data", "prompt", "reference", "scorer")
FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
SUFFIXES = (".yaml", ".yml")


def is_task_file(name: str) -> bool:
    return isinstance(name, str) and name.lower().endswith(SUFFIXES)


def _fields(template: str) -> list[str]:
    return [f for _, f, _, _ in string.Formatter().parse(template) if f]


def read_rows(path: Path) -> list[dict[str, Any]]:
    """Every row of a .jsonl/.json/.csv/.parquet file, in file order, through ``datasets`` (no cache written
    beside the data: a temporary cache directory is used)."""
    import tempfile

    import datasets

    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ValueError(f"{path}: data must be one of {', '.join(FORMATS)}")
    datasets.disable_progress_bars()
    with tempfile.TemporaryDirectory() as cache:
        ds = datasets.load_dataset(fmt, data_files=str(path), split="train", cache_dir=cache)
        return [dict(row) for row in ds]


class TaskFile(BenchmarkBase):
    """A benchmark read from a task file (see the module docstring)."""

    files = ()

    def __init__(self, path: str | os.PathLike[str]) -> None:
        import yaml

        self.path_ = Path(path).expanduser().resolve()
        where = str(path)
        if not self.path_.is_file():
            raise ValueError(f"task file {where} does not exist")
        raw = self.path_.read_bytes()
        try:
            spec = yaml.safe_load(raw)
        except yaml.YAMLError as err:
            raise ValueError(f"task file {where}: not valid YAML ({str(err).splitlines()[0]})") from None
        if not isinstance(spec, dict):
            raise ValueError(f"task file {where}: must be a mapping of keys ({', '.join(REQUIRED)} ...)")

        def bad(key: str, problem: str) -> ValueError:
            return ValueError(f"task file {where}: {key}: {problem}")

        unknown = sorted(set(spec) - set(KEYS))
        if unknown:
            raise bad(unknown[0], f"unknown key; valid: {', '.join(KEYS)}")
        for key in REQUIRED:
            if spec.get(key) in (None, ""):
                raise bad(key, "missing (required)")
        name = spec["name"]
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
            raise bad("name", f"must be letters, digits, '.', '_' or '-', got {name!r}")
        if name in BENCHMARKS:
            raise bad("name", f"{name!r} is a built-in benchmark's name; choose another")
        self.name = name
        for key in ("prompt", "reference", "data"):
            if not isinstance(spec[key], str):
                raise bad(key, f"must be a string, got {spec[key]!r}")
        self.data_path = (self.path_.parent / spec["data"]).resolve()
        if self.data_path.suffix.lower() not in FORMATS:
            raise bad("data", f"must end in one of {', '.join(FORMATS)}, got {spec['data']!r}")
        if not self.data_path.is_file():
            raise bad("data", f"{self.data_path} does not exist")
        self.template, self.reference_field = spec["prompt"], spec["reference"]
        try:
            _fields(self.template)
        except ValueError as err:
            raise bad("prompt", f"not a valid format string ({err})") from None
        try:
            self.scorer = make_scorer(spec["scorer"], spec.get("judge"))
        except ValueError as err:
            raise bad("judge" if str(err).startswith("judge:") else "scorer", str(err)) from None
        self.scorer_name = spec["scorer"]
        self.id_field = spec.get("id")
        self.system = spec.get("system")
        if self.system is not None and not isinstance(self.system, str):
            raise bad("system", f"must be a string, got {self.system!r}")
        stop = spec.get("stop", [])
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise bad("stop", f"must be a string or a list of non-empty strings, got {spec.get('stop')!r}")
        self.stop = tuple(stop)
        mnt = spec.get("max_new_tokens", 512)
        if not isinstance(mnt, int) or isinstance(mnt, bool) or not 1 <= mnt <= 32768:
            raise bad("max_new_tokens", f"must be an integer in [1, 32768], got {mnt!r}")
        self.default_max_new_tokens = mnt
        chat = spec.get("chat", "auto")
        if chat not in (True, False, "auto"):
            raise bad("chat", f"must be true, false or auto, got {chat!r}")
        self.chat = None if chat == "auto" else chat
        self.split_field = spec.get("split")
        self.fewshot_target = spec.get("fewshot_target", "{" + self.reference_field + "}")
        fewshot = spec.get("fewshot", 0)
        self._fewshot_file: Path | None = None
        if isinstance(fewshot, str):
            self._fewshot_file = (self.path_.parent / fewshot).resolve()
            if not self._fewshot_file.is_file():
                raise bad("fewshot", f"{self._fewshot_file} does not exist")
            self._reserved = 0
        elif isinstance(fewshot, int) and not isinstance(fewshot, bool) and fewshot >= 0:
            self._reserved = fewshot
        else:
            raise bad("fewshot", f"must be a number of rows >= 0 or a file, got {fewshot!r}")
        self._bad = bad
        digest = hashlib.sha256(raw)
        data = self.data_path.read_bytes()
        self.data_digest = hashlib.sha256(data).hexdigest()[:12]
        digest.update(data)
        if self._fewshot_file is not None:
            digest.update(self._fewshot_file.read_bytes())
        self.digest = digest.hexdigest()[:12]
        rows = self._rows()  # read once now: a bad field fails here, not inside an actor
        self.max_shots = len(self._exemplar_rows(rows))

    @property
    def ref(self) -> str:
        """What ``get_benchmark`` resolves in another process (an actor): the task file's absolute path."""
        return str(self.path_)

    @property
    def key(self) -> str:
        """What caches are keyed by: the name and the content hash."""
        return f"{self.name}-{self.digest}"

    @property
    def ledger_key(self) -> str:
        """The certificate ledger's key: the name and the data file's hash (an edited prompt, scorer or
        comment leaves the items, and so their attempts, as they were)."""
        return f"{self.name}-{self.data_digest}"

    @functools.cache  # noqa: B019 - one instance per task file and content (load_task caches them)
    def _rows(self) -> tuple[dict[str, Any], ...]:
        try:
            rows = read_rows(self.data_path)
        except Exception as err:  # noqa: BLE001 - the reader's message, on one line, naming the key
            raise self._bad("data", f"cannot read {self.data_path.name}: {str(err).splitlines()[0][:200]}") from None
        if not rows:
            raise self._bad("data", f"{self.data_path.name} holds no rows")
        fields = set(rows[0])
        for key, wanted in (("prompt", _fields(self.template)), ("reference", [self.reference_field]),
                            ("id", [self.id_field] if self.id_field else []),
                            ("split", [self.split_field] if self.split_field else [])):
            missing = [f for f in wanted if f not in fields]
            if missing:
                raise self._bad(key, f"field {missing[0]!r} is not in the data (fields: {', '.join(sorted(fields))})")
        if self._reserved >= len(rows):
            raise self._bad("fewshot", f"{self._reserved} exemplars leave none of the {len(rows)} rows to evaluate")
        return tuple(rows)

    def _exemplar_rows(self, rows: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
        if self._fewshot_file is not None:
            return read_rows(self._fewshot_file)
        return list(rows[: self._reserved])

    def _exemplar_keys(self) -> tuple[set[str], set[str]]:
        """(prompts, ids) of a few-shot *file*'s rows: data rows that are exemplars (the same prompt, or the same
        id where both files have the id field) are in neither split, like the first n rows of ``fewshot: n``."""
        if self._fewshot_file is None:
            return set(), set()
        rows = self._exemplar_rows(())
        prompts = {self.template.format(**r) for r in rows if all(f in r for f in _fields(self.template))}
        ids = {str(r[self.id_field]) for r in rows if self.id_field and self.id_field in r}
        return prompts, ids

    def _load(self, cache_dir: str | os.PathLike[str] | None) -> list[Item]:
        items, seen = [], set()
        prompts, ids = self._exemplar_keys()
        for i, row in enumerate(self._rows()):
            if i < self._reserved:
                continue  # the exemplars are in neither split
            if (prompts or ids) and (self.template.format(**row) in prompts
                                      or (self.id_field and str(row[self.id_field]) in ids)):
                continue  # a row of the few-shot file: an exemplar, evaluated nowhere
            key = str(row[self.id_field]) if self.id_field else f"{i:05d}"
            if key in seen:
                raise self._bad("id", f"{key!r} names two rows: ids must be unique")
            seen.add(key)
            split = str(row[self.split_field]) if self.split_field else None
            if split is not None and split not in SPLITS:
                raise self._bad("split", f"row {i} says {split!r}; each row must say one of {list(SPLITS)}")
            items.append(Item(f"{self.name}/{key}", len(items), (self.template.format(**row),), row[self.reference_field],
                              {"row": i, **({"split": split} if split else {})}))
        return items

    def _split(self, split: str, cache_dir: str | os.PathLike[str] | None) -> list[Item]:
        if not self.split_field:
            return super()._split(split, cache_dir)
        return [it for it in self._load(cache_dir) if it.meta["split"] == split]

    def split_info(self) -> dict[str, Any]:
        base = {"task": self.name, "digest": self.digest}  # content, not where the file lies
        if self.split_field:
            return {**base, "search": f"{self.name} rows whose {self.split_field!r} is 'search'",
                    "confirm": f"{self.name} rows whose {self.split_field!r} is 'confirm'", "method": "column"}
        return {**super().split_info(), **base}

    def messages(self, item: Item, shots: int = 0, turn: int = 0, previous: list[tuple[str, str]] | None = None,
                 cache_dir: str | os.PathLike[str] | None = None) -> list[dict]:
        self._check(item, shots, turn)
        msgs: list[dict] = [{"role": "system", "content": self.system}] if self.system else []
        for row in self._exemplar_rows(self._rows())[:shots]:
            msgs += [user(self.template.format(**row)), assistant(self.fewshot_target.format(**row))]
        return msgs + [user(item.turns[0])]

    def score(self, item: Item, outputs: list[str], reference_outputs: list[str] | None = None) -> Score:
        self._check_outputs(item, outputs)
        return self.scorer(outputs[0], item.reference, {**self._rows()[item.meta["row"]], "prompt": item.turns[0]})


@functools.lru_cache(maxsize=64)
def _load_task(path: str, stamp: tuple[int, int]) -> TaskFile:
    return TaskFile(path)


def load_task(path: str | os.PathLike[str]) -> TaskFile:
    """The task file at ``path`` (one instance per file and modification)."""
    p = Path(path).expanduser().resolve()
    if not p.is_file():
        raise ValueError(f"task file {path} does not exist")
    st = p.stat()
    return _load_task(str(p), (st.st_mtime_ns, st.st_size))
