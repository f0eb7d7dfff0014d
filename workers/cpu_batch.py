"""The batched CPU engine: B items decoded at once by the CPU engine's own code, row for row exact.

Each row is a view of the engine (:meth:`workers.cpu_engine.SpecDecoder.row`) with KV caches of its own, running the
unchanged per-item code (``evaluate_item``: target-only, speculative decoding under any rule at any L, replay's
teacher-forced passes, decoding on from a divergence) in a coroutine (a greenlet, all in the calling thread). Where
that code calls a model (a decoder pass, an LM head, the draft's proposal head), the row hands the call to the
:class:`Batcher` and waits; once every running row waits, the batcher runs each kind of call once for all the rows
that asked for it, hands each its own part and lets the rows go on. So:

- the weights are read once per step for the whole batch (what a memory-bound step costs): the fast path's
  decoders run all the rows' new tokens as one ragged pass (:meth:`workers.models.fast._Decoder.forward_ragged`),
  attention per row over its own cache; the int8 and 4-bit heads run all the rows' hidden states in one GEMM;
- a row's acceptance is ragged (one row accepts 1, another L, and both go on in the next step), rows finish and
  new items join whenever a row is free (continuous batching), each row keeps its own random generator, and every
  rule decides on one row's tensors exactly as at batch 1;
- the shared few-shot prefix is computed once: a row whose cache shares less of a new prompt than another row's
  does copies those keys and values (the same numbers, computed from the same tokens at the same positions);
- **row for row exact**: a row's result does not depend on the rows beside it in any fast-path op (the linears'
  integer GEMMs with per-row activation scales, the 4-bit GEMM whose rows are measured independent at every row
  count the engine uses, row-wise norms, per-row attention), so every row's output is token for token the same
  item decoded alone at batch 1 with the same thread count (``tests/workers/test_cpu_batch.py``). A model that is not
  on the fast path (bf16, fp32: a GEMM's blocking, and so its rounding, changes with its row count) has each row's
  call run alone, in turn: exact, without the shared weight reads (:attr:`Batcher.shared` says which it is).

A call that fails for the batch is run again row by row, so one row's bad input fails that row alone.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

FORWARD, HEAD, PROPOSAL = 0, 1, 2  # a call's kind; a step runs the draft's calls first, then the target's


@dataclass
class BatchStats:
    """What the batcher ran: passes per kind and the rows they carried (the mean batch a step had)."""

    passes: int = 0
    rows: int = 0
    fallbacks: int = 0  # batched calls that failed and were run again row by row
    prefix_copies: int = 0  # caches filled from another row's shared prefix instead of a prefill
    prefix_tokens: int = 0
    seconds: float = 0.0
    by_kind: dict[str, list[int]] = field(default_factory=dict)  # kind -> [passes, rows]

    def to_json(self) -> dict[str, Any]:
        return {"passes": self.passes, "rows": self.rows, "fallbacks": self.fallbacks,
                "prefix_copies": self.prefix_copies, "prefix_tokens": self.prefix_tokens,
                "seconds": round(self.seconds, 3), "by_kind": self.by_kind}


class Batcher:
    """Runs jobs on ``size`` row views of ``engine``, their model calls batched (see the module docstring)."""

    def __init__(self, engine: Any, size: int) -> None:
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"batch size must be an integer >= 1, got {size!r}")
        import greenlet  # noqa: F401 - fail here, naming it, not inside the first job

        self.engine = engine
        self.size = size
        self.rows = [engine.row(self) for _ in range(size)]
        self.stats = BatchStats()
        self._hub: Any = None
        self._pending: dict[tuple[int, int, int], list[tuple[Any, Any, Any]]] = {}
        self._runners: dict[tuple[int, int, int], Callable[[list[Any]], list[Any]]] = {}

    @property
    def shared(self) -> bool:
        """Whether the rows share each weight read (both decoders on the fast path), or run in turn."""
        return all(_ragged(lm.decoder) for lm in (self.rows[0].target, self.rows[0].draft))

    # -- what a row calls ------------------------------------------------------------------------

    def active(self) -> bool:
        """Whether the caller is a row inside :meth:`run` (its model calls are to be batched)."""
        import greenlet

        return self._hub is not None and greenlet.getcurrent() is not self._hub

    def call(self, key: tuple[int, int, int], runner: Callable[[list[Any]], list[Any]], payload: Any) -> Any:
        """A row's model call: wait for the step, get this row's part of ``runner`` over every row's payload."""
        import greenlet

        self._runners[key] = runner
        self._pending.setdefault(key, []).append((greenlet.getcurrent(), payload, None))
        result = self._hub.switch()
        if isinstance(result, _Failed):
            raise result.error
        return result

    def donor(self, lm: Any, context: list[int], have: int) -> tuple[Any, int] | None:
        """Another row's cache of the same model sharing more of ``context`` than ``have`` tokens: it and how many."""
        best, length = None, have
        for row in self.rows:
            other = row.target if lm.rank == 1 else row.draft
            if other is lm or other.cache is None:
                continue
            n = _shared(other.ids, context, other.length)
            if n > length:
                best, length = other, n
        return None if best is None else (best, length)

    # -- the scheduler ---------------------------------------------------------------------------

    def run(self, jobs: Sequence[Callable[[Any], Any]], on_done: Callable[[int, Any], None] | None = None,
            stop: Callable[[], bool] | None = None) -> list[Any]:
        """Run every job (a callable taking a row view) on a free row, at most ``size`` at once; returns their
        results in ``jobs``' order. ``on_done(i, result)`` as each finishes; ``stop()`` True: start no more jobs
        (those running finish; the rest's results are None). A job that raises re-raises here once every running
        job has finished."""
        import greenlet

        if self._hub is not None:
            raise RuntimeError("Batcher.run is not re-entrant")
        results: list[Any] = [None] * len(jobs)
        errors: list[BaseException] = []
        queue = list(range(len(jobs)))[::-1]
        free = list(range(self.size))[::-1]
        running: dict[Any, tuple[int, int]] = {}  # greenlet -> (job index, row)
        self._hub = greenlet.getcurrent()

        def settle(g: Any, value: Any) -> None:
            """After ``g`` ran: finished (its result, its row free again) or waiting on a call."""
            if not g.dead:
                return
            i, row = running.pop(g)
            free.append(row)
            if isinstance(value, _Failed):
                errors.append(value.error)
                return
            results[i] = value
            if on_done is not None:
                on_done(i, value)

        def launch(i: int, row: int) -> None:
            def body(job=jobs[i], view=self.rows[row]) -> Any:
                try:
                    return job(view)
                except BaseException as err:  # noqa: BLE001 - handed to run(), raised once the others finish
                    return _Failed(err)
            g = greenlet.greenlet(body)
            running[g] = (i, row)
            settle(g, g.switch())

        # Rows whose caches are empty would each prefill a shared few-shot prefix: the first job runs one step
        # alone, so the others copy it from its cache (Batcher.donor) instead of computing it again.
        warm = any(row.target.ids for row in self.rows)
        try:
            with torch.inference_mode():
                while queue or running:
                    while queue and free and (warm or not running) and not (stop is not None and stop()):
                        launch(queue.pop(), free.pop())
                    if not running:
                        break
                    if not self._pending:
                        raise RuntimeError("batched rows neither finished nor asked for a model call")
                    self._step(settle)
                    warm = True
        finally:
            self._hub = None
            self._pending.clear()
            for g in list(running):
                g.throw(greenlet.GreenletExit)
        if errors:
            raise errors[0]
        return results

    def _step(self, settle: Callable[[Any, Any], None]) -> None:
        """One step: while any row waits on a draft call, only the draft's calls run (forward, then head and
        proposal, each once for every row asking), so the rows that wait to verify meet the drafting ones there
        and the target's pass carries them all; else the target's calls. A row that asks again in the same step,
        for a call of a later kind, is served in this step too."""
        rank = min(key[0] for key, asks in self._pending.items() if asks)
        last: tuple[int, int, int] | None = None
        while True:
            keys = [k for k, asks in self._pending.items() if asks and k[0] == rank and (last is None or k > last)]
            if not keys:
                return
            last = min(keys)
            asks = self._pending.pop(last)
            for (g, _, _), out in zip(asks, self._execute(last, [p for _, p, _ in asks]), strict=True):
                settle(g, g.switch(out))

    def _execute(self, key: tuple[int, int, int], payloads: list[Any]) -> list[Any]:
        runner = self._runners[key]
        t0 = time.perf_counter()
        try:
            outs = runner(payloads)
        except Exception:  # noqa: BLE001 - run again row by row: the row whose input fails fails alone
            self.stats.fallbacks += 1
            outs = []
            for p in payloads:
                try:
                    outs.append(runner([p])[0])
                except Exception as err:  # noqa: BLE001 - raised in that row (its evaluate_item records it)
                    outs.append(_Failed(err))
        self.stats.seconds += time.perf_counter() - t0
        self.stats.passes += 1
        self.stats.rows += len(payloads)
        name = f"{'draft' if key[0] == 0 else 'target'}-{('forward', 'head', 'proposal')[key[1]]}"
        kind = self.stats.by_kind.setdefault(name, [0, 0])
        kind[0] += 1
        kind[1] += len(payloads)
        return outs


