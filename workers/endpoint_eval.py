"""Benchmark items through an OpenAI-compatible server (``workers.endpoint``): one :class:`~workers.evaluation.Record`
per item and side, as the in-process engines make them, so the same metrics, bounds and certificates read them.

A side's records hold what the server told: output text, finish reasons, token counts (``usage``), the seconds to
the first token (``prefill_time_s``) and in all (``wall_time_s``), and, where the server reports its rule
(spectune's ``spec_decode`` field), drafts and accepted tokens. A request that still failed after its retries is a
failed record (score NaN): it counts against its side, and the batch goes on.

:func:`compare` runs both sides chunk by chunk at a concurrency, interleaved (the side that goes first alternates,
and each chunk's first prompts are sent once, untimed, with one output token before either side's clock starts, so
neither side runs on a colder prefix cache), timing each chunk's requests only:
scoring (a sandbox, a judge) runs after the chunk's clock stops. A chunk's records and its wall are stored together
when it ends. A record once stored is never sent again (an item's outcome is drawn once: a rerun may not redraw it
on a nondeterministic server); an interrupted chunk's stored records are kept untimed, and only its missing items
are sent on the rerun. Chunks hold 8 x the concurrency (at least 16) items, fewer where that would leave a run
with fewer than 5 chunks (:func:`chunk_size`): the chunks are the paired units the tokens/s ratio's interval is
formed from (:func:`speed_interval`). :func:`knob_verdict` says whether a server applied the candidate's settings
(applied, ignored, or cannot tell yet, with what would decide), from its rule reports, the outputs at T = 0 and one
request in flight, and its ``/metrics`` acceptance pooled over every chunk of every level.
"""

from __future__ import annotations

import json
import math
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from workers.endpoint import (
    Endpoint,
    Reply,
    RequestFailed,
    complete,
    counts_between,
    run_concurrently,
    settled_counters,
    spec_counters,
)
from workers.endpoint_checks import (  # noqa: F401 - knob_check, knob_verdict, reported: public here too
    chunk_size,
    knob_check,
    knob_verdict,
    reported,
    speed_interval,
    truncation,
    truncation_warning,
)
from workers.evaluation import Record, code_version
from workers.prompts import plain_prompt


@dataclass(frozen=True)
class Side:
    """A side of an endpoint comparison: its server and settings, and its label (``reference`` / ``candidate``)."""

    label: str
    endpoint: Endpoint
    policy: str  # what the records call the rule ("target-only", a rule name, or "server" as configured)
    params: dict[str, Any] = field(default_factory=dict)
    draft_len: int = 0


@dataclass
class Fetched:
    """One item's replies on one side (every turn), or the request failure that stopped it."""

    item: Any
    replies: list[Reply] = field(default_factory=list)
    error: BaseException | None = None


def fetch(side: Side, bench: Any, item: Any, *, shots: int, max_new_tokens: int, temperature: float,
          seed: int) -> Fetched:
    """Every turn of ``item`` on ``side``'s server (a later turn follows the earlier replies). Never raises."""
    got = Fetched(item)
    previous: list[tuple[str, str]] = []
    try:
        for turn in range(len(item.turns)):
            messages = bench.messages(item, shots=shots, turn=turn, previous=previous)
            chat = getattr(bench, "chat", None) is not False
            reply = complete(side.endpoint, messages if chat else None, None if chat else plain_prompt(messages),
                             max_tokens=max_new_tokens, temperature=temperature, seed=seed + turn,
                             stop=list(getattr(bench, "stop", ()) or ()) or None)
            got.replies.append(reply)
            previous.append((item.turns[turn], reply.text))
    except Exception as err:  # noqa: BLE001 - one item's failure is its record, never the batch's
        got.error = err
    return got


