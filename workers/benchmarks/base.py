"""The benchmark contract: items, scores, the ``Benchmark`` protocol and the registry.

What every benchmark shares lives here: the deterministic item order, seeded subsets, limits and
shards (``select``), and the checks on ``turn``/``shots``/``outputs`` arguments. It knows nothing
about any particular data set or scorer; those are the sibling modules, which register one
instance each with ``@register``.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol, TypeVar, runtime_checkable

from workers.benchmarks.data import DataFile, fetch_files, require


@dataclass(frozen=True)
class Item:
    id: str  # stable, e.g. "gsm8k/test/0017" (the row in the source file)
    index: int  # position in the deterministic (or seeded) order, before limit and sharding
    turns: tuple[str, ...]  # user message(s); MT-bench has 2
    reference: Any  # gold answer / tests / instruction ids ...
    meta: dict = field(default_factory=dict)  # topic, entry point, ... (JSON-serializable)


@dataclass(frozen=True)
class Score:
    score: float  # 0..1: accuracy-like, or the benchmark's own scale mapped onto 0..1; NaN: a harness error
    extracted: str | None  # what was pulled out of the output (number, letter, code ...)
    reason: str  # why it scored so: "exact match 72", "no number found", "test failed: AssertionError"
    # details["harness_error"] = True (with a NaN score, a reason "harness error: ..."): the item could not be
    # scored (a sandbox that did not start, a library the environment lacks, a timeout the reference hits too).
    # That is no verdict on the output: the evaluation records a failed item (Record.failed), never a loss.
    details: dict = field(default_factory=dict)


@runtime_checkable
class Benchmark(Protocol):
    """What the evaluate job and the sweep call.

    ``items``: deterministic file order; ``seed`` gives a seeded order (by hash of the item id),
    then ``limit`` keeps a prefix, then ``shard=(i, n)`` keeps items i::n (shards partition it).
    ``split`` (``"search"`` or ``"confirm"``) first restricts to one of two disjoint splits: the
    sweep searches on one and certifies budgets on the other (``split_info`` says how they are made).
    ``messages``: chat messages for ``tokenizer.apply_chat_template(msgs, add_generation_prompt=True)``;
    for turn > 0, ``previous`` holds the earlier (question, the model's answer) pairs.
    ``score``: one output per turn; ``reference_outputs`` (the target-only outputs for the same
    item) is used by benchmarks with ``needs_reference_outputs`` (MT-bench) and ignored by the rest.
    Implementations also accept ``cache_dir=`` on ``messages``/``score`` (few-shot exemplars,
    checker and embedding files are read from the cache).
    """

    name: str
    stop: tuple[str, ...]
    default_max_new_tokens: int
    chat: bool | None  # chat template (True), plain text (False), or whichever the tokenizer has (None)

    @property
    def ref(self) -> str: ...  # what get_benchmark resolves in an actor: the name, or a task file's path

    @property
    def key(self) -> str: ...  # what caches are keyed by: the name, or a task file's name and content hash

    def items(self, limit: int | None = None, shard: tuple[int, int] | None = None, seed: int | None = None,
              cache_dir: str | os.PathLike[str] | None = None, split: str | None = None) -> list[Item]: ...

    def split_info(self) -> dict[str, Any]: ...

    def messages(self, item: Item, shots: int = 0, turn: int = 0,
                 previous: list[tuple[str, str]] | None = None) -> list[dict]: ...

    def score(self, item: Item, outputs: list[str], reference_outputs: list[str] | None = None) -> Score: ...


BENCHMARKS: dict[str, Benchmark] = {}
_B = TypeVar("_B")


def register(cls: type[_B]) -> type[_B]:
    """Class decorator: put one default instance of ``cls`` into BENCHMARKS under ``cls.name``."""
    name = cls.name  # type: ignore[attr-defined]
    if name in BENCHMARKS:
        raise ValueError(f"benchmark {name!r} registered twice ({type(BENCHMARKS[name]).__name__}, {cls.__name__})")
    BENCHMARKS[name] = cls()  # type: ignore[assignment]
    return cls


ENTRY_POINTS = "spectune.benchmarks"  # [project.entry-points."spectune.benchmarks"] name = "module:Class"


def load_entry_points() -> None:
    """Register the benchmarks installed packages declare under the ``spectune.benchmarks`` entry point
    group (a ``Benchmark`` class or instance each, under the entry point's name)."""
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINTS):
        if ep.name in BENCHMARKS:
            continue
        try:
            obj = ep.load()
            bench = obj() if isinstance(obj, type) else obj
        except Exception as err:  # noqa: BLE001 - named, on one line
            raise ValueError(f"benchmark entry point {ep.name} = {ep.value} failed to load: {err}") from None
        if not isinstance(bench, Benchmark):
            raise ValueError(f"benchmark entry point {ep.name} = {ep.value} is not a Benchmark "
                             "(needs name, stop, default_max_new_tokens, items, split_info, messages, score)")
        BENCHMARKS[ep.name] = bench


SPLITS = ("search", "confirm")
# The seed of the default split (a seeded half each). Changing it changes every benchmark's split
# and so every sweep's identity: it is part of ``split_info``, which the sweep records.
SPLIT_SEED = 20261130


def check_split(split: str | None) -> None:
    if split is not None and split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid: {list(SPLITS)} (or None for all items)")


def seeded_key(seed: int, item_id: str) -> str:
    # A hash rather than random.shuffle: Python only promises random() itself stays the same across
    # versions, and a hash order is also stable when rows are added or removed.
    return hashlib.sha256(f"{seed}/{item_id}".encode()).hexdigest()


POOL_SALT = "confirm/"  # the confirmation pool's order: sha256("confirm/" + id), chosen by nobody


def pool_key(item_id: str) -> str:
    """Where ``item_id`` stands in every confirmation pool: independent of any seed or sample size (a seeded
    order hashes ``f"{seed}/{id}"``, which never starts with the salt's ``confirm/``)."""
    return hashlib.sha256(f"{POOL_SALT}{item_id}".encode()).hexdigest()


def pool_sources(ids: Any) -> dict[str, int]:
    """Count of item ids by source (the id up to its last '/'), sorted: a pool's composition."""
    by_source: dict[str, int] = {}
    for item in ids:
        source = item.rsplit("/", 1)[0]
        by_source[source] = by_source.get(source, 0) + 1
    return dict(sorted(by_source.items()))


def select(items: Sequence[Item], limit: int | None, shard: tuple[int, int] | None, seed: int | None) -> list[Item]:
    """Order (file order, or by seeded hash), renumber ``index``, cut to ``limit``, then take shard i of n."""
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0 or None, got {limit}")
    if shard is not None:
        i, n = shard
        if n < 1 or not 0 <= i < n:
            raise ValueError(f"shard must be (i, n) with n >= 1 and 0 <= i < n, got {shard}")
    ordered = list(items) if seed is None else sorted(items, key=lambda it: seeded_key(seed, it.id))
    ordered = [Item(it.id, k, it.turns, it.reference, it.meta) for k, it in enumerate(ordered)]
    if limit is not None:
        ordered = ordered[:limit]
    if shard is not None:
        ordered = ordered[shard[0]::shard[1]]
    return ordered


class BenchmarkBase:
    """Shared plumbing; subclasses set the class attributes and implement ``_load`` and ``score``."""

    name: ClassVar[str]
    files: ClassVar[tuple[DataFile, ...]]
    stop: tuple[str, ...] = ()
    default_max_new_tokens: int = 512
    max_shots: ClassVar[int] = 0
    needs_reference_outputs: ClassVar[bool] = False  # True: score() needs the target-only outputs
    chat: bool | None = None  # prompts through the chat template (True), as plain text (False), or auto (None)

    @property
    def ref(self) -> str:
        """What ``get_benchmark`` resolves in another process (an actor)."""
        return self.name

    @property
    def key(self) -> str:
        """What reference caches are keyed by."""
        return self.name

    @property
    def ledger_key(self) -> str:
        """What the certificate ledger is keyed by: the items' identity (a task file: its name and data, not
        its prompt or scorer settings, so an edit to those is not a fresh ledger)."""
        return self.key

    def path(self, dest: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
        """The verified cached file ``dest`` (fetched if missing; AssetError if corrupt)."""
        return require(self.name, self.files, dest, cache_dir)

    def fetch(self, cache_dir: str | os.PathLike[str] | None = None) -> dict[str, Path]:
        return fetch_files(self.name, self.files, cache_dir)

    def _load(self, cache_dir: str | os.PathLike[str] | None) -> list[Item]:
        raise NotImplementedError

    def items(self, limit: int | None = None, shard: tuple[int, int] | None = None, seed: int | None = None,
              cache_dir: str | os.PathLike[str] | None = None, split: str | None = None) -> list[Item]:
        check_split(split)
        pool = self._load(cache_dir) if split is None else self._split(split, cache_dir)
        return select(pool, limit, shard, seed)

    def _split(self, split: str, cache_dir: str | os.PathLike[str] | None) -> list[Item]:
        """Default: a seeded half of the items each (by hash of the id, so adding rows moves no
        other item), file order kept inside each half. Benchmarks with a train split override it."""
        from workers.certify.decide import split_ids

        items = self._load(cache_dir)
        search, _ = split_ids([it.id for it in items], SPLIT_SEED)
        keep = set(search)
        return [it for it in items if (it.id in keep) == (split == "search")]

    def confirmation_pool(self, search: Sequence[Item], cache_dir: str | os.PathLike[str] | None = None
                          ) -> tuple[list[Item], dict[str, int]]:
        """Every item held apart from a search sample: the confirm split and the search-split items the
        sample did not use (its choice depended on the seed, never on outcomes), in the pool's fixed order
        (:func:`pool_key`: a hash salted apart from every seeded order, so no ``--subset-seed`` of a search
        sample or of ``jobs.evaluate`` can line up with the pool's front); few-shot exemplars are in neither
        split. Returns (items, count by source: the id up to its last '/', e.g. {"gsm8k/test": 1319,
        "gsm8k/train": 7465 - the sample})."""
        used = {it.id for it in search}
        pool = sorted((it for s in ("confirm", "search") for it in self._split(s, cache_dir) if it.id not in used),
                      key=lambda it: pool_key(it.id))
        items = [Item(it.id, k, it.turns, it.reference, it.meta) for k, it in enumerate(pool)]
        return items, pool_sources(it.id for it in items)

    def split_info(self) -> dict[str, Any]:
        """How the search and confirmation splits are made (part of a sweep's identity)."""
        return {"search": f"seeded half of {self.name} (split_ids seed {SPLIT_SEED})",
                "confirm": f"the other half of {self.name}", "seed": SPLIT_SEED, "method": "sha256 half"}

    def _check(self, item: Item, shots: int, turn: int) -> None:
        if not item.id.startswith(f"{self.name}/"):
            raise ValueError(f"item {item.id!r} does not belong to benchmark {self.name!r}")
        if not 0 <= shots <= self.max_shots:
            raise ValueError(f"{self.name}: shots must be in [0, {self.max_shots}], got {shots}")
        if not 0 <= turn < len(item.turns):
            raise ValueError(f"{self.name}: turn must be in [0, {len(item.turns) - 1}], got {turn}")

    def _check_outputs(self, item: Item, outputs: Sequence[str]) -> None:
        if isinstance(outputs, str) or len(outputs) != len(item.turns):
            raise ValueError(f"{self.name}: outputs must be a list with one string per turn "
                             f"({len(item.turns)}), got {type(outputs).__name__} of length {len(outputs)}")


def user(content: str) -> dict:
    return {"role": "user", "content": content}


def assistant(content: str) -> dict:
    return {"role": "assistant", "content": content}


def mean_by(items: Sequence[Item], scores: Sequence[Score], key: Callable[[Item], str]) -> dict[str, dict]:
    """``{group: {"n": count, "accuracy": mean score}}``, groups in sorted order."""
    if len(items) != len(scores):
        raise ValueError(f"{len(items)} items but {len(scores)} scores")
    groups: dict[str, list[float]] = {}
    for it, sc in zip(items, scores, strict=True):
        groups.setdefault(key(it), []).append(sc.score)
    return {g: {"n": len(v), "accuracy": sum(v) / len(v)} for g, v in sorted(groups.items())}
