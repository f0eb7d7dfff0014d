"""Benchmark items through an OpenAI-compatible server (``workers.endpoint``): one :class:`~workers.evaluation.Record`
per item and side, as the in-process engines make them, so the same metrics, bounds and certificates read them.

A side's records hold what the server told: output text, finish reasons, token counts (``usage``), the seconds to
the first token (``prefill_time_s``) and in all (``wall_time_s``), and, where the server reports its rule
(spectune's ``spec_decode`` field), drafts and accepted tokens. A request that still failed after its retries is a
failed record (score NaN): it counts against its side, and the batch goes on.

:func:`run_side` runs a side's items at a concurrency, resumable through a record store, and times the whole run
(:class:`SideRun`: output tokens/s of the run, per-request TPOT and TTFT percentiles). :func:`knob_check` says
whether a server applied the candidate's settings, from its rule reports or its ``/metrics`` counters.
"""

from __future__ import annotations

import json
import math
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from workers.endpoint import Endpoint, RequestFailed, complete, run_concurrently
from workers.evaluation import Record
from workers.prompts import plain_prompt


@dataclass(frozen=True)
class Side:
    """A side of an endpoint comparison: its server and settings, and its label (``reference`` / ``candidate``)."""

    label: str
    endpoint: Endpoint
    policy: str  # what the records call the rule ("target_only", a rule name, or "server" as configured)
    params: dict[str, Any] = field(default_factory=dict)
    draft_len: int = 0


def evaluate_remote(side: Side, bench: Any, item: Any, *, shots: int, max_new_tokens: int, temperature: float,
                    seed: int, spec_key: str, reference_outputs: list[str] | None = None) -> Record:
    """Every turn of ``item`` on ``side``'s server, scored. Never raises for the item's own failure."""
    outputs: list[str] = []
    finishes: list[str] = []
    previous: list[tuple[str, str]] = []
    tokens = drafts = drafted = accepted = 0
    seconds = ttft = 0.0
    per_pos: list[int] = []
    error = None
    reports: list[dict[str, Any]] = []
    try:
        for turn in range(len(item.turns)):
            messages = bench.messages(item, shots=shots, turn=turn, previous=previous)
            chat = getattr(bench, "chat", None) is not False
            reply = complete(side.endpoint, messages if chat else None, None if chat else plain_prompt(messages),
                             max_tokens=max_new_tokens, temperature=temperature, seed=seed + turn,
                             stop=list(getattr(bench, "stop", ()) or ()) or None)
            outputs.append(reply.text)
            finishes.append(reply.finish)
            previous.append((item.turns[turn], reply.text))
            tokens += reply.completion_tokens
            seconds += reply.seconds
            ttft += reply.ttft_s
            if reply.report:
                reports.append(reply.report)
                drafts += int(reply.report.get("num_drafts") or 0)
                drafted += int(reply.report.get("num_draft_tokens") or 0)
                accepted += int(reply.report.get("num_accepted_tokens") or 0)
                for i, v in enumerate(reply.report.get("accepted_per_position") or []):
                    per_pos.extend([0] * (i + 1 - len(per_pos)))
                    per_pos[i] += int(v)
        scored = bench.score(item, outputs, reference_outputs=reference_outputs)
        score, extracted, reason = float(scored.score), scored.extracted, scored.reason
    except RequestFailed as err:
        score, extracted, reason, error = math.nan, None, f"failed: request: {err}", f"RequestFailed: {err}"
    except Exception as err:  # noqa: BLE001 - one item's failure is its record, never the batch's
        score, extracted, reason = math.nan, None, f"failed: {type(err).__name__}: {err}"
        error = "".join(traceback.format_exception_only(type(err), err)).strip()
    return Record(item_id=item.id, index=item.index, benchmark=bench.name, spec_key=spec_key, policy=side.policy,
                  params=json.dumps({**side.params, "reported_policy": reports[-1].get("policy") if reports else None}
                                    if reports else side.params, sort_keys=True),
                  draft_len=side.draft_len, outputs=outputs, score=score, extracted=extracted, reason=reason,
                  tokens=tokens, num_drafts=drafts, num_draft_tokens=drafted, num_accepted_tokens=accepted,
                  accepted_per_position=per_pos or [0] * side.draft_len, target_forwards=drafts,
                  draft_forwards=drafted, prefill_time_s=ttft, draft_time_s=0.0, verify_time_s=0.0, policy_time_s=0.0,
                  wall_time_s=seconds, finish_reasons=finishes, error=error)


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
    """A side's records at one concurrency and the wall seconds its requests took, chunk by chunk."""

    records: dict[str, Record]
    wall_s: float = 0.0  # the chunks' walls (the side's own requests in flight), summed

    @property
    def tokens_per_s(self) -> float:
        ok = [r for r in self.records.values() if not r.failed]
        return sum(r.tokens for r in ok) / self.wall_s if self.wall_s > 0 else math.nan

    def figures(self) -> dict[str, float]:
        recs = list(self.records.values())
        tpot = [tpot_s(r) for r in recs]
        ttft = [r.prefill_time_s / max(1, len(r.finish_reasons)) for r in recs if not r.failed]
        return {"items": len(recs), "failed": sum(r.failed for r in recs), "tokens_per_s": self.tokens_per_s,
                "tpot_p50_s": percentile(tpot, 0.5), "tpot_p90_s": percentile(tpot, 0.9),
                "ttft_p50_s": percentile(ttft, 0.5), "ttft_p90_s": percentile(ttft, 0.9), "wall_s": self.wall_s}


