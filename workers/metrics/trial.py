"""From per-item ``Record``s to a trial's metrics, paired with the references on the same items.

Pure Python over records: no models, no storage, no Ray/MLflow. Conventions (docs/design.md):

- accuracy: the benchmark's own score, mean over attempted items, a failed item counting as 0 in
  the arm that failed (a rule that crashes items must not look better for it), with a bootstrap
  95% interval (a description of the search items; certificates come from ``workers.certify.decide``);
- accuracy_drop = reference accuracy - accuracy, paired on items both runs attempted, with a
  bootstrap interval of the paired differences (positive = worse than target-only);
- measured speedup: per-item tokens/s ratio, then the mean (Spec-Bench's convention);
- modelled speedup: tokens per modelled cost (``workers.metrics.cost``); vs lossless: the ratio of the
  two runs' tokens per cost.
- noise floor: how often (and by how much in accuracy) the lossless rule's output differs from
  target-only output on the same items; budgets tighter than it cannot be told from zero.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from workers.evaluation import Record
from workers.metrics.cost import VerifyFactor, tokens_per_cost, unit_verify


def bootstrap_ci(values: Sequence[float], resamples: int = 2000, seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean; (nan, nan) for no data."""
    vals = [v for v in values if not math.isnan(v)]
    if not vals:
        return (math.nan, math.nan)
    if len(vals) == 1:
        return (vals[0], vals[0])
    rng = random.Random(seed)
    n = len(vals)
    means = sorted(sum(rng.choices(vals, k=n)) / n for _ in range(resamples))
    lo = means[int((1 - level) / 2 * resamples)]
    hi = means[min(resamples - 1, int((1 + level) / 2 * resamples))]
    return (lo, hi)


@dataclass
class TrialMetrics:
    items: int
    failures: int
    accuracy: float
    accuracy_ci: tuple[float, float]
    reference_accuracy: float
    accuracy_drop: float
    accuracy_drop_ci: tuple[float, float]
    mean_acceptance_length: float
    draft_acceptance_rate: float
    acceptance_per_position: list[float]  # fraction of rounds accepting position i
    tokens_per_s: float
    speedup_vs_ar_measured: float
    speedup_vs_ar_modelled: float
    speedup_vs_lossless_measured: float = math.nan
    speedup_vs_lossless_modelled: float = math.nan
    output_divergence_vs_ar: float = math.nan  # fraction of items whose output differs from target-only
    cost_ratio: float = math.nan
    cost_ratio_in_situ: float = math.nan  # c seen in this run: draft s/forward ÷ target-only s/forward
    speedup_vs_ar_modelled_in_situ: float = math.nan  # the modelled speedup with that c
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    def flat(self) -> dict[str, float]:
        """Scalar metrics for loggers (intervals split into _lo/_hi)."""
        out: dict[str, float] = {}
        for k, v in asdict(self).items():
            if isinstance(v, (tuple, list)) and k.endswith("_ci"):
                out[f"{k}_lo"], out[f"{k}_hi"] = float(v[0]), float(v[1])
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                out[k] = float(v)
        return out


def in_situ_cost_ratio(records: Sequence[Record], target_only: Sequence[Record]) -> float:
    """c as this run saw it: mean draft-forward time over mean target-only step time, on the same
    items and machine state. The calibrated c (short context, idle machine) can differ a lot
    from this under long few-shot prompts or several actors per node; both are reported so the
    modelled speedup can be checked against the conditions it claims to describe."""
    records = [r for r in records if r.solo]  # a replayed or batched record's seconds are not its rule's alone
    target_only = [r for r in target_only if r.solo]
    drafts = sum(r.draft_forwards for r in records)
    steps = sum(r.target_forwards for r in target_only)
    step_s = sum(r.verify_time_s for r in target_only) / steps if steps else 0.0
    if not drafts or step_s <= 0:
        return math.nan
    return sum(r.draft_time_s for r in records) / drafts / step_s


def score_of(r: Record | None) -> float:
    """A record's score with a failed (or missing) item counted as wrong (0) in its arm."""
    return 0.0 if r is None or r.failed else float(r.score)


def _by_item(records: Sequence[Record]) -> dict[str, Record]:
    return {r.item_id: r for r in records if not r.failed}


def _paired_speed(records: dict[str, Record], base: dict[str, Record]) -> float:
    ratios = [records[k].tokens_per_s / base[k].tokens_per_s for k in records
              if k in base and base[k].tokens_per_s > 0 and records[k].tokens_per_s > 0]
    return statistics.mean(ratios) if ratios else math.nan


