"""The sweep's references: target-only and lossless decoding on the same items as the rules, cached per
(pair, dtype, benchmark, decoding settings) under ``<runs root>/references/`` and shared by every sweep over
them, and the resumable record runner every evaluation of the sweep goes through.

A reference is named by a :class:`RefKey` (what was decoded, on which split, at which L, on how many items),
never by a string built in place. :class:`References` owns its cache: phases ask it for records, and it runs
what it does not hold yet on the pair actors (``cluster``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sweep.progress import Progress, log
from workers.engine_registry import engine_traits
from workers.evaluation import TARGET_ONLY, DecodeSpec, Record
from workers.results.store import RecordStore, reference_dir

if TYPE_CHECKING:
    from sweep.settings import Settings
    from workers.benchmarks.base import Item

SEARCH, CONFIRM = "search", "confirm"


@dataclass(frozen=True)
class RefKey:
    """One reference's records: target-only or lossless (at ``draft_len``), on the search sample or on the
    first ``items`` confirmation items (target-only on the confirmation split grows look by look: one key)."""

    kind: str  # TARGET_ONLY or "lossless"
    split: str = SEARCH
    draft_len: int = 0
    items: int | None = None

    @classmethod
    def target_only(cls, split: str = SEARCH) -> RefKey:
        return cls(TARGET_ONLY, split)

    @classmethod
    def lossless(cls, draft_len: int, split: str = SEARCH, items: int | None = None) -> RefKey:
        return cls("lossless", split, draft_len, items if split == CONFIRM else None)


class References:
    """The sweep's cached reference records and its record runner, over the pair actors ``workers``."""

    def __init__(self, settings: Settings, root: Path, workers: list[Any], items: list[Item], batch: int = 1) -> None:
        self.settings, self.root, self.workers, self.items = settings, root, workers, items
        self.batch = batch  # the rows each CPU actor decodes at once (workers.cpu_batch): a shard's size
        self._cache: dict[RefKey, dict[str, Record]] = {}

    # -- where records live ----------------------------------------------------------------------

    def store(self, spec: DecodeSpec) -> RecordStore:
        """``spec``'s reference store: per engine (the same greedy tokens up to kernels, other timings)."""
        args = self.settings.args
        return RecordStore(reference_dir(self.root, args.pair, args.dtype, self.settings.bench.key, spec, args.engine))

    def path(self, spec: DecodeSpec) -> Path:
        """The records file of ``spec``'s reference store (shared by sweeps over the same pair and task)."""
        return self.store(spec).parquet

    def target_only_spec(self) -> DecodeSpec:
        return DecodeSpec.make(TARGET_ONLY, **self.settings.decode)

    def lossless_spec(self, draft_len: int) -> DecodeSpec:
        return DecodeSpec.make("lossless", {}, draft_len, **self.settings.decode)

    # -- what is held ----------------------------------------------------------------------------

    def get(self, key: RefKey) -> dict[str, Record]:
        """The records held under ``key`` (empty when it never ran)."""
        return self._cache.get(key, {})

    def has(self, key: RefKey) -> bool:
        return key in self._cache

    def first_lossless(self) -> dict[str, Record] | None:
        """The first lossless reference the search ran (the shortest L of its range), or None."""
        return next((recs for key, recs in self._cache.items() if key.kind == "lossless" and key.split == SEARCH),
                    None)

    # -- running ---------------------------------------------------------------------------------

    def target_only(self) -> dict[str, Record]:
        """Target-only decoding on the search sample."""
        key = RefKey.target_only()
        if key not in self._cache:
            self._cache[key] = self.reference(self.target_only_spec(), "target-only reference")
        return self._cache[key]

    def confirm_target_only(self, items: list[Item], order: list[Item]) -> dict[str, Record]:
        """Target-only decoding on ``items`` (a look's confirmation items), added to what earlier looks ran;
        every confirmation record held, in ``order`` (the attempt's items)."""
        key = RefKey.target_only(CONFIRM)
        got = self.reference(self.target_only_spec(), "target-only reference (confirm)", items)
        held = self._cache[key] = {**self._cache.get(key, {}), **got}
        return {it.id: held[it.id] for it in order if it.id in held}

    def lossless(self, draft_len: int) -> dict[str, Record]:
        """Lossless at ``draft_len`` on the search sample; at L = 0, target-only decoding (the fastest lossless
        decoding may draft nothing: where a verify pass or a draft step is dear, target-only wins)."""
        if draft_len == 0:
            return self.target_only()
        key = RefKey.lossless(draft_len)
        if key not in self._cache:
            self._cache[key] = self.reference(self.lossless_spec(draft_len), f"lossless L={draft_len} reference (search)")
        return self._cache[key]

    def confirm_lossless(self, draft_len: int, items: list[Item]) -> dict[str, Record]:
        """Lossless at ``draft_len`` on the confirmation ``items`` (the first n of the attempt's); at L = 0,
        target-only decoding on them."""
        if draft_len == 0:
            return self.confirm_target_only(items, items)
        key = RefKey.lossless(draft_len, CONFIRM, len(items))
        if key not in self._cache:
            self._cache[key] = self.reference(self.lossless_spec(draft_len),
                                              f"lossless L={draft_len} reference (confirm)", items, confirm=True)
        return self._cache[key]

    def lossless_range(self) -> dict[int, dict[str, Record]]:
        """The lossless decodings a user could run instead, on the search sample: target-only (L = 0) and lossless
        at every L of the search range (one teacher-forced pass per item for all of them where replay runs,
        :meth:`_lossless_bundle`). The fastest of them is the baseline every speed is stated against."""
        lengths = self.settings.lengths
        if any(RefKey.lossless(n) not in self._cache for n in lengths):
            self._lossless_bundle(lengths)
        return {0: self.target_only(), **{n: self.lossless(n) for n in lengths}}

    def reference(self, spec: DecodeSpec, label: str, items: list[Item] | None = None, confirm: bool = False
                  ) -> dict[str, Record]:
        """``spec`` on ``items`` (default: the search sample) into its reference store, failed items retried."""
        return self.run(spec, label, self.store(spec), self.items if items is None else items, retry_failed=True,
                        timeout=False, confirm=confirm)

    def run(self, spec: DecodeSpec, label: str, store: RecordStore, items: list[Item],
            stop: Callable[[dict[str, Record]], bool] | None = None, *, retry_failed: bool = False,
            timeout: bool = True, confirm: bool = False) -> dict[str, Record]:
        """``spec`` on ``items``, resumable through ``store``; ``stop(records)`` may end it early.
        ``retry_failed``: items whose stored record failed (an engine death, a parse failure) run again,
        once per call, their new record replacing the old (references: a failed reference item would
        otherwise stay cached for every later sweep). ``timeout``: whether ``--trial-timeout`` applies
        (search trials only; a reference or a confirmation that dropped items would change the items a
        certificate is decided on). ``confirm``: what a certificate is decided on, replayed only where replay
        is exact (:meth:`replays`)."""
        from cluster.pair_actor import run_trial

        held, done = self.held(store, confirm, spec)
        missing = [it for it in items if it.id not in done or (retry_failed and done[it.id].failed)]
        retried = sum(it.id in done for it in missing)
        if retried:
            log(f"{label}: retrying {retried} failed item(s)")
        if missing:
            against = {} if spec.policy == TARGET_ONLY else {**self.get(RefKey.target_only()),
                                                            **self.get(RefKey.target_only(CONFIRM))}
            bar = Progress(label, len(items), len(items) - len(missing))

            def on_record(rec: Record) -> bool:
                store.append(rec)
                done[rec.item_id] = rec
                bar.update(rec)
                return bool(stop is not None and stop({it.id: done[it.id] for it in items if it.id in done}))

            run = run_trial(self.workers, f"{label}-{spec.key()}", self.settings.bench.ref, spec, missing,
                            self.payload(against, confirm, spec), on_record=on_record,
                            timeout_s=self.settings.args.trial_timeout if timeout else None,
                            shard_size=self.shard_size(missing))
            bar.close("stopped early: the bound rules it out" if run.stopped_early else "")
        store.write_parquet({**held, **done}.values())  # the whole store: a shared reference may hold both splits' items
        return {it.id: done[it.id] for it in items if it.id in done}

    def held(self, store: RecordStore, confirm: bool = False, spec: DecodeSpec | None = None
             ) -> tuple[dict[str, Record], dict[str, Record]]:
        """What ``store`` holds, and what of it a run may keep: for what a certificate is decided on, only records
        decoded in full where replay is not exact (a shared store's replayed records, another sweep's search, are
        made again), and where it is, replayed records only if made at a thread count where it is, under the
        current replay semantics (``workers.replay.REPLAY_VERSION``; a record that does not say, made before records
        did, is made again) and with the rules' fused kernels as the process meant them (``Record.fused_off``: a
        replay decided by the eager kernels after a failure is not the full decode's arithmetic)."""
        held = store.load()
        if confirm and not self.replays(True, spec):
            return held, {k: r for k, r in held.items() if r.timed}
        if confirm:  # replay is exact here, but a shared store's replayed record may have been made where it is not
            from workers.replay import REPLAY_VERSION, exact_for

            return held, {k: r for k, r in held.items() if r.timed or (
                exact_for(self.settings.args.dtype, r.threads) and r.replay_version == REPLAY_VERSION
                and not r.fused_off)}
        return held, dict(held)

    def replayable_draws(self) -> bool:
        """Whether the sweep's draws replay (``workers.replay.draw_for``): greedy (T = 0), or the coupled sampler."""
        decode = self.settings.decode
        return decode["temperature"] == 0.0 or decode.get("sampler") == "coupled"

    def replays(self, confirm: bool = False, spec: DecodeSpec | None = None) -> bool:
        """Whether rules are replayed from the target-only output (``workers.replay``): on the CPU engine at
        T = 0 or under the coupled sampler, unless ``--replay off``; for what a certificate is decided on (``confirm``: confirmation and its
        lossless reference) only where replay is full decoding by construction (``workers.replay.exact_for``: the
        int8 path at one thread per actor) and for a rule whose own arithmetic keeps it so (``spec``'s:
        ``workers.replay.exact_rule``), else those items decode in full."""
        from workers.replay import exact_for, exact_rule

        args = self.settings.args
        exact = engine_traits(args.engine).exact_replay
        on = args.replay != "off" and exact and self.replayable_draws()
        threads = max(1, int(getattr(args, "cpus_per_actor", 1) or 1))  # the actors' torch threads (make_workers)
        rule_ok = spec is None or spec.policy == TARGET_ONLY or exact_rule(spec.policy, spec.params_dict)
        return on and (not confirm or (exact_for(args.dtype, threads) and rule_ok))

    def payload(self, references: dict[str, Record], confirm: bool = False, spec: DecodeSpec | None = None
                ) -> dict[str, Any]:
        """What the actors get of the target-only records: where rules replay (:meth:`replays`), each record's
        tokens, so the rule is replayed from them; else its outputs."""
        from workers.evaluation import reference_payload

        on = self.replays(confirm, spec)
        return {k: reference_payload(r) if on and not r.failed else r.outputs for k, r in references.items()}

    def shard_size(self, items: list[Item]) -> int | None:
        """vLLM batches a shard in one ``generate``: one shard per actor; the batched CPU engine two batches' worth
        (rows that finish take the shard's next items, so the batch drains once per shard; fewer where that would
        leave an actor idle); at batch 1 small ones (the default)."""
        if engine_traits(self.settings.args.engine).batches_shards and items:
            return math.ceil(len(items) / max(1, len(self.workers)))
        if self.batch > 1 and items:
            return max(1, min(2 * self.batch, math.ceil(len(items) / max(1, len(self.workers)))))
        return None

    def _lossless_bundle(self, lengths: list[int]) -> None:
        """Lossless references at every L of ``lengths`` on the search items, item by item on the actors, one
        teacher-forced pass per item for all of them (``evaluate_bundle``), into each L's reference store; the
        CPU engine at T = 0 or under the coupled sampler only (elsewhere, and if the actors are lost, each L runs on its own as any reference
        does)."""
        from cluster.pool import CHUNK, PoolError, run_bundles

        args = self.settings.args
        exact = engine_traits(args.engine).exact_replay
        if not exact or not self.replayable_draws() or args.replay == "off":
            return
        specs = [self.lossless_spec(n) for n in lengths]
        stores = [self.store(s) for s in specs]
        done = [store.load() for store in stores]
        todo = [it for it in self.items if any(it.id not in d or d[it.id].failed for d in done)]
        if not todo:
            return
        references = self.payload(self.target_only())  # before the bar: its rate and ETA are the bundle's alone
        bar = Progress(f"lossless references at L {lengths[0]}..{lengths[-1]} (one pass per item)", len(todo))

        def on_records(per_spec: list[Record]) -> None:
            for store, d, record in zip(stores, done, per_spec, strict=True):
                store.append(record)
                d[record.item_id] = record
            bar.update(per_spec[0])

        try:
            run_bundles(self.workers, self.settings.bench.ref, specs, todo, references, on_records,
                        chunk=self.shard_size(todo) or CHUNK)
        except PoolError as err:
            log(f"lossless references in one pass per item failed ({err}): each L runs on its own")
        bar.close()
        for store, d in zip(stores, done, strict=True):
            store.write_parquet(d.values())