def run_chunk(side: Side, bench: Any, items: Sequence[Any], concurrency: int, *, on_record: Callable[[Record], None],
              references: dict[str, Record] | None = None, **decode: Any) -> float:
    """``items`` on ``side`` at ``concurrency``; each record handed to ``on_record`` as it finishes. Returns the wall
    seconds from the first request to the last reply."""
    def one(item: Any) -> Record:
        refs = references[item.id].outputs if references and item.id in references else None
        return evaluate_remote(side, bench, item, reference_outputs=refs, **decode)

    t0 = time.perf_counter()
    run_concurrently(one, list(items), concurrency, on_done=lambda _i, rec: on_record(rec))
    return time.perf_counter() - t0


def knob_check(candidate: Side, records: dict[str, Record], acceptance: dict[str, float | None]) -> str | None:
    """Whether the server applied the candidate's settings: None if it did (or nothing was asked of it), else the
    one line that says what was checked. Spectune's rule fields (``spec_decode`` in the extra body): every reply
    must report the rule asked for. Anything else: the ``/metrics`` acceptance must differ between the sides
    (``acceptance``: per side, None where the server exposes no counters)."""
    # spectune's own endpoint reports the rule it ran; anything else (a stock vllm serve with the plugin's
    # vllm_xargs, another engine's fields) shows only in its /metrics acceptance
    asked = candidate.endpoint.extra_body.get("spec_decode")
    ok = [r for r in records.values() if not r.failed]
    if isinstance(asked, dict) and asked.get("policy") not in (None, "off"):
        ran = {json.loads(r.params).get("reported_policy") for r in ok}
        if not ok:
            return None
        if ran != {asked["policy"]}:
            return (f"refused: the candidate asked for rule {asked['policy']!r} in spec_decode, but the server's replies "
                    f"reported {sorted(str(x) for x in ran)} (none: no rule report): it ignores the knobs")
        return None
    if not candidate.endpoint.extra_body:
        return None
    ref, cand = acceptance.get("reference"), acceptance.get("candidate")
    if ref is None or cand is None:
        return ("refused: cannot tell whether the server applied the candidate's extra body: its replies carry no "
                "rule report and its /metrics exposes no speculative-decoding counters")
    if abs(ref - cand) < 1e-9:
        return (f"refused: acceptance did not move between the sides ({ref:.4f} both, from /metrics): the server "
                "ignores the candidate's settings")
    return None


@dataclass
class Comparison:
    """Both sides at one concurrency, on the same items, run interleaved chunk by chunk."""

    concurrency: int
    reference: SideRun
    candidate: SideRun
    acceptance: dict[str, float | None] = field(default_factory=dict)  # per side, from /metrics (None: unknown)


