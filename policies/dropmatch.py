"""DropMatch (arXiv 2603.03333): K MC-dropout heads on the target's LM head; accept a draft token
that fits their spread.

- ``naive``: accept d if some head's token y_i equals d.
- ``js``: accept if JS(q ‖ p̄) <= max_i JS(p_i ‖ p̄) — the draft sits inside the heads' own spread
  around their centroid p̄ = softmax(mean_i l_i) — or if d is the majority token (held by more than
  K/2 heads). JS in nats.

Scores: ``js`` -> max_i JS(p_i ‖ p̄) − JS(q ‖ p̄) (>= 0 where the JS test passes); ``naive`` -> the
fraction of heads whose token is d.
"""

from __future__ import annotations

from dataclasses import dataclass

from policies.core import Decision, PolicyConfig, SearchRange, Valid, VerifyBatch, knob, require
from policies.distributions import js_from_probs
from policies.dropout_head import atoms_of, dropout_heads, head_tokens
from policies.lossless import lossless_accept, with_lossless
from policies.registry import Leniency, Traits, register


@dataclass(frozen=True)
class DropMatchConfig(PolicyConfig):
    k: int = knob(5, valid=Valid(low=1), search=SearchRange(2, 16, integer=True), doc="number of dropout heads K")
    p_drop: float = knob(
        0.3, valid=Valid(low=0.0, high=1.0, high_open=True), search=SearchRange(0.05, 0.6), doc="dropout rate"
    )
    criterion: str = knob("js", valid=Valid(choices=("js", "naive")), search=SearchRange(choices=("js", "naive")))
    mode: str = knob(
        "candidate", valid=Valid(choices=("exact", "candidate")), doc="full-vocabulary heads or candidate set"
    )
    num_candidates: int = knob(64, valid=Valid(low=1), doc="candidate mode: target top-M per position")


def dropmatch_traits(config: DropMatchConfig) -> Traits:
    """The heads run on the target's hidden state with dropout masks drawn at every temperature. Exact mode's K
    full-vocabulary heads are one GEMM over every row of a block ([K x rows, d] x [d, V]), and a float GEMM's row
    need not come out the same at another row count: with dropout on, replay's pass of hundreds of rows is no live
    round of a few (candidate mode multiplies each position's heads by its own candidates apart). In a ragged
    batch, exact mode holds K head logits per row (its chunks shrink by K) and candidate mode's per-chunk small ops
    want the largest CPU blocks."""
    exact = config.mode == "exact"
    return Traits(needs_hidden=True, draws_when_greedy=True, replays_exactly=not (exact and config.p_drop > 0),
                  cpu_block="fused" if exact else "heads", vocab_heads=config.k if exact else 0)


@register(
    "dropmatch",
    config=DropMatchConfig,
    off={"p_drop": 0.0, "criterion": "naive"},
    off_exact_when_sampling=False,  # at T > 0 the K heads' tokens are K samples of p_t
    leniency=Leniency("k", (1, 2, 4, 8, 16), {"criterion": "naive", "p_drop": 0.3}),
    traits=dropmatch_traits,
)
def decide_dropmatch(batch: VerifyBatch, config: DropMatchConfig) -> Decision:
    """Accept a draft token that fits the spread of K MC-dropout target heads."""
    hidden = require(batch, "target_hidden", "dropmatch", "the dropout heads run on the target's final hidden state")
    weight = require(batch, "lm_head_weight", "dropmatch", "the dropout heads reuse the target's LM head")
    draft_logits = None
    if config.criterion == "js":
        draft_logits = require(batch, "draft_logits", "dropmatch", "criterion 'js' compares the draft's distribution")
    if config.mode == "candidate" or draft_logits is not None:
        batch.fused  # noqa: B018 - the T = 1 log-partitions too (rest atom, draft atoms): one fused pass, shared
    lossless = lossless_accept(batch)
    heads = dropout_heads(
        hidden=hidden[:, :-1],
        lm_head_weight=weight,
        lm_head_bias=batch.lm_head_bias,
        target_logits=batch.target_f32[:, :-1],
        target_lse=batch.target_lse,
        draft_token_ids=batch.draft_token_ids,
        k=config.k,
        p_drop=config.p_drop,
        mode=config.mode,
        num_candidates=config.num_candidates,
        temperature=batch.temperature,
        generator=batch.generator,
        streams=batch.streams,
    )
    votes = (head_tokens(heads) == batch.draft_token_ids.unsqueeze(0)).sum(dim=0)  # [B, L]
    if config.criterion == "naive":
        return with_lossless(lossless, votes > 0, votes.float() / config.k)
    assert draft_logits is not None
    head_probs = heads.logits.softmax(dim=-1)  # [K, B, L, A]
    centroid = heads.logits.mean(dim=0).softmax(dim=-1)  # [B, L, A]
    spread = js_from_probs(head_probs, centroid.unsqueeze(0)).amax(dim=0)  # [B, L]
    # candidate mode gathers the draft's log-probabilities at its atoms (no full-vocabulary log-softmax)
    draft_atoms = atoms_of(heads, batch.draft_logp if heads.atom_ids is None else batch.draft_logp_at)
    draft_js = js_from_probs(draft_atoms.exp(), centroid)  # [B, L]
    relaxed = (draft_js <= spread) | (2 * votes > config.k)
    return with_lossless(lossless, relaxed, spread - draft_js)
