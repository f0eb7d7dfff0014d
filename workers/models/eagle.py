"""EAGLE-3 draft heads: the checkpoint layout vLLM loads (``speculative_config={"method": "eagle3"}``), a check
of a head directory against its target before any vLLM process starts, and a seeded random head for the tiny
pair (tests).

An EAGLE-3 head is one decoder layer that drafts from the target's own hidden states: ``fc`` folds the
hidden states of three target layers (``eagle_aux_hidden_state_layer_ids``) into one, the layer's attention
reads ``[token embedding ; that state]`` (q/k/v take ``2 x hidden``), and its ``lm_head`` scores
``draft_vocab_size`` ids. A head with a reduced vocabulary maps its ids to the target's through ``d2t``
(``target id = draft id + d2t[draft id]``); vLLM then returns its logits over the target's vocabulary, ``-inf``
outside that image, so a rule reading q reads it over the target's ids. The token embedding is the target's
(vLLM shares it); a head has no tokenizer of its own.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from workers.models.pair import model_config


def _is_eagle3(architecture: str) -> bool:
    """vLLM's EAGLE-3 classes all carry "Eagle3" in their registered names (LlamaForCausalLMEagle3,
    Eagle3LlamaForCausalLM, Eagle3Qwen3vlForCausalLM, Eagle3DeepseekV2ForCausalLM, the speculators library's
    Eagle3Speculator...): the list grows with each release, the name does not change."""
    return "eagle3" in architecture.lower()


def _weight_names(head_dir: Path) -> set[str]:
    """The tensor names of a head's checkpoint: safetensors files, a sharded index, or PyTorch ``.bin`` files
    (the original EAGLE-3 releases), read without loading the tensors' data where the format allows."""
    names: set[str] = set()
    for index in head_dir.glob("*.index.json"):
        try:
            names |= set(json.loads(index.read_text()).get("weight_map", {}))
        except (OSError, ValueError):
            pass
    for f in head_dir.glob("*.safetensors"):
        from safetensors import safe_open

        with safe_open(str(f), "pt") as st:
            names |= set(st.keys())
    for f in head_dir.glob("*.bin"):
        names |= set(torch.load(str(f), map_location="cpu", weights_only=True, mmap=True))
    return names


def check_head_dir(head_dir: str | Path, target_dir: str | Path, tensor_parallel_size: int = 1) -> None:
    """What vLLM would refuse late, or run wrongly, about an EAGLE-3 head for ``target_dir``, as one ValueError
    naming the problem: not an EAGLE-3 architecture, another vocabulary than the target's, a draft vocabulary
    wider than it or reduced without its ``d2t`` map, a hidden size or aux layers the target does not have,
    attention heads tensor parallelism cannot split."""
    head_dir, target_dir = Path(head_dir), Path(target_dir)
    head, target = model_config(head_dir, "EAGLE-3 head"), model_config(target_dir, "target")
    archs = head.get("architectures") or []
    if not any(_is_eagle3(str(a)) for a in archs):
        raise ValueError(f"EAGLE-3 head {head_dir} declares architectures {archs}; vLLM runs an eagle3 head only as "
                         "one of its Eagle3 classes (LlamaForCausalLMEagle3, Eagle3LlamaForCausalLM, ...)")
    vocab = head.get("vocab_size", target.get("vocab_size"))
    draft_vocab = head.get("draft_vocab_size", vocab)
    if vocab != target.get("vocab_size"):
        raise ValueError(f"EAGLE-3 head {head_dir} has vocab_size {vocab!r}, its target {target_dir} "
                         f"{target.get('vocab_size')!r}: a head drafts for the target it was trained on")
    if not (isinstance(draft_vocab, int) and 0 < draft_vocab <= vocab):
        raise ValueError(f"EAGLE-3 head {head_dir}: draft_vocab_size {draft_vocab!r} must be in [1, vocab_size {vocab}]")
    hidden = head.get("target_hidden_size", head.get("hidden_size"))
    if hidden is not None and hidden != target.get("hidden_size"):
        raise ValueError(f"EAGLE-3 head {head_dir} reads hidden states of size {hidden!r}, its target {target_dir} "
                         f"has {target.get('hidden_size')!r}")
    layers = int(target.get("num_hidden_layers") or 0)
    aux = head.get("eagle_aux_hidden_state_layer_ids")
    if aux is not None and not (isinstance(aux, list) and aux and all(isinstance(i, int) and 0 <= i <= layers
                                                                       for i in aux)):
        raise ValueError(f"EAGLE-3 head {head_dir}: eagle_aux_hidden_state_layer_ids {aux!r} must name layers of its "
                         f"target (0..{layers})")
    if draft_vocab < vocab:
        names = _weight_names(head_dir)
        if not any(n == "d2t" or n.endswith(".d2t") for n in names):
            raise ValueError(f"EAGLE-3 head {head_dir} drafts over {draft_vocab} of {vocab} ids but has no d2t map: "
                             "vLLM would read its ids as the target's first ids")
    heads = head.get("num_attention_heads")
    if isinstance(heads, int) and heads % tensor_parallel_size:
        raise ValueError(f"EAGLE-3 head {head_dir} has {heads} attention heads, not divisible by tensor_parallel_size "
                         f"{tensor_parallel_size}")


