"""What an endpoint comparison's figures can and cannot say (``workers.endpoint_eval``'s runs, read only):

- :func:`knob_verdict`: did the server apply the candidate's settings? **applied**, **ignored**, or **cannot tell
  yet** (with the drafted tokens, and items, that would decide at the run's own rates). The evidence, pooled over
  every chunk of every concurrency level: the rule reports of spectune's endpoint; at T = 0 and one request in
  flight, the outputs (a lossy rule that accepts one token lossless would not has changed the output there: vLLM
  decodes one request the same every time, and is not batch-invariant at more); the acceptance read from ``/metrics`` (a
  two-proportion test for "moved", an equivalence bound for "the same within a point"); SGLang's gauge windows.
- :func:`speed_interval`: the candidate-over-reference tokens/s ratio's 95% interval from the paired chunks (each
  chunk ran on both sides, interleaved: the unit of the comparison), by the jackknife over chunks; fewer than
  :data:`MIN_CHUNKS` paired chunks form none, and the interval says so.
- :func:`truncation`: replies that stopped at the length limit, per side.

Knows records and chunk lines; sends nothing.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from workers.endpoint_eval import Comparison, Side, SideRun

MIN_CHUNKS = 5  # paired chunks a side needs for a ratio's interval
EFFECT = 0.01  # the smallest change of acceptance (a share of drafted tokens) the check calls an effect
Z = 3.0  # standard errors a difference must clear ("moved"), or its bound stay inside the effect ("the same")
GAUGE_EFFECT = 0.02  # SGLang's windows are noisier: two points
# at T = 0 with one request in flight, a rule that accepted an extra token (one lossless would not) at a rate of
# EFFECT per drafted token leaves every output unchanged over D drafted tokens with probability (1 - EFFECT)^D:
# below 5% from this many on
IDENTICAL_DRAFTS = math.ceil(math.log(0.05) / math.log(1 - EFFECT))
APPLIED, IGNORED, UNSURE = "applied", "ignored", "cannot tell yet"


@dataclass
class KnobVerdict:
    """The knob check's answer: ``verdict`` (applied / ignored / cannot tell yet), the evidence it rests on, and,
    for "cannot tell yet", what would decide."""

    verdict: str
    evidence: str
    needed: str = ""

    @property
    def applied(self) -> bool:
        return self.verdict == APPLIED

    def line(self) -> str:
        text = f"knob check: {self.verdict}: {self.evidence}"
        return text + (f"; {self.needed}" if self.needed else "")

    def refusal(self) -> str | None:
        """None where the settings were applied, else the one ``refused: ...`` line the commands end with."""
        return None if self.applied else f"refused: {self.line()}"

    def to_dict(self) -> dict[str, str]:
        return {"verdict": self.verdict, "evidence": self.evidence, "needed": self.needed}


def reported(record: Any) -> dict[str, Any] | None:
    """The rule report the server sent with a record's last reply (spectune's ``spec_decode``), or None."""
    return json.loads(record.params).get("reported")


def _same_server(reference: Side, candidate: Side) -> bool:
    a, b = reference.endpoint, candidate.endpoint
    return (a.base_url.rstrip("/"), a.model) == (b.base_url.rstrip("/"), b.model)


def _report_verdict(reference: Side, candidate: Side, ok: dict[str, list[Any]]) -> KnobVerdict:
    """spectune's endpoint: every candidate reply must report the rule, knobs and draft length asked for, and every
    reference reply speculation off where it asked for that."""
    asked = candidate.endpoint.extra_body["spec_decode"]
    want = {"policy": asked["policy"], "params": asked.get("params") or {}, "draft_len": asked.get("draft_len")}
    for r in ok["candidate"]:
        rep = reported(r)
        got = None if rep is None else {"policy": rep.get("policy"), "params": rep.get("params") or {},
                                         "draft_len": rep.get("draft_len")}
        if got != want:
            return KnobVerdict(IGNORED, f"the candidate asked for {json.dumps(want, sort_keys=True)} in spec_decode, "
                                        "but the server reported "
                                        f"{json.dumps(got, sort_keys=True) if got else 'no rule (no spec_decode report)'}"
                                        f" for item {r.item_id}: it ignores or changes the knobs")
    off = reference.endpoint.extra_body.get("spec_decode")
    if isinstance(off, dict) and off.get("policy") == "off":
        on = [r.item_id for r in ok["reference"] if (reported(r) or {}).get("enabled") is not False]
        if on:
            return KnobVerdict(IGNORED, f"the reference asked for speculation off, but the server's reply for item "
                                        f"{on[0]} did not report it off")
    return KnobVerdict(APPLIED, f"every one of the candidate's {len(ok['candidate'])} replies reported the rule asked "
                                "for")


def _smoothed(x: float, n: float) -> float:
    """A rate's variance term with one success and one failure added (never 0 at a rate of 0 or 1)."""
    p = (x + 1) / (n + 2)
    return p * (1 - p)


