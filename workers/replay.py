"""Replay at T = 0 and under the coupled sampler: a rule's speculative run from one teacher-forced pass over the
target-only output.

At temperature 0 with greedy drafting, speculative decoding reproduces the target-only output y up to the
first verify round whose accepted run holds a draft token that differs from y there. Until then every
draft token is argmax q on the target-only prefix, every decision is a function of that position's target
and draft distributions (and, for DropMatch, of its hidden state and dropout masks keyed by the seed and
the absolute position: ``policies.randomness.PositionStreams``, which the CPU engine uses at T = 0 too), and
block boundaries and bonus tokens follow from L. So one forward of each model over prompt + y gives, for a
rule and its knobs, the decision at every position at once, and for every L the block-by-block acceptance,
the modelled cost and the first divergence, or none.

- :func:`forced_pass`: the teacher-forced statistics (target logits and hidden states, draft logits) at the
  T + 1 positions that predict y_1 .. y_T and the token after.
- :func:`decisions`: a rule's decision at every position (one ``decide`` over all of them; a look-ahead rule,
  FLy, its positions' own parts and where its block could still decide otherwise).
- :func:`simulate`: the rounds a live run at draft length L makes on the target-only prefix, until its first
  accepted mismatch, or until it needs a position past the pass (the final round of an item that ended on
  EOS or a stop string may draft beyond the end): there it says where to resume.
- :func:`replay`: the whole run, exact: the simulated rounds, then live decoding from the start of the round
  that diverged or left the pass (``SpecDecoder.generate(generated_prefix=...)``), or nothing more.

The contract is exactness: the replayed tokens, acceptance counts and modelled cost equal a full speculative
decode's (``tests/workers/test_replay.py``, every registered rule). What can break it is numerics: the pass
computes the same logits in other shapes than incremental decoding does; where the target's argmax of the pass
disagrees with y (a near-tie), the item is decoded in full and counted (``Replayed.reason``).

At T > 0 the standard sampler is not replayable (a sampled run leaves the target-only output at its first draw):
:func:`replay` refuses it, and the callers decode in full and say so. The coupled sampler is
(``policies.coupling``): every token is the Gumbel-max draw of its cut distribution with noise keyed by the seed and
the absolute position, so lossless draws target-only's tokens, and the argument above holds with "argmax" read as
"the draw with the position's noise" (``CoupledDraw``), for the target, the draft and every rule's decision.

Knows two models' engine (``workers.cpu_engine.SpecDecoder``) and ``policies``; nothing about benchmarks,
Ray or MLflow.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from policies import Policy, VerifyBatch, decide_local, lookahead, make_policy, traits
from policies.coupling import CoupledDraw
from policies.randomness import PositionStreams
from policies.registry import needs_draft_logits
from workers.resets import resets_on_error
from workers.stats import Generation, GenerationStats

# Bumped whenever what replay decides or counts changes (the rounds it simulates, where it resumes, what it hands a
# rule): a replayed record made under another version is made again before a certificate is decided on it
# (``sweep.references``), since ``Record.code`` moves with every commit and says nothing about replay itself.
REPLAY_VERSION = 1
NEAR_TIE = 1e-4  # a top-2 logit gap below this (relative to the top logit's scale) is a near-tie
# Pair dtypes whose rows do not depend on the rows computed beside them (workers.models.fast: int8 GEMMs and
# row-wise ops), so the teacher-forced pass holds the very numbers incremental decoding computes and a replayed
# record is the full decode's. In bf16/fp32 the pass's GEMMs take other shapes and other roundings: a replayed
# record there is an approximation (fine to steer a search, never what a certificate is decided on).
ROW_EXACT_DTYPES = frozenset({"int8", "int4+int8"})  # the 4-bit draft's GEMM too (fast.Q4Linear)


def exact_for(dtype: str, threads: int = 1) -> bool:
    """Whether replay on a pair of ``dtype`` (a tag or a torch dtype name) run at ``threads`` torch threads equals
    full decoding by construction: the fast path (int8, int4+int8) at one thread. At more threads some elementwise kernels (silu) split a
    multi-row tensor at other offsets than a one-row one, and a one-ulp difference can move a quantisation level
    and flip a near-tie or a lossy statistic near its threshold (a statistician's check, 2026-12-04)."""
    from workers.models.pair import dtype_tag

    try:
        return dtype_tag(dtype) in ROW_EXACT_DTYPES and int(threads) == 1
    except (ValueError, KeyError, TypeError):
        return False


def exact_rule(policy: Policy | str, params: dict[str, Any] | None = None) -> bool:
    """Whether a rule's own arithmetic keeps replay exact where the models do (:func:`exact_for`): its declared
    ``policies.registry.Traits.replays_exactly``, False for DropMatch's ``mode="exact"`` with dropout on, whose K
    full-vocabulary heads are one GEMM over every row of the block ([K x rows, d] x [d, V]), a live round's few
    rows or the pass's hundreds, and a float GEMM's row need not come out the same at another row count; for an
    ``any_of`` holding such a member. Candidate mode multiplies each position's heads by its own candidates apart
    (checked by the replay tests)."""
    rule = make_policy(policy, **(params or {})) if isinstance(policy, str) else policy
    return traits(rule).replays_exactly


class NotReplayable(ValueError):
    """A run replay cannot reproduce exactly (T > 0 under the standard sampler): decode it in full."""


def draw_for(temperature: float, top_k: int = 0, top_p: float = 1.0, sampler: str = "standard",
             seed: int = 0) -> CoupledDraw | None:
    """How a replayable run draws its tokens: None at T = 0 (greedy), the coupled sampler's settings at T > 0;
    ``NotReplayable`` for the standard sampler at T > 0 (a sampled run leaves the target-only output at its first
    draw)."""
    if temperature == 0.0:
        return None
    if sampler != "coupled":
        raise NotReplayable(f"replay at T = {temperature} needs the coupled sampler (got {sampler!r}): decode in full")
    return CoupledDraw(float(temperature), int(top_k), float(top_p), int(seed))


@dataclass
class Forced:
    """One item's teacher-forced statistics: row i predicts generated token i (row T: the token after y)."""

    prompt_len: int
    generated: list[int]  # y, the target-only output (EOS excluded)
    finish: str  # the target-only run's finish reason
    target_logits: Tensor  # [T + 1, V] float32
    target_hidden: Tensor  # [T + 1, d]
    draft_logits: Tensor  # [T + 1, V] float32
    draft_tokens: Tensor  # [T + 1] long: the draft's proposal at each row (greedy: its proposal vocabulary's argmax)
    agrees: int  # rows 0 .. agrees - 1: the pass's target draw is the prefix's token (near-ties can break it)
    near_ties: int  # rows whose target or draft top-2 scores lie within NEAR_TIE of each other
    seconds: float = 0.0
    after: list[int] = field(default_factory=list)  # the target's own tokens past y's end (``extend``)
    tail_ok: bool = True  # False: the reference ended on EOS but the pass's draw there is no EOS (a near-tie)
    target_tokens: Tensor | None = None  # [T + 1 + extension] long: the target's draw at each row (argmax at T = 0)
    draw: CoupledDraw | None = None  # the coupled sampler's settings at T > 0 (None: greedy)
    noise: Tensor | None = None  # [rows + 1, V] float32: the coupled sampler's noise at each row's position (and a
    # bonus slot's after the last row, never read: the shape a verify batch takes, so a rule's decision copies nothing)

    def __post_init__(self) -> None:
        if self.target_tokens is None:  # greedy: the target's token at a row is its argmax
            self.target_tokens = self.target_logits.argmax(dim=-1)

    @property
    def positions(self) -> int:
        return int(self.target_logits.shape[0])


def _near_ties(logits: Tensor) -> int:
    top = logits.topk(2, dim=-1).values
    scale = top[:, 0].abs().clamp_min(1.0)
    return int(((top[:, 0] - top[:, 1]) < NEAR_TIE * scale).sum())


@resets_on_error
@torch.inference_mode()
def forced_pass(engine: Any, prompt: list[int], generated: list[int], finish: str, extend: int = 0,
                draw: CoupledDraw | None = None) -> Forced:
    """One forward of each model over ``prompt + generated`` (the prompt's KV entries reused from the engine's
    prefix cache), keeping the T + 1 rows that score the generated tokens and the one after.

    ``extend``: where the reference ended on EOS or a stop string, continue the prefix past its end with the
    target's own tokens (EOS first, then whatever the target would say after it; ``extend`` of them, by
    incremental decoding, the draft's rows in one forward), so a round that accepts the end and drafts on is
    still on the prefix: lossless then replays without decoding at any L <= ``extend`` (a lossy rule that
    accepts a mismatch there resumes live, as anywhere).

    ``draw``: the coupled sampler at T > 0 (``policies.coupling``): every row's logits are cut as live decoding
    cuts them (top-k / top-p), and the target's and the draft's tokens at a row are their Gumbel-max draws with
    the noise of the row's absolute position, as a live run draws them; greedy (argmax) without it."""
    t0 = time.perf_counter()
    prompt = [int(t) for t in prompt]
    seq = prompt + [int(t) for t in generated]
    # every row's noise, the extension's too (rows T + 1 .. T + extend - 1), each position's built alone
    noise = None if draw is None else draw.noise(len(prompt), len(generated) + max(extend, 1) + 1,
                                                 engine.pair.vocab_size)
    rows = _forced_rows(engine, prompt, seq, draw, noise)
    target_tokens = _draws(rows["target"], draw, noise)
    after: list[int] = []
    if extend > 0 and finish != "length":
        after = [int(target_tokens[-1])]
        more: dict[str, list[Tensor]] = {"target": [], "hidden": []}
        for _ in range(extend - 1):  # rows T + 1 .. T + extend - 1, incremental like live decoding
            hidden = engine.target.forward(torch.tensor([[after[-1]]]))
            logits = _cut(engine.target.head(hidden)[0].float(), draw)
            more["target"].append(logits)
            more["hidden"].append(hidden[0])
            row = len(seq) - len(prompt) + len(after)
            after.append(int(_draws(logits, draw, None if noise is None else noise[row: row + 1])[-1]))
        if extend > 1:
            hidden = engine.draft.forward(torch.tensor([after[:-1]]))
            first = len(seq) - len(prompt) + 1
            draft, proposed, proposal_logits = _draft_rows(engine, hidden, draw,
                                                           None if noise is None else noise[first:])
            rows = {"target": torch.cat([rows["target"], *more["target"]]),
                    "hidden": torch.cat([rows["hidden"], *more["hidden"]]), "draft": torch.cat([rows["draft"], draft]),
                    "proposed": torch.cat([rows["proposed"], proposed]),
                    "proposal_logits": torch.cat([rows["proposal_logits"], proposal_logits])}
            target_tokens = torch.cat([target_tokens, torch.tensor(after[1:], dtype=torch.long)])
    target = rows["target"]
    ext = torch.tensor(generated + after, dtype=torch.long)
    differ = torch.nonzero(target_tokens[: len(ext)] != ext)
    agrees = int(differ[0, 0]) if len(differ) else len(ext)
    tail_ok = finish != "eos" or int(target_tokens[len(generated)]) in set(engine.pair.eos_token_ids)
    scores = (lambda x, n: x) if draw is None else (  # what a draw compares: the perturbed scores under coupling
        lambda x, n: x / draw.temperature + n[: x.shape[0], : x.shape[1]])
    ties = _near_ties(scores(target, noise)) + _near_ties(scores(rows["proposal_logits"], noise))
    return Forced(len(prompt), list(generated), finish, target, rows["hidden"], rows["draft"], rows["proposed"], agrees,
                  ties, time.perf_counter() - t0, after, tail_ok, target_tokens, draw,
                  None if noise is None else noise[: target.shape[0] + 1])


def _cut(logits: Tensor, draw: CoupledDraw | None) -> Tensor:
    return logits if draw is None else draw.cut(logits)


def _draws(cut_logits: Tensor, draw: CoupledDraw | None, noise: Tensor | None) -> Tensor:
    """Each row's token: the argmax (greedy), or the coupled draw with its row's noise."""
    if draw is None:
        return cut_logits.argmax(dim=-1)
    return draw.tokens(cut_logits, noise[: cut_logits.shape[0]])


def _draft_rows(engine: Any, hidden: Tensor, draw: CoupledDraw | None = None,
                noise: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """From the draft's hidden states [1, n, d]: its full logits [n, V] (cut, under coupling), its proposals [n]
    and the logits they were chosen from [n, P] (greedy: the proposal vocabulary's, ``SpecDecoder.proposal``, or
    the full ones; coupled: the full head's, as live sampling proposes)."""
    full = _cut(engine.draft.head(hidden)[0].float(), draw)
    proposal = getattr(engine, "proposal", None)
    if draw is not None:
        return full, _draws(full, draw, noise), full
    if proposal is None:
        return full, full.argmax(dim=-1), full
    return full, proposal.argmax(hidden[0]), proposal.logits(hidden[0]).float()


def _forced_rows(engine: Any, prompt: list[int], seq: list[int], draw: CoupledDraw | None = None,
                 noise: Tensor | None = None) -> dict[str, Tensor]:
    rows: dict[str, Tensor] = {}
    for name, lm in (("target", engine.target), ("draft", engine.draft)):
        if engine.prefix_cache:
            lm.reuse(prompt[:-1])
        else:
            lm.reset()
            lm.forward(torch.tensor([prompt[:-1]])) if len(prompt) > 1 else None
        if lm.length < len(prompt) - 1:  # the cache held less than the prompt: prefill the rest
            lm.forward(torch.tensor([prompt[lm.length: len(prompt) - 1]]))
        hidden = lm.forward(torch.tensor([seq[len(prompt) - 1:]]))  # [1, T + 1, d]
        if name == "target":
            rows[name] = _cut(lm.head(hidden)[0].float(), draw)
            rows["hidden"] = hidden[0]
        else:
            rows[name], rows["proposed"], rows["proposal_logits"] = _draft_rows(engine, hidden, draw, noise)
    return rows


@dataclass
class Decided:
    """A rule's decisions over a pass: ``accepted`` [P] bool and the greedy ``drafts`` [P] long at every
    position; for a rule that looks ahead in its block (FLy, ``policies.lookahead``), ``still_open`` [P] bool
    marks the rejections that the next ``window`` positions of a live block could still turn into acceptances:
    their rows in a live verify pass follow the draft's token, which the pass (on the target's) does not hold."""

    accepted: Tensor
    drafts: Tensor
    still_open: Tensor | None = None
    window: int = 0

    def __iter__(self):  # (accepted, drafts), as callers unpack it
        return iter((self.accepted, self.drafts))


@torch.inference_mode()
def decisions(engine: Any, forced: Forced, policy: Policy, seed: int) -> Decided:
    """The rule's decision at every position of the pass for the draft token there, all in one ``decide`` (the
    positions as one block: a decision depends on its own position's inputs and its position-keyed randomness
    alone, at T = 0 and under the coupled sampler, whose noise is the position's too). A look-ahead rule decides
    each position from its own inputs (``policies.decide_local``) and says where its block could still decide
    otherwise (:class:`Decided`)."""
    draft_tokens = forced.draft_tokens  # [P]
    target = torch.cat([forced.target_logits, forced.target_logits[-1:]])  # the bonus slot: never read
    hidden = torch.cat([forced.target_hidden, forced.target_hidden[-1:]])
    positions = torch.arange(forced.prompt_len, forced.prompt_len + forced.positions).unsqueeze(0)
    # the draft's distribution exactly where a live round hands it to the rule (``SpecDecoder.generate``'s ``full`` at
    # T = 0): a rule that does not read it gets None, as live, so the same statistics kernel decides both
    # (at T > 0 a live round always hands it over: the draft sampled from it)
    full = forced.draw is not None or getattr(engine, "proposal", None) is None or needs_draft_logits(policy)
    coupling = None if forced.noise is None else forced.noise.unsqueeze(0)  # [1, P + 1, V]: the bonus slot's too
    batch = VerifyBatch(draft_token_ids=draft_tokens.unsqueeze(0),
                        draft_logits=forced.draft_logits.unsqueeze(0) if full else None,
                        target_logits=target.unsqueeze(0), target_hidden=hidden.unsqueeze(0),
                        lm_head_weight=engine.lm_head_weight, lm_head_bias=engine.lm_head_bias,
                        temperature=0.0 if forced.draw is None else forced.draw.temperature,
                        generator=None, streams=PositionStreams(seed, positions), coupling=coupling)
    window = lookahead(policy)
    if window == 0:
        return Decided(policy.decide(batch).accepted[0].bool(), draft_tokens)
    accepted, still_open = decide_local(policy, batch)
    return Decided(accepted[0].bool(), draft_tokens, None if still_open is None else still_open[0].bool(), window)


@dataclass
class Simulated:
    """The rounds a live run at draft length L makes on the target-only prefix."""

    stats: GenerationStats
    resume_at: int | None  # None: the run is the target-only output, done; else decode live from here
    reason: str  # "exact" | "diverged" (an accepted mismatch at ``diverged_at``) | "past the pass" | "look-ahead"
    diverged_at: int | None = None  # the generated index of the first accepted mismatch


def simulate(accepted: Tensor, draft_tokens: Tensor, forced: Forced, draft_len: int, max_new_tokens: int,
             still_open: Tensor | None = None, window: int = 0) -> Simulated:
    """Walk the live loop's rounds (``SpecDecoder.generate`` at T = 0) over the pass's decisions.

    Each round drafts n = min(L, budget left) tokens, keeps the leading accepted run and emits the target's
    argmax after it; on the target-only prefix that is y there (row T: the token after y, EOS when the
    reference ended on it). The round that emits the last token the reference kept (y's last for a stop
    string or the budget, the EOS after y) finishes: the stopper cuts the same tokens at the same place.
    A round is not simulated, and the live run resumes at its start, when its accepted run holds a token that
    is not the prefix's (divergence), or when it needs a row past the pass (a decision after the EOS, or
    after the token that ended on a stop string) or at or past a row whose argmax disagrees with y (a
    numerical near-tie between the pass and the reference), or when a look-ahead rule rejects where its window
    fits in the round and could still accept (``still_open``, ``window``: the rows after it in a live verify
    pass follow the draft's token there, not the prefix's)."""
    acc, drafts = accepted.tolist(), draft_tokens.tolist()
    open_ = still_open.tolist() if still_open is not None else None
    y, end = forced.generated, len(forced.generated)
    nxt = [int(forced.target_tokens[end])] if forced.positions > end and not forced.after else []
    ext = y + (forced.after or nxt)  # the prefix every on-prefix round sees, and the target's tokens after it
    finish_at = end if forced.finish == "eos" else end - 1  # the generated index of the round's last token
    trusted = min(forced.agrees, len(ext)) if forced.after else (len(ext) if forced.agrees >= end else forced.agrees)
    if not forced.tail_ok:  # the EOS the reference stopped on is not the pass's argmax: decode any round reaching it
        trusted = min(trusted, end)
    stats = GenerationStats(draft_len=draft_len, accepted_per_position=[0] * draft_len)
    g = 0
    while True:
        n_draft = min(draft_len, max_new_tokens - g)
        n_acc = 0
        for j in range(n_draft):
            t = g + j
            if t >= min(trusted, len(ext)):
                return Simulated(stats, g, "past the pass")
            if not acc[t]:
                if open_ is not None and open_[t] and j + window < n_draft:
                    return Simulated(stats, g, "look-ahead")
                break
            if drafts[t] != ext[t]:
                return Simulated(stats, g, "diverged" if t < end or forced.finish == "eos" else "past the pass",
                                 t)
            n_acc += 1
        # the emitted token's row is past the pass, or a near-tie's; unless the accepted run already holds the
        # reference's last token (its EOS accepted as a draft): the run ends there and the emitted token is cut
        if g + n_acc >= min(trusted, len(ext)) and g + n_acc - 1 < finish_at:
            return Simulated(stats, g, "past the pass")
        stats.num_drafts += 1
        stats.target_forwards += 1
        stats.draft_forwards += n_draft
        stats.num_draft_tokens += n_draft
        stats.num_accepted_tokens += n_acc
        for i in range(n_acc):
            stats.accepted_per_position[i] += 1
        g += n_acc + 1
        if g - 1 >= finish_at:
            stats.num_generated = end
            return Simulated(stats, None, "exact")


@dataclass
class Replayed:
    generation: Generation
    reason: str  # "exact" (nothing decoded) | "diverged" | "past the pass" | "near-tie" | "look-ahead"
    decoded_from: int | None  # the generated index live decoding resumed at (None: nothing decoded)
    diverged_at: int | None = None
    seconds: dict[str, float] = field(default_factory=dict)


def replay(engine: Any, prompt: list[int], reference: Generation, policy: Policy | str, draft_len: int,
           max_new_tokens: int, temperature: float = 0.0, seed: int = 0, stop: Any = None,
           forced: Forced | None = None, accepted: Decided | None = None, top_k: int = 0, top_p: float = 1.0,
           sampler: str = "standard") -> Replayed:
    """``policy`` at ``draft_len`` on ``prompt`` as a live speculative decode would run it, from the
    target-only ``reference`` (the same prompt, max_new_tokens, stop strings and sampling): exact at T = 0, and
    at T > 0 under the coupled sampler (``sampler="coupled"``, the reference drawn with it at the same ``seed``,
    ``top_k`` and ``top_p``), where target-only and lossless draw the same tokens; ``NotReplayable`` otherwise.
    ``forced`` / ``accepted``: a pass and decisions already computed (the same item under several L)."""
    draw = draw_for(temperature, top_k, top_p, sampler, seed)
    if forced is not None and forced.draw != draw:
        raise ValueError(f"the pass was made for {forced.draw}, the run draws with {draw}")
    if reference.finish_reason == "abort":
        raise NotReplayable("the reference run was aborted: decode in full")
    made = len(reference.token_ids)
    if made > max_new_tokens or (reference.finish_reason == "length" and made != max_new_tokens) or (
            reference.finish_reason == "eos" and made >= max_new_tokens):  # an EOS past the budget: a larger one's
        # the reference store's key ties its settings to the run's; a payload that does not fit is from another run
        raise NotReplayable(f"the reference holds {made} tokens ({reference.finish_reason}), not what max_new_tokens "
                            f"{max_new_tokens} gives: made with other settings, decode in full")
    if isinstance(policy, str):
        policy = make_policy(policy)
    t0 = time.perf_counter()
    forced = forced or forced_pass(engine, prompt, reference.token_ids, reference.finish_reason, extend=draft_len,
                                   draw=draw)
    decided = accepted or decisions(engine, forced, policy, seed)
    t1 = time.perf_counter()
    sim = simulate(decided.accepted, decided.drafts, forced, draft_len, max_new_tokens, decided.still_open,
                   decided.window)
    seconds = {"forced_s": forced.seconds, "decide_s": t1 - t0}
    if sim.resume_at is None:
        text = reference.text
        gen = Generation(list(reference.token_ids), text, reference.finish_reason, sim.stats)
        return Replayed(gen, "exact", None, None, seconds)
    g = sim.resume_at
    reason = "near-tie" if sim.reason == "past the pass" and (forced.agrees < len(forced.generated)
                                                                or not forced.tail_ok) else sim.reason
    t2 = time.perf_counter()
    sampling = {} if draw is None else {"top_k": top_k, "top_p": top_p, "sampler": sampler}
    live = engine.generate(prompt, policy, draft_len=draft_len, max_new_tokens=max_new_tokens, temperature=temperature,
                           seed=seed, stop=stop, generated_prefix=forced.generated[:g], **sampling)
    seconds["decode_s"] = time.perf_counter() - t2
    stats = replace(sim.stats.plus(live.stats), num_generated=len(live.token_ids))
    return Replayed(Generation(live.token_ids, live.text, live.finish_reason, stats), reason, g, sim.diverged_at,
                    seconds)