def save_tiny_eagle3_head(directory: str | Path, target_dir: str | Path, seed: int = 0,
                          draft_ids: list[int] | None = None, aux_layers: tuple[int, ...] = (0, 1, 2)) -> Path:
    """A seeded random EAGLE-3 head for the (tiny) target in ``target_dir``, written to ``directory``.
    ``draft_ids``: the target ids of a reduced draft vocabulary (sorted; ``d2t`` maps them), None for the full
    vocabulary. The head starts from the target itself so that some drafts are accepted (a fully random head's
    never are): its layer adds nothing (``o_proj`` and ``down_proj`` zero), ``fc`` passes the last aux state (the
    target's final pre-norm state) and ``lm_head`` is the target's rows with 10% noise; q is then close to the
    target's distribution one position back, so it drafts what the target tends to repeat."""
    from safetensors.torch import load_file, save_file

    target_dir, out = Path(target_dir), Path(directory)
    cfg = model_config(target_dir, "target")
    vocab, hidden = int(cfg["vocab_size"]), int(cfg["hidden_size"])
    heads, kv_heads = int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"])
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    inter = int(cfg["intermediate_size"])
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, std: float = 0.05) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).contiguous()

    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(target_dir.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    target_head = tensors.get("lm_head.weight", tensors.get("model.embed_tokens.weight"))  # tied: the embedding
    if target_head is None:
        raise ValueError(f"target {target_dir} has neither lm_head.weight nor model.embed_tokens.weight")
    target_head = target_head.float()
    fc = torch.zeros(hidden, len(aux_layers) * hidden)
    fc[:, -hidden:] = torch.eye(hidden)
    lm_head = target_head + rnd(*target_head.shape, std=float(target_head.std()) * 0.1)
    w = {
        "midlayer.self_attn.q_proj.weight": rnd(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": rnd(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": rnd(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": torch.zeros(hidden, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": rnd(inter, hidden),
        "midlayer.mlp.up_proj.weight": rnd(inter, hidden),
        "midlayer.mlp.down_proj.weight": torch.zeros(hidden, inter),
        "midlayer.input_layernorm.weight": torch.ones(hidden),
        "midlayer.hidden_norm.weight": torch.ones(hidden),
        "midlayer.post_attention_layernorm.weight": torch.ones(hidden),
        "norm.weight": torch.ones(hidden),
        "fc.weight": fc,
        "lm_head.weight": lm_head,
    }
    draft_vocab = vocab
    if draft_ids is not None:
        ids = torch.tensor(sorted(set(draft_ids)), dtype=torch.int64)
        if ids.numel() == 0 or int(ids[0]) < 0 or int(ids[-1]) >= vocab:
            raise ValueError(f"draft_ids must be target ids in [0, {vocab}), got {draft_ids[:5]}...")
        draft_vocab = int(ids.numel())
        w["lm_head.weight"] = lm_head[ids].contiguous()
        w["d2t"] = ids - torch.arange(draft_vocab)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[ids] = True
        w["t2d"] = t2d
    out.mkdir(parents=True, exist_ok=True)
    save_file(w, str(out / "model.safetensors"))
    head_cfg = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": 1, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "hidden_act": "silu",
        "rms_norm_eps": cfg.get("rms_norm_eps", 1e-6), "max_position_embeddings": cfg.get("max_position_embeddings", 4096),
        "tie_word_embeddings": False, "vocab_size": vocab, "draft_vocab_size": draft_vocab,
        "target_hidden_size": hidden, "eagle_aux_hidden_state_layer_ids": list(aux_layers), "torch_dtype": "float32",
        "eos_token_id": cfg.get("eos_token_id"), "pad_token_id": cfg.get("pad_token_id"),
    }
    if "rope_parameters" in cfg:
        head_cfg["rope_parameters"] = cfg["rope_parameters"]
    else:
        head_cfg["rope_theta"] = cfg.get("rope_theta", 10000.0)
    (out / "config.json").write_text(json.dumps(head_cfg, indent=1))
    return out