@dataclass
class _Failed:
    error: BaseException


def _shared(ids: list[int], context: list[int], limit: int) -> int:
    n = 0
    for a, b in zip(ids[:limit], context, strict=False):
        if a != b:
            break
        n += 1
    return n


def _ragged(decoder: Any) -> bool:
    ready = getattr(decoder, "ragged_ready", None)
    return bool(ready is not None and ready())


def forward_runner(decoder: Any) -> Callable[[list[Any]], list[Tensor]]:
    """Decoder passes for several rows: ``(lm, input_ids [1, n])`` each -> hidden states [1, n, d] each."""

    def run(payloads: list[Any]) -> list[Tensor]:
        if len(payloads) > 1 and _ragged(decoder):
            return decoder.forward_ragged([(ids[0], lm.cache) for lm, ids in payloads])
        outs = []
        for lm, ids in payloads:
            out = decoder(input_ids=ids, past_key_values=lm.cache, use_cache=True)
            lm.cache = out.past_key_values
            outs.append(out.last_hidden_state)
        return outs
    return run


def rows_runner(linear: Callable[[Tensor], Tensor], row_exact: bool) -> Callable[[list[Tensor]], list[Tensor]]:
    """A head (or any row-wise linear) over several rows' hidden states [..., d]: one GEMM where ``row_exact`` (the
    fast path's int8 and 4-bit linears), else one call per row's tensor."""

    def run(payloads: list[Tensor]) -> list[Tensor]:
        if len(payloads) == 1 or not row_exact:
            return [linear(h) for h in payloads]
        flat = torch.cat([h.reshape(-1, h.shape[-1]) for h in payloads])
        out = linear(flat)
        sizes = [int(h.numel() // h.shape[-1]) for h in payloads]
        return [part.reshape(*h.shape[:-1], part.shape[-1]) for part, h in zip(out.split(sizes), payloads, strict=True)]
    return run


def row_exact_linear(linear: Any) -> bool:
    """Whether ``linear``'s rows are independent of the rows beside it (the fast path's int8 and 4-bit linears)."""
    from workers.models.q4 import Q4Linear
    from workers.models.q8 import QLinear

    return isinstance(linear, QLinear | Q4Linear)


class BatchedProposal:
    """A row's view of the engine's :class:`workers.models.proposal.ProposalHead`: its GEMM batched."""

    def __init__(self, proposal: Any, batcher: Batcher) -> None:
        self.ids = proposal.ids
        self._proposal = proposal
        self._batcher = batcher
        self._runner = rows_runner(proposal.logits, row_exact_linear(getattr(proposal, "_linear", None)))

    def logits(self, hidden: Tensor) -> Tensor:
        if not self._batcher.active():
            return self._proposal.logits(hidden)
        return self._batcher.call((0, PROPOSAL, 0), self._runner, hidden)

    def argmax(self, hidden: Tensor) -> Tensor:
        return self.ids[self.logits(hidden).argmax(dim=-1)]


# A target step faster than this at one row is overhead-bound (the tiny test pair: ~0.7 ms): the batched engine's
# per-row bookkeeping (a coroutine switch per model call, the calls' grouping) costs more than the weight reads it
# shares, so ``auto`` keeps batch 1 (measured on the tiny pair at batch 3: 0.41x batch 1's tokens/s)
OVERHEAD_BOUND_S = 0.005


def pick_batch_size(engine: Any, context: int = 512, sizes: Sequence[int] = (1, 2, 4, 8, 16, 32),
                    keep: float = 0.85, memory_gib: float | None = None) -> tuple[int, dict[str, Any]]:
    """``--batch-size auto``: time one target step of b one-token rows over ``context`` cached positions (the
    workload's: ``workers.models.calibrate.workload_context``) for each b of ``sizes`` (the weights' reads and the
    per-row attention a batched step pays) and take the smallest b whose rows per second reach ``keep`` of the
    best, within the memory the rows' KV caches may take (``memory_gib``, default a quarter of the machine's
    available memory). Returns it and the measurements. The choice is kept in the pair's cache beside its cost
    profile, keyed like it (machine, kernels, threads, context), and read back by later starts."""
    decoder = engine.pair.target.get_decoder()
    if not _ragged(decoder):
        return 1, {"why": "not the fast path: rows would run in turn, so batching gains nothing"}
    path = _choice_path(engine.pair, context)
    if path is not None and path.is_file():
        try:
            stored = json.loads(path.read_text())
            return int(stored["batch_size"]), {**stored["measured"], "stored": str(path)}
        except (OSError, ValueError, KeyError, TypeError):
            pass  # unreadable: measure again
    per_token = _kv_bytes_per_token(engine.pair.target) + _kv_bytes_per_token(engine.pair.draft)
    budget = (memory_gib if memory_gib is not None else _available_gib() / 4) * 2 ** 30
    rows_per_s: dict[int, float] = {}
    from workers.models.calibrate import _fill

    with torch.inference_mode():
        base = engine.pair.target.new_cache()
        if not _fill(base, context, torch.Generator().manual_seed(0)):  # what the cache holds does not change a
            decoder.forward_ragged([(torch.arange(context) % 200 + 10, base)])  # step's cost: random keys suffice
        for b in sizes:
            if b * per_token * 2 * context > budget:
                break
            caches = [engine.pair.target.new_cache() for _ in range(b)]
            for c in caches:
                c.copy_prefix(base, context)
            feeds = [(torch.tensor([7]), c) for c in caches]
            decoder.forward_ragged(feeds)  # warm
            # the fastest of at least 3 steps (more where steps are short: 50 ms of them, at most 50): a step's
            # own cost, not the moments another process took the core (one such moment in 3 steps of the tiny
            # pair read as a 4x slower batch 1 beside a busy suite)
            steps: list[float] = []
            spent = 0.0
            while len(steps) < 3 or (spent < 0.05 and len(steps) < 50):
                for c in caches:
                    c.crop(context)
                t0 = time.perf_counter()
                decoder.forward_ragged(feeds)
                steps.append(time.perf_counter() - t0)
                spent += steps[-1]
            rows_per_s[b] = b / min(steps)
    best = max(rows_per_s.values())
    chosen = min(b for b, r in rows_per_s.items() if r >= keep * best)
    if rows_per_s.get(1, 0.0) * OVERHEAD_BOUND_S > 1:  # a step of microseconds: nothing to share, rows cost more
        chosen = 1
    measured = {"context": context, "rows_per_s": {str(k): round(v, 1) for k, v in rows_per_s.items()},
                "keep": keep, "kv_bytes_per_token": per_token, "threads": torch.get_num_threads()}
    if path is not None:
        try:
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"batch_size": chosen, "measured": measured}, indent=1))
            tmp.replace(path)
        except OSError:
            pass  # a read-only cache: measured again next time
    return chosen, measured


def _choice_path(pair: Any, context: int) -> Path | None:
    """Where ``pick_batch_size``'s choice for ``pair`` at ``context`` is kept (None: the pair has no cache)."""
    if getattr(pair, "cache_dir", None) is None:
        return None
    from workers.models.calibrate import fingerprint, machine_key
    from workers.models.pair import dtype_tag

    return Path(pair.cache_dir) / (f"batch-{dtype_tag(pair.dtype)}-{machine_key()}-{fingerprint(pair)}-"
                                   f"{torch.get_num_threads()}t-ctx{int(context)}.json")


def _kv_bytes_per_token(model: Any) -> int:
    decoder = model.get_decoder()
    layers = len(decoder.layers)
    return int(layers * 2 * decoder.kv_heads * decoder.head_dim * 4)


def _available_gib() -> float:
    """The machine's available memory (``MemAvailable``), or 8 GiB where /proc/meminfo does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 2 ** 20
    except OSError:
        pass
    return 8.0