def _acceptance_test(cand: tuple[float, float], ref: tuple[float, float]) -> tuple[str | None, str, float]:
    """(APPLIED / IGNORED / None, the figures, drafted tokens a side that would decide at these rates)."""
    (a, d), (ra, rd) = cand, ref
    if rd <= 0:  # a reference that drafted nothing: it does not speculate
        if d > 0:
            return APPLIED, f"the candidate drafted {d:,.0f} tokens and the reference none (/metrics)", 0.0
        return None, "neither side drafted a token (/metrics)", math.inf
    if d <= 0:
        return APPLIED, f"the reference drafted {rd:,.0f} tokens and the candidate none (/metrics)", 0.0
    p, q = a / d, ra / rd
    var = _smoothed(a, d), _smoothed(ra, rd)
    se = math.sqrt(var[0] / d + var[1] / rd)
    diff = p - q
    text = (f"acceptance {p:.3f} on {d:,.0f} drafted tokens against the reference's {q:.3f} on {rd:,.0f} "
            f"(difference {diff:+.3f} ± {se:.3f}, pooled over every chunk and level, /metrics)")
    if abs(diff) >= EFFECT and abs(diff) > Z * se:
        return APPLIED, text, 0.0
    if abs(diff) + Z * se < EFFECT:
        return IGNORED, text + f": the same within {EFFECT:g}", 0.0
    gap = abs(diff) if abs(diff) >= EFFECT else EFFECT - abs(diff)
    need = Z**2 * (var[0] + var[1]) / max(gap, 1e-4) ** 2  # each side's drafted tokens for Z se to fit in the gap
    return None, text, need


def _gauge_verdict(cand: list[float], ref: list[float]) -> KnobVerdict:
    """SGLang's gauge (the acceptance of its last logged decode window): each side's distinct windows, compared by
    their means (Welch), 5 windows a side at least; a reference whose gauge stayed at 0 does not speculate."""
    if ref and max(ref) <= 0.0:
        ref = []
    if len(cand) < 5 or (ref and len(ref) < 5):
        return KnobVerdict(UNSURE, f"the server's acceptance gauge changed {len(cand)} / {len(ref)} times (candidate "
                                   "/ reference) during the run", "5 windows a side decide (more items, or the "
                                                                  "server's decode_log_interval lower)")
    mc = statistics.fmean(cand)
    if not ref:
        return KnobVerdict(APPLIED, f"the candidate's gauge averaged {mc:.4f} over {len(cand)} windows, the "
                                    "reference's stayed at 0") if mc >= GAUGE_EFFECT else \
            KnobVerdict(IGNORED, "the candidate's acceptance gauge stayed at 0")
    mr = statistics.fmean(ref)
    se = math.sqrt(statistics.variance(cand) / len(cand) + statistics.variance(ref) / len(ref))
    text = (f"acceptance {mc:.4f} over {len(cand)} gauge windows against {mr:.4f} over {len(ref)} (/metrics)")
    diff = abs(mc - mr)
    if diff >= GAUGE_EFFECT and diff > Z * max(se, 1e-12):
        return KnobVerdict(APPLIED, text)
    if diff + Z * se < GAUGE_EFFECT:
        return KnobVerdict(IGNORED, text + f", the same within {GAUGE_EFFECT:g}: the server ignores the candidate's "
                                           "settings, or they do not change acceptance")
    return KnobVerdict(UNSURE, text, "more windows a side decide (more items)")