def aggregate(records: Sequence[Record], target_only: Sequence[Record], lossless: Sequence[Record] | None = None,
              cost_ratio: float = 0.4, verify_factor: VerifyFactor = unit_verify) -> TrialMetrics:
    ok, ref = _by_item(records), _by_item(target_only)
    paired = [k for k in ok if k in ref]
    attempted = {r.item_id: r for r in records}
    ref_all = {r.item_id: r for r in target_only}
    scores = [score_of(r) for r in attempted.values()]
    both = [k for k in attempted if k in ref_all]
    diffs = [score_of(ref_all[k]) - score_of(attempted[k]) for k in both]
    drafts = sum(r.num_drafts for r in ok.values())
    draft_tokens = sum(r.num_draft_tokens for r in ok.values())
    tokens = sum(r.tokens for r in ok.values())
    timed = [r for r in ok.values() if r.solo]  # replayed (batched) records carry no decode time of their own
    decode = sum(r.decode_time_s for r in timed)
    width = max((len(r.accepted_per_position) for r in ok.values()), default=0)
    per_pos = [sum(r.accepted_per_position[i] for r in ok.values() if i < len(r.accepted_per_position)) / drafts
               if drafts else 0.0 for i in range(width)]
    paired_records = [ok[k] for k in paired]
    paired_refs = [ref[k] for k in paired]
    spd_model = (tokens_per_cost(paired_records, cost_ratio, verify_factor) /
                 tokens_per_cost(paired_refs, cost_ratio, verify_factor)) if paired else math.nan
    metrics = TrialMetrics(
        items=len(records), failures=len(records) - len(ok),
        accuracy=statistics.mean(scores) if scores else math.nan, accuracy_ci=bootstrap_ci(scores),
        reference_accuracy=statistics.mean(score_of(ref_all[k]) for k in both) if both else math.nan,
        accuracy_drop=statistics.mean(diffs) if diffs else math.nan, accuracy_drop_ci=bootstrap_ci(diffs),
        mean_acceptance_length=tokens / drafts if drafts else math.nan,
        draft_acceptance_rate=sum(r.num_accepted_tokens for r in ok.values()) / draft_tokens if draft_tokens else math.nan,
        acceptance_per_position=per_pos,
        tokens_per_s=sum(r.tokens for r in timed) / decode if decode > 0 else math.nan,
        speedup_vs_ar_measured=_paired_speed(ok, ref), speedup_vs_ar_modelled=spd_model,
        output_divergence_vs_ar=(sum(ok[k].output_token_ids != ref[k].output_token_ids for k in paired) / len(paired)
                                 if paired else math.nan),
        cost_ratio=cost_ratio,
    )
    c_here = in_situ_cost_ratio(paired_records, paired_refs)
    if not math.isnan(c_here):
        metrics.cost_ratio_in_situ = c_here
        metrics.speedup_vs_ar_modelled_in_situ = (tokens_per_cost(paired_records, c_here, verify_factor)
                                                  / tokens_per_cost(paired_refs, c_here, verify_factor))
    if lossless:
        base = _by_item(lossless)
        both = [k for k in ok if k in base]
        if both:
            metrics.speedup_vs_lossless_measured = _paired_speed(ok, base)
            metrics.speedup_vs_lossless_modelled = (
                tokens_per_cost([ok[k] for k in both], cost_ratio, verify_factor)
                / tokens_per_cost([base[k] for k in both], cost_ratio, verify_factor))
    return metrics


@dataclass
class NoiseFloor:
    items: int
    divergence_rate: float  # lossless output != target-only output
    accuracy_diff: float  # target-only accuracy - lossless accuracy (paired)
    accuracy_diff_ci: tuple[float, float]


def noise_floor(lossless: Sequence[Record], target_only: Sequence[Record]) -> NoiseFloor:
    a, b = _by_item(lossless), _by_item(target_only)
    keys = [k for k in a if k in b]
    diffs = [b[k].score - a[k].score for k in keys]
    return NoiseFloor(
        items=len(keys),
        divergence_rate=sum(a[k].output_token_ids != b[k].output_token_ids for k in keys) / len(keys) if keys else math.nan,
        accuracy_diff=statistics.mean(diffs) if diffs else math.nan, accuracy_diff_ci=bootstrap_ci(diffs),
    )
