"""How much device memory a pair needs under vLLM, from the models' configs alone, and how the two engines
(speculative: target + draft; target-only: the reference) share one device.

Per rank (tensor parallelism divides weights and KV heads) it counts: the weights; the KV cache of the
batch (``max_num_seqs`` sequences of ``context`` tokens, at least one ``max_model_len`` sequence), the
draft's too in the speculative engine; what spectune adds outside vLLM's profiling (the cached draft
distribution q and its concatenated copy, ``[max_num_seqs x L, V]`` each, in the draft's dtype (the drafter's
logits divided by T, :func:`workers.vllm.drafts.scaled_as_vllm`); DropMatch's dropout
logits, one chunk of ``K x 2^26 / K`` float32 at most; the LM head gathered whole on every rank under TP);
a CUDA context per process on the device; and a fixed headroom for NCCL and allocator slack. vLLM hands an
engine's whole ``gpu_memory_utilization`` share, less the peak it profiled, to the KV cache, so the extras
(allocated by the rules after profiling) and the contexts are kept outside both engines' shares. From those:

- ``both``: both engines resident on one device (no restart between a reference and a candidate), each
  given a ``gpu_memory_utilization`` that covers its own need plus a share of what is left;
- ``one at a time``: each engine alone fits, not both: they alternate (a restart per switch);
- ``does not fit``: even one engine does not fit: more tensor parallelism (the smallest TP that both
  models' heads allow and at which each engine fits is named; vLLM runs the draft at the target's TP).

Estimates, stated as such: parameters from the config's shapes (within ~2% of the published counts for
Qwen2.5 0.5B-72B and Llama 3 8B/70B), activations left to vLLM's own profiling inside its fraction.
``python -m workers.vllm.memory --table`` prints the table the docs carry (docs/vllm-engine.md).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from policies.ragged import CHUNK_ELEMENTS  # the padded float32 block a rule call works on at once (GPU)

GIB = 1 << 30
HEADROOM_BYTES = int(1.5 * GIB)  # NCCL buffers, allocator fragmentation: outside any engine
CONTEXT_BYTES = int(0.5 * GIB)  # one CUDA context per process on the device (each engine's worker, the caller's)
TP_SIZES = (1, 2, 4, 7, 8, 14, 16)  # tried for the smallest TP that fits (the heads must divide, both models)
PLAN_DROPMATCH_K = 8  # DropMatch heads the plan makes room for unless told (the search's K reaches 16)
DTYPE_BYTES = {"bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2, "float32": 4, "fp32": 4, "float": 4}


@dataclass(frozen=True)
class ModelShape:
    """What memory depends on, from a Hugging Face ``config.json``."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    qkv_bias: bool = True  # Qwen2 has q/k/v biases; Llama-style configs say attention_bias
    # An EAGLE-3 head: the target states its ``fc`` folds into one (its layer then reads 2 x hidden: the token's
    # embedding beside the folded state); 0 for any other model
    aux_layers: int = 0
    head_vocab: int = 0  # the LM head's rows where narrower than ``vocab`` (an EAGLE-3 head's draft vocabulary)
    embedding: bool = True  # False: the model uses another's token embedding (an EAGLE-3 head that has none)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelShape:
        """The shape a ``config.json`` describes: a multimodal model's language model (``text_config``), an
        EAGLE-3 head in the speculators library's layout (``transformer_layer_config``) or vLLM's."""
        from workers.models.eagle import _is_eagle3
        from workers.models.pair import flat_config

        c = flat_config(config)
        eagle3 = any(_is_eagle3(str(a)) for a in (c.get("architectures") or []))
        try:
            heads = int(c["num_attention_heads"])
            hidden = int(c["hidden_size"])
            vocab = int(c["vocab_size"])
            head_vocab = int(c.get("draft_vocab_size") or vocab) if eagle3 else vocab
            aux = len(c.get("eagle_aux_hidden_state_layer_ids")
                      or (c.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or (0, 1, 2))
            return cls(layers=int(c["num_hidden_layers"]), hidden=hidden, heads=heads,
                       kv_heads=int(c.get("num_key_value_heads") or heads),
                       head_dim=int(c.get("head_dim") or hidden // heads), intermediate=int(c["intermediate_size"]),
                       vocab=vocab, tied=bool(c.get("tie_word_embeddings", False)) and not eagle3,
                       qkv_bias=bool(c.get("attention_bias", c.get("model_type") == "qwen2")),
                       aux_layers=aux if eagle3 else 0, head_vocab=head_vocab if head_vocab < vocab else 0)
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"config.json lacks what a memory estimate needs ({err}): num_hidden_layers, "
                             "hidden_size, num_attention_heads, intermediate_size, vocab_size") from None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelShape:
        """:meth:`from_config` of a model directory; an EAGLE-3 head whose checkpoint has no token embedding
        uses the target's (vLLM shares it), so none is counted."""
        path = Path(model_dir) / "config.json"
        try:
            shape = cls.from_config(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"{model_dir}: no readable config.json ({err})") from None
        if shape.aux_layers:
            from workers.models.eagle import _weight_names

            names = _weight_names(Path(model_dir))
            if names and not any("embed_tokens" in n for n in names):
                shape = replace(shape, embedding=False)
        return shape

    @property
    def params(self) -> int:
        """Parameters: the token embedding (unless shared), the LM head (untied), per layer q/k/v/o (+ q/k/v
        biases where the model has them) and a gated MLP, two norms per layer and the final one. An EAGLE-3
        head's layer reads 2 x hidden and has a third norm, and its ``fc`` folds ``aux_layers`` states."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        reads = self.hidden * (2 if self.aux_layers else 1)
        attn = reads * (q + 2 * kv) + (q + 2 * kv) * self.qkv_bias + q * self.hidden
        mlp = 3 * self.hidden * self.intermediate
        norms = (3 if self.aux_layers else 2) * self.hidden
        embed = self.vocab * self.hidden * self.embedding
        head = 0 if self.tied else (self.head_vocab or self.vocab) * self.hidden
        fc = self.aux_layers * self.hidden * self.hidden
        return embed + head + fc + self.layers * (attn + mlp + norms) + self.hidden

    def splits_over(self, tp: int) -> bool:
        """Whether tensor parallelism ``tp`` can split this model's heads (and split or replicate its KV heads)."""
        return self.heads % tp == 0 and (self.kv_heads % tp == 0 if self.kv_heads >= tp else tp % self.kv_heads == 0)

    def weight_bytes(self, dtype_bytes: int, tp: int = 1) -> int:
        return math.ceil(self.params * dtype_bytes / tp)

    def kv_bytes_per_token(self, dtype_bytes: int, tp: int = 1) -> int:
        """Keys and values of every layer for one token; KV heads split over TP ranks (replicated when fewer)."""
        return 2 * self.layers * max(1, math.ceil(self.kv_heads / tp)) * self.head_dim * dtype_bytes


@dataclass(frozen=True)
class MemoryPlan:
    card_gib: float
    tp: int
    mode: str  # "both", "one at a time", "does not fit"
    speculative_gib: float  # the speculative engine's need per rank: weights, KV, spectune's extras
    reference_gib: float  # the target-only engine's need per rank
    extras_gib: float  # of speculative_gib: q cache, DropMatch logits, the gathered LM head (outside every share)
    headroom_gib: float
    reserved_gib: float  # outside both engines' shares: headroom, the CUDA contexts and spectune's extras
    speculative_utilization: float | None  # gpu_memory_utilization to give each engine (None: does not fit)
    reference_utilization: float | None
    kv_tokens: int  # KV-cache tokens each engine is sized for
    smallest_tp: int | None  # the smallest TP both models' heads allow at which each engine fits (None: none)
    note: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def rule_working_bytes(vocab: int, rows: int, dropmatch_k: int) -> int:
    """What the plan keeps outside both engines' shares for a rule's working memory in one verify step of
    ``rows`` draft positions: DropMatch's dropout logits, ``K x rows x V`` float32, at most one chunk of
    them (``policies.ragged.CHUNK_ELEMENTS`` per head). ``jobs.gpu_check``'s memory section measures every
    rule's peak against it on the device."""
    return min(dropmatch_k * rows * vocab, CHUNK_ELEMENTS * dropmatch_k) * 4


def _needs(target: ModelShape, draft: ModelShape, dtype_bytes: int, tp: int, kv_tokens: int, max_num_seqs: int,
           draft_len: int, dropmatch_k: int) -> tuple[int, int, int]:
    rows = max_num_seqs * draft_len
    q_cache = 2 * rows * target.vocab * dtype_bytes  # the cached q and its concatenated copy, the draft's dtype
    dropmatch = rule_working_bytes(target.vocab, rows, dropmatch_k)
    gathered_head = 0 if tp == 1 else target.vocab * target.hidden * dtype_bytes  # full head on every rank
    extras = q_cache + dropmatch + gathered_head
    spec = (target.weight_bytes(dtype_bytes, tp) + draft.weight_bytes(dtype_bytes, tp)
            + kv_tokens * (target.kv_bytes_per_token(dtype_bytes, tp) + draft.kv_bytes_per_token(dtype_bytes, tp))
            + extras)
    ref = target.weight_bytes(dtype_bytes, tp) + kv_tokens * target.kv_bytes_per_token(dtype_bytes, tp)
    return spec, ref, extras


def plan_memory(card_bytes: int, target: ModelShape, draft: ModelShape, *, dtype: str = "bfloat16", tp: int = 1,
                max_num_seqs: int = 256, draft_len: int = 5, max_model_len: int = 4096, context: int = 1024,
                dropmatch_k: int = PLAN_DROPMATCH_K) -> MemoryPlan:
    """How the pair fits on a device of ``card_bytes`` per rank (see the module docstring). ``context``:
    the tokens a typical sequence holds (prompt + output); the KV cache is sized for ``max_num_seqs`` of
    them, at least one ``max_model_len`` sequence."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPE_BYTES)}")
    if card_bytes <= HEADROOM_BYTES:
        raise ValueError(f"a device of {card_bytes / GIB:.1f} GiB is smaller than the {HEADROOM_BYTES / GIB:.1f} GiB headroom")
    nbytes = DTYPE_BYTES[dtype]
    kv_tokens = max(max_model_len, max_num_seqs * context)
    spec, ref, extras = _needs(target, draft, nbytes, tp, kv_tokens, max_num_seqs, draft_len, dropmatch_k)
    # vLLM gives an engine's whole share, less its profiled peak, to the KV cache: spectune's extras (allocated
    # by the rules at run time, after profiling) and every process's CUDA context must lie outside both shares

    def usable(contexts: int, extra: int = extras) -> int:
        return card_bytes - HEADROOM_BYTES - contexts * CONTEXT_BYTES - extra

    def fits_alone(t: int) -> bool:
        s_, r_, x_ = _needs(target, draft, nbytes, t, kv_tokens, max_num_seqs, draft_len, dropmatch_k)
        return max(s_ - x_, r_) <= usable(2, x_)

    smallest = next((t for t in TP_SIZES if target.splits_over(t) and draft.splits_over(t) and fits_alone(t)), None)
    g = 1 / GIB
    engine = spec - extras  # what vLLM's profiling of the speculative engine sees
    contexts = 3  # both engines' workers and the process that starts them
    if engine + ref <= usable(3):
        spare = usable(3) - engine - ref  # shared in proportion to need: more KV for both
        s_share = (engine + spare * engine / (engine + ref)) / card_bytes
        r_share = (ref + spare * ref / (engine + ref)) / card_bytes
        mode, note = "both", "both engines resident; their fractions leave the headroom, contexts and extras free"
    elif max(engine, ref) <= usable(2):
        contexts = 2
        s_share = r_share = usable(2) / card_bytes
        mode, note = "one at a time", "each engine alone fits, not both: they alternate (a restart per switch)"
    else:
        s_share = r_share = None
        mode = "does not fit"
        note = (f"not even one engine fits at TP {tp}: use TP {smallest}" if smallest else
                f"not even one engine fits at TP {tp}, nor at any TP both models' heads allow: a larger device, "
                "fewer sequences or another draft")
    return MemoryPlan(card_gib=round(card_bytes * g, 1), tp=tp, mode=mode, speculative_gib=round(spec * g, 2),
                      reference_gib=round(ref * g, 2), extras_gib=round(extras * g, 2),
                      headroom_gib=round(HEADROOM_BYTES * g, 2),
                      reserved_gib=round((card_bytes - usable(contexts)) * g, 2),
                      speculative_utilization=None if s_share is None else round(math.floor(s_share * 1000) / 1000, 3),
                      reference_utilization=None if r_share is None else round(math.floor(r_share * 1000) / 1000, 3),
                      kv_tokens=kv_tokens, smallest_tp=smallest, note=note)


# Published shapes (config.json) of the models the docs' table covers.
QWEN25 = {
    "0.5B": dict(layers=24, hidden=896, heads=14, kv_heads=2, head_dim=64, intermediate=4864, vocab=151936, tied=True),
    "1.5B": dict(layers=28, hidden=1536, heads=12, kv_heads=2, head_dim=128, intermediate=8960, vocab=151936, tied=True),
    "7B": dict(layers=28, hidden=3584, heads=28, kv_heads=4, head_dim=128, intermediate=18944, vocab=152064, tied=False),
    "72B": dict(layers=80, hidden=8192, heads=64, kv_heads=8, head_dim=128, intermediate=29568, vocab=152064,
                tied=False),
}


# target -> its draft in the table: vLLM runs the draft at the target's TP, and the 0.5B's 14 heads allow
# only TP 1, 2 and 14, too few for a 72B target; the 1.5B's 12 heads (2 KV heads) allow TP 4
TABLE_PAIRS = {"1.5B": "0.5B", "7B": "0.5B", "72B": "1.5B"}


def table(cards_gib: tuple[int, ...] = (24, 40, 80, 141), targets: tuple[str, ...] = ("1.5B", "7B", "72B"),
          **kwargs: Any) -> str:
    """The markdown table of :func:`plan_memory` for Qwen2.5 targets and drafts (:data:`TABLE_PAIRS`), bf16,
    per card, at the smallest TP that fits (TP 1 where it fits)."""
    lines = ["| card | pair (draft → target) | TP | speculative engine | target-only engine | of which spectune's "
             "extras | engines | gpu_memory_utilization (spec / ref) |", "|---|---|---|---|---|---|---|---|"]
    for card in cards_gib:
        for name in targets:
            target, draft = ModelShape(**QWEN25[name]), ModelShape(**QWEN25[TABLE_PAIRS[name]])
            p = plan_memory(card * GIB, target, draft, **kwargs)
            if p.mode == "does not fit" and p.smallest_tp:
                p = plan_memory(card * GIB, target, draft, **{**kwargs, "tp": p.smallest_tp})
            shares = "-" if p.speculative_utilization is None else \
                f"{p.speculative_utilization:g} / {p.reference_utilization:g}"
            mode = p.mode if p.mode != "does not fit" else "does not fit at any TP both models' heads allow"
            lines.append(f"| {card} GB | {TABLE_PAIRS[name]} → {name} | {p.tp} | {p.speculative_gib:.1f} GiB | {p.reference_gib:.1f} GiB "
                         f"| {p.extras_gib:.1f} GiB | {mode} | {shares} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Device memory a pair needs under vLLM, from the configs (estimates).")
    ap.add_argument("--table", action="store_true", help="the docs' table: Qwen2.5 targets x 24/40/80/141 GB cards")
    ap.add_argument("--target", help="target model directory (its config.json)")
    ap.add_argument("--draft", help="draft model directory")
    ap.add_argument("--card-gib", type=float, help="device memory per rank, GiB")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--draft-len", type=int, default=5)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--context", type=int, default=1024, help="tokens a typical sequence holds")
    args = ap.parse_args(argv)
    opts = dict(max_num_seqs=args.max_num_seqs, draft_len=args.draft_len, max_model_len=args.max_model_len,
                context=args.context)
    if args.table:
        print(table(**opts))
        return 0
    if not (args.target and args.draft and args.card_gib):
        ap.error("give --table, or --target, --draft and --card-gib")
    try:
        plan = plan_memory(int(args.card_gib * GIB), ModelShape.from_dir(args.target), ModelShape.from_dir(args.draft),
                           dtype=args.dtype, tp=args.tp, **opts)
    except ValueError as err:
        print(f"error: {err}")
        return 2
    print(json.dumps(plan.to_dict(), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
