"""The ``tiny-random`` pair: a seeded random Llama draft/target pair and a byte-level ChatML tokenizer, built in
code in tens of milliseconds, for fast tests (``load_pair("tiny-random")`` builds it); :func:`save_tiny_pair`
writes it as two model directories for engines that load from disk (vLLM)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from workers.models.pair_base import TINY_PAIR, ModelPair, finish_pair

TINY_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 256, 257, 258
TINY_VOCAB = 320  # 259 tokens padded to a multiple of 64, like Qwen's head is wider than its tokenizer
_CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
           "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Init scales: unit-scale embeddings and a 0.3-scale head give peaked but not one-hot next-token
# distributions (entropy ~3.3 nats of ln 259 = 5.6). The layer scale sets how far the target's second
# layer moves its argmax away from the shared first layer's: 0.08 gives ~65% draft/target agreement.
_EMB_STD, _HEAD_STD, _LAYER_STD, _DRAFT_NOISE = 1.0, 0.3, 0.08, 0.2


def tiny_tokenizer() -> Any:
    """A byte-level tokenizer (ids 0-255 are bytes) with ChatML specials, built without files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_to_char = bytes_to_unicode()
    # BPE with no merges over the 256 byte symbols: every byte is one token, any text round-trips.
    tok = Tokenizer(models.BPE(vocab={byte_to_char[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(TINY_SPECIALS))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   model_max_length=4096)
    fast.chat_template = _CHATML
    return fast


def _tiny_config(num_layers: int, head_dim: int = 16, vocab: int = TINY_VOCAB) -> Any:
    from transformers import LlamaConfig

    heads = 64 // head_dim if head_dim <= 32 else 2  # hidden 64 (4 x 16) or 2 x head_dim (vLLM: >= 32)
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab, hidden_size=heads * head_dim, intermediate_size=2 * heads * head_dim,
        num_hidden_layers=num_layers, num_attention_heads=heads,
        num_key_value_heads=heads // 2,  # grouped-query attention, as in Qwen2.5
        max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=None,
        eos_token_id=[258, 256], pad_token_id=256,
        # sdpa: the default every directory-loaded model (real or local) gets, so a tiny pair saved and
        # reloaded gives bit-identical logits, and tests run the same attention path as real runs.
        attn_implementation="sdpa",
    )
    return LlamaConfig(**kwargs)


def tiny_random_pair(dtype: torch.dtype = torch.float32, seed: int = 0, head_dim: int = 16,
                     draft_vocab: int = TINY_VOCAB) -> ModelPair:
    """A seeded random Llama pair for tests, built in code (tens of ms after import).

    The target has 2 layers; the draft is an early-exit copy of it: the target's embedding, first
    layer (plus a little noise), final norm and untied LM head. Sharing the head makes the draft agree
    with the target often but not always, so speculative decoding accepts some and rejects some.
    The global torch RNG is left untouched; weights depend only on ``seed``. ``head_dim`` 64 builds
    the same shape of pair wide enough for vLLM's CPU attention kernels (which reject 16).
    ``draft_vocab`` below ``TINY_VOCAB`` (and at least the 259 tokens) gives the draft a narrower
    embedding and LM head, the first rows of the target's, as a Qwen2.5 small -> 7B pair has.
    """
    from transformers import LlamaForCausalLM

    num_tokens = 256 + len(TINY_SPECIALS)
    if not num_tokens <= draft_vocab <= TINY_VOCAB:
        raise ValueError(f"draft_vocab must be in [{num_tokens}, {TINY_VOCAB}], got {draft_vocab}")

    gen = torch.Generator().manual_seed(seed)
    # Constructors draw their default init from the global RNG; fork it so callers' seeds stay put.
    with torch.random.fork_rng(devices=[]):
        target: Any = LlamaForCausalLM(_tiny_config(2, head_dim))
        draft: Any = LlamaForCausalLM(_tiny_config(1, head_dim, draft_vocab))
    # Wider layers sum more terms: scale their init so the target/draft agreement stays ~the same.
    layer_std = _LAYER_STD * (64 / target.config.hidden_size) ** 0.5
    with torch.no_grad():
        for pname, param in sorted(target.named_parameters()):  # sorted: order independent of module order
            if pname.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            std = _EMB_STD if "embed_tokens" in pname else _HEAD_STD if pname == "lm_head.weight" else layer_std
            param.copy_(torch.randn(param.shape, generator=gen) * std)
        # Padding rows score 0, below the best real token almost surely: never greedy, rarely sampled.
        target.lm_head.weight[num_tokens:] = 0.0
        shared = {k: v[:draft_vocab] if k in ("model.embed_tokens.weight", "lm_head.weight") else v
                  for k, v in target.state_dict().items()
                  if not k.startswith("model.layers.") or k.startswith("model.layers.0.")}
        draft.load_state_dict(shared, strict=True)
        for pname, param in sorted(draft.named_parameters()):
            if pname.startswith("model.layers.0.") and not pname.endswith("norm.weight"):
                param.add_(torch.randn(param.shape, generator=gen) * layer_std * _DRAFT_NOISE)
    draft, target = draft.to(dtype), target.to(dtype)
    return finish_pair(TINY_PAIR, draft, target, tiny_tokenizer(), dtype, None, ("tiny-random draft", "tiny-random target"))


def save_tiny_pair(directory: str | os.PathLike[str], seed: int = 0, head_dim: int = 64,
                   draft_vocab: int = TINY_VOCAB) -> tuple[Path, Path]:
    """Write the tiny random pair as two HF model directories (``draft/``, ``target/``, each with the
    tokenizer) for engines that load from disk (vLLM); returns (draft_dir, target_dir). Idempotent."""
    root = Path(directory)
    pair = tiny_random_pair(torch.float32, seed=seed, head_dim=head_dim, draft_vocab=draft_vocab)
    dirs = (root / "draft", root / "target")
    for path, model in zip(dirs, (pair.draft, pair.target), strict=True):
        model.save_pretrained(path)
        pair.tokenizer.save_pretrained(path)
    return dirs