def knob_verdict(reference: Side, candidate: Side, comparisons: Sequence[Comparison],
                 temperature: float | None = None) -> KnobVerdict:
    """Whether the server(s) applied the candidate's settings, from every level's comparison (see the module).
    ``temperature``: the run's (outputs are evidence only at 0)."""
    records = {label: [r for c in comparisons for r in c.sides[label].records.values()]
               for label in ("reference", "candidate")}
    ok = {label: [r for r in recs if not r.failed] for label, recs in records.items()}
    if not ok["candidate"]:
        return KnobVerdict(UNSURE, "no candidate request succeeded, so nothing shows what the server did with its "
                                   "settings")
    asked = candidate.endpoint.extra_body.get("spec_decode")
    if isinstance(asked, dict) and asked.get("policy") not in (None, "off"):
        return _report_verdict(reference, candidate, ok)

    # at T = 0 and one request in flight, one server: the candidate's outputs against the reference's
    ones = [c for c in comparisons if c.concurrency == 1]
    outputs = ""
    identical_drafts = 0.0
    n_identical = 0
    if temperature == 0 and ones:
        pairs = [(c.reference.records[k], c.candidate.records[k]) for c in ones for k in c.reference.records
                 if k in c.candidate.records]
        pairs = [(r, c) for r, c in pairs if not r.failed and not c.failed]
        differ = [c.item_id for r, c in pairs if r.outputs != c.outputs]
        if differ and _same_server(reference, candidate):
            return KnobVerdict(APPLIED, f"the candidate's outputs differ from the reference's on {len(differ)} of "
                                        f"{len(pairs)} items at T = 0 with one request in flight (one server: the "
                                        "same request decodes the same there)")
        if pairs and not differ:
            n_identical = len(pairs)
            counts = [c.candidate.acceptance() for c in ones]
            identical_drafts = sum(x[1] for x in counts if x is not None) if any(counts) else math.nan
            outputs = (f"outputs identical to the reference's on all {len(pairs)} items at T = 0 with one request in "
                       "flight" + (f", over {identical_drafts:,.0f} drafted tokens" if identical_drafts >= 0 else ""))

    counts = [(c.candidate.acceptance(), c.reference.acceptance()) for c in comparisons]
    cand = [x for x, _ in counts if x is not None]
    ref = [y for _, y in counts if y is not None]
    pooled_c = (sum(a for a, _ in cand), sum(d for _, d in cand)) if cand else None
    pooled_r = (sum(a for a, _ in ref), sum(d for _, d in ref)) if ref else (0.0, 0.0)
    test: tuple[str | None, str, float] | None = None
    if pooled_c is not None and (pooled_c[1] > 0 or pooled_r[1] > 0):
        test = _acceptance_test(pooled_c, pooled_r)
        if test[0] == APPLIED:
            return KnobVerdict(APPLIED, test[1])
    if outputs and identical_drafts >= IDENTICAL_DRAFTS:
        return KnobVerdict(IGNORED, f"{outputs}: an extra acceptance at a rate of {EFFECT:g} per drafted token would "
                                    "have changed one with 95% probability; the server ignores the candidate's "
                                    "settings, or they change nothing here")
    if test is not None and test[0] == IGNORED:
        return KnobVerdict(IGNORED, f"{test[1]}: the server ignores the candidate's settings, or they do not change "
                                    "acceptance")
    if pooled_c is None and not (outputs and identical_drafts >= 0):
        gauges = {label: [v for c in comparisons for v in c.sides[label].gauge()] for label in ("reference",
                                                                                                  "candidate")}
        if gauges["candidate"]:
            return _gauge_verdict(gauges["candidate"], gauges["reference"])
        return KnobVerdict(UNSURE, "the replies carry no rule report and the server's /metrics has no "
                                   "speculative-decoding counts spectune reads (vLLM's counters, TensorRT-LLM's "
                                   "iteration stats with enable_iter_perf_stats, SGLang's spec_accept_rate gauge)"
                           + (f"; {outputs}" if outputs else ""))
    # cannot tell yet: what would decide, at this run's rates
    ways = []
    evidence = test[1] if test is not None else "neither side drafted a token (/metrics)"
    drafted_per_item = pooled_c[1] / max(1, len(ok["candidate"])) if pooled_c else 0.0
    if test is not None and math.isfinite(test[2]) and test[2] > 0:
        items = f" (~{math.ceil(test[2] / drafted_per_item):,} items at this run's {drafted_per_item:,.0f} an item)" \
            if drafted_per_item > 0 else ""
        ways.append(f"about {math.ceil(test[2]):,} drafted tokens a side would decide at these rates{items}")
    if temperature == 0 and n_identical and identical_drafts >= 0:
        per = identical_drafts / n_identical
        more = f" (~{math.ceil(IDENTICAL_DRAFTS / per):,} items)" if per > 0 else ""
        ways.append(f"or {IDENTICAL_DRAFTS} drafted tokens at one request in flight with no output differing{more}")
        evidence = f"{outputs}; {evidence}"
    elif temperature == 0 and not ones:
        ways.append(f"or, at concurrency 1, {IDENTICAL_DRAFTS} drafted tokens with no output differing (T = 0 outputs "
                    "are compared at one request in flight only)")
    return KnobVerdict(UNSURE, evidence, "; ".join(ways) or "more items decide")