def record_of(side: Side, bench: Any, got: Fetched, spec_key: str, reference_outputs: list[str] | None) -> Record:
    """``got`` scored, as a record (scoring runs outside the timed requests). Never raises."""
    item, replies = got.item, got.replies
    outputs = [r.text for r in replies]
    reports = [r.report for r in replies if r.report]
    per_pos: list[int] = []
    for rep in reports:
        for i, v in enumerate(rep.get("accepted_per_position") or []):
            per_pos.extend([0] * (i + 1 - len(per_pos)))
            per_pos[i] += int(v)
    error = None
    if got.error is not None:
        err = got.error
        score, extracted = math.nan, None
        reason = f"failed: request: {err}" if isinstance(err, RequestFailed) else f"failed: {type(err).__name__}: {err}"
        error = f"RequestFailed: {err}" if isinstance(err, RequestFailed) else \
            "".join(traceback.format_exception_only(type(err), err)).strip()
    else:
        try:  # the reference scores against its own outputs where a scorer needs some (MT-bench), as in-process
            refs = reference_outputs if reference_outputs is not None else (outputs if side.label == "reference" else None)
            scored = bench.score(item, outputs, reference_outputs=refs)
            score, extracted, reason = float(scored.score), scored.extracted, scored.reason
        except Exception as err:  # noqa: BLE001
            score, extracted, reason = math.nan, None, f"failed: {type(err).__name__}: {err}"
            error = "".join(traceback.format_exception_only(type(err), err)).strip()
    drafts = sum(int(r.get("num_drafts") or 0) for r in reports)
    drafted = sum(int(r.get("num_draft_tokens") or 0) for r in reports)
    tokens = sum(r.completion_tokens for r in replies)
    # target steps, as the in-process engines count them: a verify round each where the server speculated, a
    # step per token where it did not (target-only decoding, or a server that reports no rule)
    target_steps = drafts if drafts else tokens
    params = {**side.params, "reported": reports[-1]} if reports else dict(side.params)
    return Record(item_id=item.id, index=item.index, benchmark=bench.name, spec_key=spec_key, policy=side.policy,
                  params=json.dumps(params, sort_keys=True, default=str), draft_len=side.draft_len, outputs=outputs,
                  score=score, extracted=extracted, reason=reason, tokens=tokens,
                  num_drafts=drafts, num_draft_tokens=drafted,
                  num_accepted_tokens=sum(int(r.get("num_accepted_tokens") or 0) for r in reports),
                  accepted_per_position=per_pos or [0] * side.draft_len, target_forwards=target_steps,
                  draft_forwards=drafted,
                  prefill_time_s=sum(r.ttft_s for r in replies), draft_time_s=0.0, verify_time_s=0.0,
                  policy_time_s=0.0, wall_time_s=sum(r.seconds for r in replies),
                  finish_reasons=[r.finish for r in replies], error=error,
                  retries=sum(r.attempts - 1 for r in replies), code=code_version())


def warm(endpoints: Sequence[Endpoint], bench: Any, items: Sequence[Any], concurrency: int, *, shots: int) -> None:
    """Untimed, before a chunk's clocks start: each item's first prompt, one output token, once per server (by url
    and model), so that no arm runs on a colder prefix cache than another because it went first. Failures are
    ignored: a warm-up is never evidence."""
    seen: set[tuple[str, str]] = set()
    for endpoint in endpoints:
        if (endpoint.base_url, endpoint.model) in seen:
            continue
        seen.add((endpoint.base_url, endpoint.model))
        quick = replace(endpoint, retries=0)

        def one(item: Any, quick: Endpoint = quick) -> None:
            try:
                messages = bench.messages(item, shots=shots, turn=0, previous=[])
                chat = getattr(bench, "chat", None) is not False
                complete(quick, messages if chat else None, None if chat else plain_prompt(messages), max_tokens=1,
                         temperature=0.0)
            except Exception:  # noqa: BLE001 - a warm-up that fails warms nothing, and that is all
                return

        run_concurrently(one, items, concurrency)


def tpot_s(record: Record) -> float:
    """A record's time per output token after each turn's first (its streamed decode), or NaN."""
    n = record.tokens - len(record.finish_reasons)
    return (record.wall_time_s - record.prefill_time_s) / n if n > 0 and not record.failed else math.nan


