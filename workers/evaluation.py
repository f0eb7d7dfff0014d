"""One benchmark item through one decoding configuration -> one ``Record``.

Knows the engine, the benchmark contract and the rule registry; knows nothing about where
records are stored, Ray, Optuna or MLflow. The evaluate job and the sweep's pair actors both call
``evaluate_item``; everything they aggregate comes from ``Record`` fields.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import traceback
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from policies import make_policy
from policies.coupling import check_sampler, item_seed
from policies.truncation import check_truncation
from workers.benchmarks import Benchmark, Item
from workers.engine_registry import ItemEngine
from workers.prompts import encode_chat
from workers.stats import GenerationStats

if TYPE_CHECKING:  # the engine calls these functions (SpecDecoder.evaluate_items): no import back at run time
    from workers.cpu_engine import SpecDecoder

TARGET_ONLY = "target-only"
TRUNCATION_OFF: dict[str, Any] = {"top_k": 0, "top_p": 1.0}  # DecodeSpec's values that truncate nothing
SAMPLING_DEFAULTS: dict[str, Any] = {**TRUNCATION_OFF, "sampler": "standard"}  # left out of keys where they hold


@dataclass(frozen=True)
class DecodeSpec:
    """How to decode: the rule (``target-only`` for the reference) and the decoding settings."""

    policy: str = TARGET_ONLY
    params: tuple[tuple[str, Any], ...] = ()  # sorted (name, value) pairs, hashable
    draft_len: int = 0
    temperature: float = 0.0
    seed: int = 0
    max_new_tokens: int = 256
    shots: int = 0
    top_k: int = 0  # sampling truncation at T > 0 (policies.truncation): 0 / 1.0 are off, and a spec that leaves
    top_p: float = 1.0  # them off has the key and settings it had before they existed
    sampler: str = "standard"  # "coupled": Gumbel-max noise keyed by seed and position (policies.coupling), T > 0

    def __post_init__(self) -> None:
        check_truncation(self.top_k, self.top_p)
        check_sampler(self.sampler)

    @staticmethod
    def make(policy: str, params: dict | None = None, draft_len: int = 5, **settings: Any) -> DecodeSpec:
        params = dict(params or {})
        if policy == TARGET_ONLY:
            if params:
                raise ValueError(f"target-only decoding takes no parameters, got {sorted(params)}")
            draft_len = 0
        else:
            make_policy(policy, **params)  # validate now: unknown names / params / ranges fail early
            if not isinstance(draft_len, int) or draft_len < 1:
                raise ValueError(f"draft_len must be an integer >= 1, got {draft_len!r}")
        return DecodeSpec(policy, tuple(sorted(params.items())), draft_len, **settings)

    @property
    def params_dict(self) -> dict[str, Any]:
        return dict(self.params)

    def truncation(self) -> dict[str, Any]:
        """``top_k`` / ``top_p`` where set (an engine's keyword arguments), else nothing."""
        return {k: v for k, v in (("top_k", self.top_k), ("top_p", self.top_p)) if v != TRUNCATION_OFF[k]}

    def sampling(self) -> dict[str, Any]:
        """How tokens are drawn beyond the temperature, where it is not the default: the truncation and the
        coupled sampler (the CPU engine's keyword arguments)."""
        return {**self.truncation(), **({"sampler": self.sampler} if self.sampler != "standard" else {})}

    def standard(self) -> DecodeSpec:
        """This spec under the standard sampler: how a deployment draws, so how a speed is timed (the coupled
        sampler accepts less than standard speculative sampling, :mod:`policies.coupling`)."""
        return replace(self, sampler="standard")

    def settings_key(self) -> dict[str, Any]:
        """What makes two runs comparable item by item (everything but the rule)."""
        return {"temperature": self.temperature, "seed": self.seed, "max_new_tokens": self.max_new_tokens,
                "shots": self.shots, **self.sampling()}

    def key(self) -> str:
        """A short stable id of the whole spec (file names, caches)."""
        whole = {k: v for k, v in asdict(self).items() if k not in SAMPLING_DEFAULTS}
        blob = json.dumps({**whole, **self.sampling(), "params": self.params_dict}, sort_keys=True, default=str)
        return hashlib.sha1(blob.encode()).hexdigest()[:12]

    def label(self) -> str:
        if self.policy == TARGET_ONLY:
            return TARGET_ONLY
        params = ",".join(f"{k}={v}" for k, v in self.params)
        return f"{self.policy}({params}) L={self.draft_len}"


@dataclass
class Record:
    """One item under one spec: outputs, score and the engine's counts and times (summed over turns)."""

    item_id: str
    index: int
    benchmark: str
    spec_key: str
    policy: str
    params: str  # JSON
    draft_len: int
    outputs: list[str]
    score: float  # NaN when the item failed
    extracted: str | None
    reason: str
    tokens: int
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_position: list[int]
    target_forwards: int
    draft_forwards: int
    prefill_time_s: float
    draft_time_s: float
    verify_time_s: float
    policy_time_s: float
    wall_time_s: float
    finish_reasons: list[str]
    output_token_ids: list[list[int]] = field(default_factory=list)
    error: str | None = None
    lossless_fallback_steps: int = 0  # verify rounds decided by the lossless rule instead (vLLM engine)
    # "" when decoded in full; else how replay (workers.replay) made it, per turn: "exact" (the target-only
    # output, nothing decoded), "diverged@t" / "past-the-pass@g" / "near-tie@g" / "look-ahead@g" (decoded live from generated index g)
    replay: str = ""
    retries: int = 0  # requests sent again (the endpoint engine: 5xx, timeouts, broken streams, 429s waited out)
    # how it was made, for whoever audits the evidence: the torch threads of the process that decoded it (replay is
    # exact only at some, ``workers.replay.exact_for``; 0: unknown, an older record, or a server's) and spectune's
    # code version (:func:`code_version`; "": an older record)
    threads: int = 0
    code: str = ""
    # the replay semantics a replayed record was made under (``workers.replay.REPLAY_VERSION``; 0: decoded in full, or
    # an older record): what a certificate is decided on keeps a replayed record only at the current version
    replay_version: int = 0
    # why the rules' fused statistics kernels (policies.fused) were switched off in the process that made it, by the
    # record's end ("" where they never failed): its decisions were then the eager kernels', which round otherwise
    fused_off: str = ""
    # the rows the batched CPU engine decoded at once while it ran (workers.cpu_batch; 1: alone, as every engine
    # before it): a batched record's seconds overlap its neighbours', so they are not its own decode's time
    batch: int = 1

    @property
    def solo(self) -> bool:
        """Whether the seconds are this record's own decode: decoded in full (:attr:`timed`) and alone (batch 1)."""
        return self.timed and self.batch == 1

    @property
    def timed(self) -> bool:
        """Whether the times are the rule's own decode (not a replay's pass and partial decode)."""
        return all(part.startswith("full") for part in self.replay.split(";")) if self.replay else True

    @property
    def decode_time_s(self) -> float:
        return self.wall_time_s - self.prefill_time_s

    @property
    def tokens_per_s(self) -> float:
        """Decode throughput; 0 for a replayed or batched record (its seconds are not the rule's decode alone)."""
        return self.tokens / self.decode_time_s if self.decode_time_s > 0 and self.solo else 0.0

    @property
    def failed(self) -> bool:
        return self.error is not None or math.isnan(self.score)

    def to_row(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_row(row: dict[str, Any]) -> Record:
        return Record(**{k: row[k] for k in Record.__dataclass_fields__ if k in row})


@functools.cache
def code_version() -> str:
    """spectune's code as a record names it: the checkout's git commit (``+dirty`` with uncommitted changes to
    tracked files), else the installed package's version (a Ray job's working_dir copy has no ``.git``)."""
    import importlib.metadata
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        if head.returncode == 0 and head.stdout.strip():
            dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            return f"git:{head.stdout.strip()}{'+dirty' if dirty else ''}"
    except (OSError, subprocess.TimeoutExpired):
        pass
    try:
        return f"spectune {importlib.metadata.version('spectune')}"
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _threads() -> int:
    import torch

    return int(torch.get_num_threads())


def _replayable(engine: Any, spec: DecodeSpec, reference: dict[str, Any] | None) -> bool:
    return (reference is not None and spec.policy != TARGET_ONLY and (spec.temperature == 0.0 or spec.sampler == "coupled")
            and hasattr(engine, "target") and hasattr(engine, "draft") and bool(reference.get("tokens")))


def reference_payload(record: Record) -> dict[str, Any]:
    """What an engine needs of a target-only record to replay a rule from it (and to score against it)."""
    return {"outputs": list(record.outputs), "tokens": [list(t) for t in record.output_token_ids],
            "finish": list(record.finish_reasons)}


def prompt_lengths(tokenizer: Any, bench: Benchmark, items: list[Item], spec: DecodeSpec) -> list[int]:
    """Each item's first-turn prompt length in tokens, encoded as :func:`evaluate_item` encodes it (``spec.shots``
    examples, the benchmark's chat setting): the KV length a workload's decoding starts from."""
    return [len(encode_chat(tokenizer, bench.messages(item, shots=spec.shots), getattr(bench, "chat", None)))
            for item in items]


PROFILE_ITEMS = 32  # items whose prompt lengths size a workload's calibration context


def workload_profile(pair: Any, bench: Benchmark, items: list[Item], spec: DecodeSpec) -> Any:
    """The pair's cost profile (``workers.models.calibrate.get_profile``) timed at the KV length ``items`` decode at
    under ``spec``: the median of the first ``PROFILE_ITEMS`` prompts plus half the new tokens
    (:func:`workers.models.calibrate.workload_context`); a profile at a fixed short context under-prices
    attention for long (few-shot) prompts."""
    from workers.models.calibrate import get_profile

    return get_profile(pair, context=items_context(pair, bench, items, spec))


def items_context(pair: Any, bench: Benchmark, items: list[Item], spec: DecodeSpec) -> int:
    """The KV length ``items`` decode at under ``spec``: the median of the first ``PROFILE_ITEMS`` prompts plus half
    the new tokens, bucketed (:func:`workers.models.calibrate.workload_context`)."""
    from workers.models.calibrate import workload_context

    lengths = prompt_lengths(pair.tokenizer, bench, list(items)[:PROFILE_ITEMS], spec)
    return workload_context(lengths, spec.max_new_tokens)


def evaluate_bundle(engine: SpecDecoder, bench: Benchmark, item: Item, specs: list[DecodeSpec],
                    reference_outputs: list[str] | dict[str, Any] | None = None) -> list[Record]:
    """``item`` under each of ``specs`` (one record each, as :func:`evaluate_item` makes it), sharing one
    teacher-forced pass where they replay (continued past the end for the largest L) and one rule decision per
    distinct rule: lossless at every L of a range costs one pass per item, not one per L."""
    passes: dict[Any, Any] = {}
    extend = max(s.draft_len for s in specs)
    return [evaluate_item(engine, bench, item, s, reference_outputs, passes=passes, extend=extend) for s in specs]


def evaluate_item(engine: SpecDecoder, bench: Benchmark, item: Item, spec: DecodeSpec,
                  reference_outputs: list[str] | dict[str, Any] | None = None, *,
                  passes: dict[Any, Any] | None = None, extend: int | None = None) -> Record:
    """Generate every turn of ``item`` under ``spec`` and score it. Never raises for a failing
    item: the error is recorded (score NaN) so a sweep loses one item, not a trial.

    ``reference_outputs``: the target-only outputs of the item (MT-bench scores against them), or
    :func:`reference_payload` of its target-only record: then, at T = 0 on the CPU engine, each turn is
    *replayed* from it (``workers.replay``: exact; decoded live only from the round that leaves the
    target-only output), while the turns before it kept the reference's output; ``Record.replay`` says how."""
    if isinstance(engine, ItemEngine):  # a server as the engine (workers.endpoint_engine): requests, not decoding
        return engine.evaluate_item(bench, item, spec, reference_outputs)
    reference = reference_outputs if isinstance(reference_outputs, dict) else None
    if reference is not None:
        reference_outputs = reference.get("outputs")
    total = GenerationStats(draft_len=spec.draft_len)
    outputs: list[str] = []
    finishes: list[str] = []
    token_ids: list[list[int]] = []
    how: list[str] = []
    policy = None if spec.policy == TARGET_ONLY else make_policy(spec.policy, **spec.params_dict)
    try:
        previous: list[tuple[str, str]] = []
        for turn in range(len(item.turns)):
            ids = encode_chat(engine.pair.tokenizer, bench.messages(item, shots=spec.shots, turn=turn, previous=previous),
                              getattr(bench, "chat", None))
            # the coupled sampler keys its noise by item too: items never share noise at a position
            seed = spec.seed + turn if spec.sampler == "standard" else item_seed(spec.seed, item.id, turn)
            common = dict(max_new_tokens=spec.max_new_tokens, temperature=spec.temperature,
                          seed=seed, stop=list(bench.stop) or None)
            sampled = {**common, **spec.sampling()}  # what decoding takes (and replay, at T = 0 or coupled)
            on_prefix = all(h == "exact" for h in how)  # every turn before kept the reference's output
            if policy is None:
                gen = engine.autoregressive(ids, **sampled)
            elif _replayable(engine, spec, reference) and on_prefix and turn < len(reference["tokens"]):
                from workers.replay import decisions, draw_for, forced_pass, replay
                from workers.stats import Generation

                try:
                    ref = Generation(reference["tokens"][turn], reference["outputs"][turn], reference["finish"][turn],
                                     GenerationStats())
                    forced = acc = None
                    if passes is not None:  # shared with the bundle's other specs (evaluate_bundle)
                        draw = draw_for(spec.temperature, spec.top_k, spec.top_p, spec.sampler, common["seed"])
                        key = (tuple(ids), tuple(ref.token_ids), ref.finish_reason, draw)
                        if key not in passes:
                            passes[key] = forced_pass(engine, ids, ref.token_ids, ref.finish_reason,
                                                      extend=max(extend or 0, spec.draft_len), draw=draw)
                        forced = passes[key]
                        rule = (key, spec.policy, json.dumps(spec.params_dict, sort_keys=True), common["seed"])
                        if rule not in passes:
                            passes[rule] = decisions(engine, forced, policy, common["seed"])
                        acc = passes[rule]
                    done = replay(engine, ids, ref, policy, spec.draft_len, **sampled, forced=forced, accepted=acc)
                except Exception as err:  # noqa: BLE001 - a replay that cannot run decodes in full, said so
                    gen = engine.generate(ids, policy, draft_len=spec.draft_len, **sampled)
                    how.append(f"full (replay failed: {type(err).__name__})")
                else:
                    gen = done.generation
                    how.append("exact" if done.decoded_from is None else
                               f"{'diverged' if done.reason == 'diverged' else done.reason.replace(' ', '-')}@"
                               f"{done.diverged_at if done.diverged_at is not None else done.decoded_from}")
            else:
                gen = engine.generate(ids, policy, draft_len=spec.draft_len, **sampled)
                if how:
                    how.append("full")
            total = total.plus(gen.stats)
            outputs.append(gen.text or "")
            finishes.append(gen.finish_reason)
            token_ids.append(gen.token_ids)
            previous.append((item.turns[turn], gen.text or ""))
        refs = outputs if (reference_outputs is None and spec.policy == TARGET_ONLY) else reference_outputs
        scored = bench.score(item, outputs, reference_outputs=refs)
        score, extracted, reason, error = float(scored.score), scored.extracted, scored.reason, None
    except Exception as err:  # recorded, not raised: see docstring
        score, extracted, reason = math.nan, None, f"failed: {type(err).__name__}: {err}"
        error = "".join(traceback.format_exception_only(type(err), err)).strip()
    return Record(
        item_id=item.id, index=item.index, benchmark=bench.name, spec_key=spec.key(), policy=spec.policy,
        params=json.dumps(spec.params_dict, sort_keys=True), draft_len=spec.draft_len, outputs=outputs,
        score=score, extracted=extracted, reason=reason, tokens=total.num_generated, num_drafts=total.num_drafts,
        num_draft_tokens=total.num_draft_tokens, num_accepted_tokens=total.num_accepted_tokens,
        accepted_per_position=list(total.accepted_per_position) or [0] * spec.draft_len,
        target_forwards=total.target_forwards, draft_forwards=total.draft_forwards,
        prefill_time_s=total.prefill_time_s, draft_time_s=total.draft_time_s, verify_time_s=total.verify_time_s,
        policy_time_s=total.policy_time_s, wall_time_s=total.wall_time_s, finish_reasons=finishes,
        output_token_ids=token_ids, error=error, lossless_fallback_steps=total.lossless_fallback_steps,
        replay=";".join(how), threads=_threads(), code=code_version(),
        replay_version=_replay_version(how), fused_off=_fused_off(),
    )


def _fused_off() -> str:
    """:func:`policies.fused.failure` (why the fused kernels went off in this process), or ""."""
    from policies import fused

    return fused.failure() or ""


def _replay_version(how: list[str]) -> int:
    """``workers.replay.REPLAY_VERSION`` where some turn was replayed, else 0."""
    if not how or all(part.startswith("full") for part in how):
        return 0
    from workers.replay import REPLAY_VERSION

    return REPLAY_VERSION