def knob_check(reference: Side, candidate: Side, comparisons: Sequence[Comparison],
               temperature: float | None = None) -> str | None:
    """:func:`knob_verdict` as the one ``refused: ...`` line, or None where the settings were applied."""
    return knob_verdict(reference, candidate, comparisons, temperature).refusal()


# -- speed ------------------------------------------------------------------------------------------------------

def chunk_size(n_items: int, concurrency: int) -> int:
    """Items a chunk: 8 x the concurrency (at least 16), fewer where that would leave fewer than MIN_CHUNKS chunks,
    never fewer than the concurrency (so that it can be held)."""
    base = max(8 * concurrency, 16)
    return base if n_items >= MIN_CHUNKS * base else max(concurrency, n_items // MIN_CHUNKS, 1)


def _chunk_figures(run: SideRun) -> dict[frozenset[str], tuple[float, float]]:
    """A side's timed chunks by their items: (output tokens of its successful requests, wall seconds)."""
    out = {}
    for chunk in run.chunks:
        ids = chunk["items"]
        if chunk.get("wall_s", 0) > 0 and all(i in run.records for i in ids):
            out[frozenset(ids)] = (sum(run.records[i].tokens for i in ids if not run.records[i].failed),
                                   float(chunk["wall_s"]))
    return out


@dataclass
class SpeedInterval:
    """The candidate-over-reference tokens/s ratio with its 95% interval (None: too few paired chunks)."""

    ratio: float
    low: float | None
    high: float | None
    chunks: int  # paired chunks
    load: tuple[float, float] | None  # this machine's 1-minute load average, lowest and highest at chunk ends
    cpus: int

    @property
    def holds_one(self) -> bool:
        return self.low is not None and self.high is not None and self.low <= 1.0 <= self.high

    def text(self) -> str:
        if not math.isfinite(self.ratio):
            head = "n/a"
        elif self.low is None:
            head = (f"{self.ratio:.3f}x (no interval: {self.chunks} paired chunk{'s' if self.chunks != 1 else ''}, "
                    f"{MIN_CHUNKS} are needed)")
        else:
            head = (f"{self.ratio:.3f}x (95% interval {self.low:.3f}-{self.high:.3f} over {self.chunks} paired chunks"
                    + (": it holds 1.0, no speed difference is shown)" if self.holds_one else ")"))
        if self.load is not None:
            lo, hi = self.load
            head += f"; this machine's load {lo:.1f}" + (f"-{hi:.1f}" if hi - lo >= 0.05 else "") + \
                f" on {self.cpus} CPUs"
        return head

    def to_dict(self) -> dict[str, Any]:
        return {"ratio": self.ratio, "low": self.low, "high": self.high, "paired_chunks": self.chunks,
                "holds_one": self.holds_one, "load_1min": list(self.load) if self.load else None, "cpus": self.cpus}


def speed_interval(cmp: Comparison, level: float = 0.95) -> SpeedInterval:
    """The ratio of the sides' tokens/s and its interval: the jackknife over paired chunks (a chunk left out of both
    sides at a time) on the log of the ratio, with Student's t at n - 1 degrees of freedom; it is centred on the
    ratio printed. Chunks pair by their items (a resumed run's partial chunks pair with nothing)."""
    import os

    from scipy.stats import t as student

    ref, cand = _chunk_figures(cmp.reference), _chunk_figures(cmp.candidate)
    keys = [k for k in cand if k in ref and ref[k][0] > 0 and cand[k][0] > 0]
    rtps, ctps = cmp.reference.tokens_per_s, cmp.candidate.tokens_per_s
    ratio = ctps / rtps if rtps > 0 else math.nan
    loads = [float(c["load"]) for run in (cmp.reference, cmp.candidate) for c in run.chunks if c.get("load") is not None]
    load = (min(loads), max(loads)) if loads else None
    cpus = os.cpu_count() or 1
    n = len(keys)
    if n < MIN_CHUNKS:
        return SpeedInterval(ratio, None, None, n, load, cpus)

    def log_ratio(use: list[frozenset[str]]) -> float:
        tc, wc = sum(cand[k][0] for k in use), sum(cand[k][1] for k in use)
        tr, wr = sum(ref[k][0] for k in use), sum(ref[k][1] for k in use)
        return math.log(tc / wc) - math.log(tr / wr)

    full = log_ratio(keys)
    leave = [log_ratio(keys[:i] + keys[i + 1:]) for i in range(n)]
    mean = statistics.fmean(leave)
    se = math.sqrt((n - 1) / n * sum((v - mean) ** 2 for v in leave))
    half = float(student.ppf(0.5 + level / 2, n - 1)) * se
    return SpeedInterval(ratio, math.exp(full - half), math.exp(full + half), n, load, cpus)


# -- truncation -----------------------------------------------------------------------------------------------

TRUNCATION_WARN = 0.05  # a side with more of its replies stopped at the length limit is warned of


def truncation(run: SideRun) -> tuple[int, int]:
    """(replies that stopped at the length limit, replies) over a side's successful records."""
    finishes = [f for r in run.records.values() if not r.failed for f in r.finish_reasons]
    return sum(f == "length" for f in finishes), len(finishes)


def truncation_warning(cmp: Comparison, max_new_tokens: int | None, shots: int | None) -> str | None:
    """A warning line where a side's replies stopped at the length limit more often than TRUNCATION_WARN."""
    parts = []
    for label, run in cmp.sides.items():
        cut, n = truncation(run)
        if n and cut / n > TRUNCATION_WARN:
            parts.append(f"{cut} of {n} {label} replies ({100 * cut / n:.0f}%)")
    if not parts:
        return None
    limit = f" ({max_new_tokens} new tokens)" if max_new_tokens else ""
    shot = " or give the model exemplars to answer like (--shots, e.g. 8 on gsm8k)" if not shots else ""
    return (f"  warning: {' and '.join(parts)} stopped at the length limit{limit}: their answers are cut off and "
            f"scored as such; raise --max-new-tokens{shot}")