def percentile(values: Sequence[float], q: float) -> float:
    vals = sorted(v for v in values if math.isfinite(v))
    if not vals:
        return math.nan
    k = (len(vals) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return vals[lo] + (vals[hi] - vals[lo]) * (k - lo)


@dataclass
class SideRun:
    """A side's records at one concurrency and its chunks (items, wall seconds, /metrics counts)."""

    records: dict[str, Record]
    chunks: list[dict[str, Any]] = field(default_factory=list)

    def timed(self) -> tuple[list[Record], float]:
        """The records of the chunks that lie wholly in this run's items, and those chunks' walls: a chunk that
        held other items (a run over another --limit) has no wall of these items' own."""
        recs: list[Record] = []
        wall = 0.0
        for chunk in self.chunks:
            if all(i in self.records for i in chunk["items"]):
                recs.extend(self.records[i] for i in chunk["items"])
                wall += chunk["wall_s"]
        return recs, wall

    @property
    def tokens_per_s(self) -> float:
        recs, wall = self.timed()
        return sum(r.tokens for r in recs if not r.failed) / wall if wall > 0 else math.nan

    def acceptance(self) -> tuple[float, float] | None:
        """(accepted, drafted) tokens from /metrics over this run's chunks, or None where the server had none."""
        got = [c["counts"] for c in self.chunks if c.get("counts") is not None
               and all(i in self.records for i in c["items"])]
        return (sum(a for a, _ in got), sum(d for _, d in got)) if got else None

    def gauge(self) -> list[float]:
        """The gauge samples (:class:`GaugeSampler`) of this run's chunks: a server without acceptance counters."""
        return [v for c in self.chunks if all(i in self.records for i in c["items"]) for v in c.get("gauge") or []]

    def figures(self) -> dict[str, Any]:
        recs = list(self.records.values())
        timed, wall = self.timed()
        tpot = [tpot_s(r) for r in recs]
        ttft = [r.prefill_time_s / max(1, len(r.finish_reasons)) for r in recs if not r.failed]
        counts = self.acceptance()
        cut, replies = truncation(self)
        return {"items": len(recs), "failed": sum(r.failed for r in recs), "timed_items": len(timed),
                "tokens_per_s": self.tokens_per_s, "wall_s": wall,
                # requests in flight on average: short of the stated concurrency where chunks drain
                "effective_concurrency": sum(r.wall_time_s for r in timed) / wall if wall > 0 else math.nan,
                "retries": sum(r.retries for r in recs),
                "tpot_p50_s": percentile(tpot, 0.5), "tpot_p90_s": percentile(tpot, 0.9),
                "ttft_p50_s": percentile(ttft, 0.5), "ttft_p90_s": percentile(ttft, 0.9),
                "acceptance": counts[0] / counts[1] if counts and counts[1] > 0 else
                (sum(self.gauge()) / len(self.gauge()) if self.gauge() else None),
                "accepted_tokens": counts[0] if counts else None, "drafted_tokens": counts[1] if counts else None,
                # replies that stopped at the length limit: their answers are cut off
                "length_limited": cut, "replies": replies}


@dataclass
class Comparison:
    """Both sides at one concurrency, on the same items, run interleaved chunk by chunk."""

    concurrency: int
    reference: SideRun
    candidate: SideRun
    resumed: dict[str, int] = field(default_factory=dict)  # per side: items held from an earlier run

    @property
    def sides(self) -> dict[str, SideRun]:
        return {"reference": self.reference, "candidate": self.candidate}


def _load_chunks(path: Path) -> list[dict[str, Any]]:
    out = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue  # a line torn by a crash: its chunk is untimed
    return out


class GaugeSampler:
    """A server whose acceptance is only a gauge of its last decode window (SGLang's ``sglang:spec_accept_rate``),
    read every ``every_s`` while a chunk runs: the distinct consecutive values (one per window the server logged)."""

    def __init__(self, endpoint: Endpoint, every_s: float = 0.5, before: float | None = None) -> None:
        import threading

        self.endpoint, self.every_s, self.values = endpoint, every_s, []
        self._last = before  # the value before the chunk: a window of earlier traffic, never a sample of this one
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(self.every_s):
            try:
                value = (spec_counters(self.endpoint) or {}).get("accept_rate_gauge")
            except Exception:  # noqa: BLE001 - a failed read is a missing sample, never the run's end
                continue
            if value is not None and value != self._last:
                self.values.append(float(value))
                self._last = value

    def stop(self) -> list[float]:
        self._done.set()
        self._thread.join()
        return self.values


class Progress:
    """Per-item progress with an ETA while a level runs: a line when a request finishes (at most one every
    ``gap_s``), and a line after ``every_s`` without one, so that a slow server is never silent for longer."""

    def __init__(self, log: Callable[[str], None], concurrency: int, total: int, every_s: float = 30.0,
                 gap_s: float = 5.0) -> None:
        import threading

        self.log, self.concurrency, self.total, self.every_s, self.gap_s = log, concurrency, total, every_s, gap_s
        self.done_n, self.tokens, self.where = 0, 0, ""
        self.t0 = self.last = time.monotonic()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True)
        if total:
            self._thread.start()

    def _line(self, now: float) -> str:
        elapsed = now - self.t0
        eta = f"ETA {_clock(elapsed / self.done_n * (self.total - self.done_n))}" if self.done_n else "ETA n/a"
        rate = f"{self.tokens / elapsed:.1f} tok/s" if elapsed > 0 else "n/a tok/s"
        return (f"concurrency {self.concurrency}: {self.done_n}/{self.total} requests done{self.where} | {rate} | "
                f"{_clock(elapsed)} so far | {eta}")

    def at(self, where: str) -> None:
        """Where the run is (a chunk and a side), named in the next lines."""
        with self._lock:
            self.where = where

    def done(self, tokens: int) -> None:
        with self._lock:
            self.done_n += 1
            self.tokens += tokens
            now = time.monotonic()
            if now - self.last >= self.gap_s or self.done_n == self.total:
                self.last = now
                self.log(self._line(now))

    def _beat(self) -> None:
        while not self._stop.wait(min(1.0, self.every_s / 3)):
            with self._lock:
                now = time.monotonic()
                if now - self.last >= self.every_s:
                    self.last = now
                    self.log(self._line(now) + " (waiting on the server)")

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