def compare(reference: Side, candidate: Side, bench: Any, items: Sequence[Any], concurrency: int, stores: Any,
            *, chunk: int | None = None, log: Callable[[str], None] = print, **decode: Any) -> Comparison:
    """Both sides on ``items`` at ``concurrency``, interleaved: a chunk of items on the reference, the same chunk on
    the candidate, the next chunk... (so load drifts hit both alike). ``stores(label)``: that side's record store
    and its chunk log (``RecordStore`` and a path); items already held are not sent again (a rerun resumes), and
    the walls of the chunks that ran are kept beside the records."""
    from workers.endpoint import acceptance_between, spec_counters

    size = chunk or max(4 * concurrency, 8)
    runs: dict[str, SideRun] = {}
    held: dict[str, Any] = {}
    for side in (reference, candidate):
        store, walls = stores(side.label)
        done = store.load()
        wall = sum(json.loads(line)["wall_s"] for line in walls.read_text().splitlines()) if walls.is_file() else 0.0
        runs[side.label] = SideRun({k: v for k, v in done.items()}, wall)
        held[side.label] = (store, walls)
    seen: dict[str, list[float]] = {"reference": [], "candidate": []}
    counted: dict[str, list[float | None]] = {"reference": [], "candidate": []}
    todo = [it for it in items if any(it.id not in runs[s.label].records for s in (reference, candidate))]
    t0, n_done = time.perf_counter(), 0
    for start in range(0, len(todo), size):
        part = todo[start: start + size]
        for side in (reference, candidate):
            store, walls = held[side.label]
            run = runs[side.label]
            missing = [it for it in part if it.id not in run.records]
            if not missing:
                continue
            before = spec_counters(side.endpoint)

            def keep(rec: Record, store=store, run=run) -> None:
                store.append(rec)
                run.records[rec.item_id] = rec

            refs = runs["reference"].records if side is candidate else None
            wall = run_chunk(side, bench, missing, concurrency, on_record=keep, references=refs, **decode)
            after = spec_counters(side.endpoint)
            rate = acceptance_between(before, after)
            counted[side.label].append(rate)
            if rate is not None:
                seen[side.label].append(rate)
            run.wall_s += wall
            walls.parent.mkdir(parents=True, exist_ok=True)
            with walls.open("a") as fh:
                fh.write(json.dumps({"items": [it.id for it in missing], "wall_s": wall}) + "\n")
        n_done += len(part)
        elapsed = time.perf_counter() - t0
        toks = sum(r.tokens for s in runs.values() for r in s.records.values())
        log(f"concurrency {concurrency}: {n_done}/{len(todo)} items on both sides | "
            f"{runs['candidate'].tokens_per_s:.1f} tok/s candidate, {runs['reference'].tokens_per_s:.1f} reference | "
            f"{toks:,} tokens held | ETA {elapsed / n_done * (len(todo) - n_done):.0f}s")
    for side in (reference, candidate):
        held[side.label][0].write_parquet(runs[side.label].records.values())
    acceptance = {k: (sum(v) / len(v) if v else None) for k, v in seen.items()}
    return Comparison(concurrency, *(SideRun({it.id: runs[s].records[it.id] for it in items if it.id in runs[s].records},
                                             runs[s].wall_s) for s in ("reference", "candidate")), acceptance)


def comparison_lines(cmp: Comparison, alpha: float = 0.05) -> list[str]:
    """What ``jobs.evaluate --engine openai`` prints per concurrency: each side's tokens/s, TPOT and TTFT and
    accuracy, then the candidate against the reference (speed ratio, the paired drop and its exact bound)."""
    from workers.certify.decide import drop_bound
    from workers.metrics.trial import score_of

    lines = [f"concurrency {cmp.concurrency}:"]
    for label, run in (("reference", cmp.reference), ("candidate", cmp.candidate)):
        f = run.figures()
        scores = [score_of(r) for r in run.records.values()]
        acc = sum(scores) / len(scores) if scores else math.nan
        rate = cmp.acceptance.get(label)
        lines.append(f"  {label:<9}  tokens/s {f['tokens_per_s']:8.2f}   TPOT p50 {f['tpot_p50_s'] * 1e3:7.1f} ms "
                     f"p90 {f['tpot_p90_s'] * 1e3:7.1f} ms   TTFT p50 {f['ttft_p50_s'] * 1e3:7.1f} ms   "
                     f"accuracy {acc * 100:5.1f}% (n={f['items']}, failed {f['failed']})"
                     + (f"   acceptance {rate:.3f} (/metrics)" if rate is not None else ""))
    keys = [k for k in cmp.reference.records if k in cmp.candidate.records]
    bound = drop_bound([score_of(cmp.reference.records[k]) for k in keys],
                       [score_of(cmp.candidate.records[k]) for k in keys], alpha)
    ratio = cmp.candidate.tokens_per_s / cmp.reference.tokens_per_s if cmp.reference.tokens_per_s > 0 else math.nan
    differ = sum(cmp.reference.records[k].outputs != cmp.candidate.records[k].outputs for k in keys)
    lines.append(f"  candidate over reference: tokens/s {ratio:.3f}x; paired accuracy drop {bound.drop * 100:+.1f}% "
                 f"(exact {100 * (1 - alpha):g}% upper bound {bound.upper * 100:.1f}%, n={bound.n}, "
                 f"{bound.losses} lost / {bound.wins} won); outputs differ on {differ}/{len(keys)}")
    return lines