def _clock(seconds: float) -> str:
    seconds = max(0, round(seconds))
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else \
        f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def compare(reference: Side, candidate: Side, bench: Any, items: Sequence[Any], concurrency: int, stores: Any,
            *, chunk: int | None = None, log: Callable[[str], None] = print, spec_key: str,
            restart: str = "--fresh starts over", **decode: Any) -> Comparison:
    """Both sides on ``items`` at ``concurrency``, interleaved chunk by chunk (see the module). ``stores(label)``: that
    side's ``RecordStore`` and its chunk log; what a side already holds (records of a whole stored chunk) is not
    sent again."""
    size = chunk or chunk_size(len(items), concurrency)
    runs: dict[str, SideRun] = {}
    held: dict[str, Any] = {}
    for side in (reference, candidate):
        store, walls = stores(side.label)
        chunks = _load_chunks(walls)
        # every stored record is kept, never drawn again; one whose chunk has no wall line (a crash between the
        # records and the line) is untimed: SideRun.timed counts only whole chunks with their walls
        runs[side.label] = SideRun(store.load(), chunks)
        held[side.label] = (store, walls)
    wanted = {it.id for it in items}
    resumed = {label: len(wanted & set(run.records)) for label, run in runs.items()}
    todo = [it for it in items if any(it.id not in runs[s.label].records for s in (reference, candidate))]
    if any(resumed.values()):
        log(f"concurrency {concurrency}: resuming: {resumed['reference']} reference and {resumed['candidate']} "
            f"candidate records of {len(items)} items held ({held['candidate'][0].dir.parent.parent}); {restart}")
    t0, n_done = time.perf_counter(), 0
    n_chunks = math.ceil(len(todo) / size)
    progress = Progress(log, concurrency, sum(it.id not in runs[s.label].records for it in todo
                                               for s in (reference, candidate)))
    try:
        for k, start in enumerate(range(0, len(todo), size)):
            n_done = _chunk(k, todo[start: start + size], n_chunks, reference, candidate, bench, concurrency, runs,
                            held, progress, spec_key, decode, n_done)
            elapsed = time.perf_counter() - t0
            log(f"concurrency {concurrency}: {n_done}/{len(todo)} items on both sides | "
                f"{runs['candidate'].tokens_per_s:.1f} tok/s candidate, {runs['reference'].tokens_per_s:.1f} "
                f"reference | ETA {elapsed / n_done * (len(todo) - n_done):.0f}s")
    finally:
        progress.stop()
    for side in (reference, candidate):
        held[side.label][0].write_parquet(runs[side.label].records.values())
    keep = [it.id for it in items]
    return Comparison(concurrency, *(SideRun({i: runs[s].records[i] for i in keep if i in runs[s].records},
                                             runs[s].chunks) for s in ("reference", "candidate")), resumed)


def _chunk(k: int, part: list[Any], n_chunks: int, reference: Side, candidate: Side, bench: Any, concurrency: int,
           runs: dict[str, SideRun], held: dict[str, Any], progress: Progress, spec_key: str, decode: dict[str, Any],
           n_done: int) -> int:
    """One chunk on both sides (the one that goes first alternates), its records and wall stored; returns the items
    done so far."""
    import os

    order = (reference, candidate) if k % 2 == 0 else (candidate, reference)  # who goes first alternates
    warm([reference.endpoint, candidate.endpoint], bench,
         [it for it in part if any(it.id not in runs[s.label].records for s in order)], concurrency,
         shots=decode.get("shots", 0))
    fetched: dict[str, tuple[list[Fetched], dict[str, Any]]] = {}
    for side in order:
        run = runs[side.label]
        missing = [it for it in part if it.id not in run.records]
        if not missing:
            continue
        before = spec_counters(side.endpoint)
        sampler = GaugeSampler(side.endpoint, before=before["accept_rate_gauge"]) \
            if before and "accept_rate_gauge" in before else None
        progress.at(f" (chunk {k + 1}/{n_chunks}, {side.label})")
        t1 = time.perf_counter()
        try:
            got = run_concurrently(lambda it, side=side: fetch(side, bench, it, **decode), missing, concurrency,
                                   on_done=lambda _, g: progress.done(sum(r.completion_tokens for r in g.replies)))
        finally:
            gauge = sampler.stop() if sampler is not None else None
        wall = time.perf_counter() - t1
        counts = counts_between(before, settled_counters(side.endpoint))
        fetched[side.label] = (got, {"items": [it.id for it in missing], "wall_s": wall, "counts": counts,
                                     # this machine's 1-minute load at the chunk's end, stated beside the speed
                                     "load": round(os.getloadavg()[0], 2),
                                     **({"gauge": gauge} if gauge is not None else {})})
    # scored after both clocks stopped, the reference first: a scorer that reads the reference's output
    # (MT-bench's) has it whichever side ran first
    for side in (reference, candidate):
        if side.label not in fetched:
            continue
        got, line = fetched[side.label]
        store, walls = held[side.label]
        run = runs[side.label]
        refs = runs["reference"].records if side is candidate else {}
        for g in got:
            ref = refs.get(g.item.id)
            rec = record_of(side, bench, g, spec_key, ref.outputs if ref is not None and not ref.failed else None)
            store.append(rec)
            run.records[rec.item_id] = rec
        run.chunks.append(line)
        walls.parent.mkdir(parents=True, exist_ok=True)
        with walls.open("a") as fh:  # after its records: a chunk without its wall line is untimed
            fh.write(json.dumps(line) + "\n")
    return n_done + len(part)


def comparison_lines(cmp: Comparison, alpha: float = 0.05, *, max_new_tokens: int | None = None,
                     shots: int | None = None) -> list[str]:
    """What ``jobs.evaluate --engine openai`` prints per concurrency: each side's tokens/s, TPOT and TTFT, accuracy
    and replies cut at the length limit, then the candidate against the reference (the speed ratio with its interval
    over paired chunks and this machine's load, the paired drop and its exact bound), and a warning where more than
    5% of a side's replies were cut."""
    from workers.certify.decide import drop_bound
    from workers.metrics.trial import score_of

    def ms(v: float) -> str:
        return f"{v * 1e3:7.1f} ms" if math.isfinite(v) else "    n/a"

    lines = [f"concurrency {cmp.concurrency}:"]
    for label, run in cmp.sides.items():
        f = run.figures()
        scores = [score_of(r) for r in run.records.values()]
        acc = sum(scores) / len(scores) if scores else math.nan
        tps = f"{f['tokens_per_s']:8.2f}" if math.isfinite(f["tokens_per_s"]) else "     n/a"
        lines.append(f"  {label:<9}  tokens/s {tps} (in flight {f['effective_concurrency']:.1f})   TPOT p50 "
                     f"{ms(f['tpot_p50_s'])} p90 {ms(f['tpot_p90_s'])}   TTFT p50 {ms(f['ttft_p50_s'])}   "
                     f"accuracy {acc * 100:5.1f}% (n={f['items']}, failed {f['failed']}, retries {f['retries']}, "
                     f"at the length limit {f['length_limited']}/{f['replies']})"
                     + (f"   acceptance {f['acceptance']:.3f} (/metrics)" if f["acceptance"] is not None else ""))
        if f["timed_items"] < f["items"]:
            lines.append(f"  {label:<9}  tokens/s counts {f['timed_items']} of {f['items']} items: the others were run "
                         "in chunks with other items (another --limit); --fresh times them all")
    keys = [k for k in cmp.reference.records if k in cmp.candidate.records]
    bound = drop_bound([score_of(cmp.reference.records[k]) for k in keys],
                       [score_of(cmp.candidate.records[k]) for k in keys], alpha)
    differ = sum(cmp.reference.records[k].outputs != cmp.candidate.records[k].outputs for k in keys)
    lines.append(f"  candidate over reference: tokens/s {speed_interval(cmp).text()}")
    lines.append(f"  candidate over reference: paired accuracy drop {bound.drop * 100:+.1f}% "
                 f"(exact {100 * (1 - alpha):g}% upper bound {bound.upper * 100:.1f}%, n={bound.n}, "
                 f"{bound.losses} lost / {bound.wins} won); outputs differ on {differ}/{len(keys)}")
    warning = truncation_warning(cmp, max_new_tokens, shots)
    return lines + ([warning] if warning else [])
