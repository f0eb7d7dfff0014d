"""The fast CPU path: a lean decoder with int8 linear layers for Llama/Qwen2-family causal LMs.

Speculative decoding pays only where a verify pass over L + 1 positions costs about one target step and a
draft step a fraction of one. Hugging Face's eager CPU path breaks both on our 2-core VMs: fp32 weights make
every step bound by reading 4 bytes a weight (an AVX2-only VM: a 6-token verify = 3.15 steps), and the
draft's step is mostly per-op dispatch over its modules. This module rebuilds the same network from a loaded
Hugging Face model as a short list of tensor ops per layer:

- every linear (q/k/v fused into one, gate/up fused into one, o, down, the LM head) holds int8 weights with
  one scale per output channel and quantizes its input per call (fbgemm's dynamic int8 GEMM, which uses
  VNNI on avx512 CPUs and AVX2 elsewhere): a quarter of fp32's weight bytes, and a 6-row GEMM costs about
  what a 1-row one does;
- norms, rotary embeddings and attention run in fp32 on the few rows a step has; the KV cache is one
  preallocated tensor per layer that grows by doubling, and cropping it is moving its length back;
- the layers run as one TorchScript function with these very ops (:mod:`workers.models.fast_step`: bit-identical,
  without Python's per-op overhead), eagerly where ``SPECTUNE_SCRIPTED_STEP=0`` or ``_Decoder.scripted`` is False.

Numerics differ from the fp32 model (activation quantization); that difference is measured against fp32,
never assumed (``jobs.bench.quality``). What it exposes is what the CPU engine, replay and calibration use of
a transformers model: ``get_decoder()`` (called with ``input_ids``/``past_key_values``), ``get_output_embeddings()``,
``get_input_embeddings()``, ``config``, ``generation_config`` and :meth:`Int8CausalLM.new_cache`. It knows
nothing about decoding, rules or Ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from workers.models.fast_step import attend
from workers.models.q4 import Q4_CLIPS, Q4_GROUPS, Q4Linear, _int4_ready, _q4_widths  # noqa: F401 - fast.* names
from workers.models.q8 import _REDUCE_RANGE, _SCRATCH_ROWS, _SPAN, QLinear, _span_buffer  # noqa: F401 - fast.* names

SUPPORTED = ("llama", "qwen2")  # model_type values whose layer this module reproduces
ALPHA = 0.5  # SmoothQuant's migration strength


def supported(model: Any) -> str | None:
    """None when ``model`` can run on this path, else why not (one line naming the field)."""
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in SUPPORTED:
        return f"model_type {kind!r} is not one of {', '.join(SUPPORTED)}"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if (rope.get("rope_type") or rope.get("type") or "default") != "default":
        return f"rope type {rope.get('rope_type') or rope.get('type')!r} (only the default rotary embedding)"
    if getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None):
        return "a sliding attention window"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r} (only silu)"
    if getattr(config, "mlp_bias", False):
        return "an MLP bias"
    return None


def linear_from_state(tensors: dict[str, Tensor], prefix: str) -> QLinear | Q4Linear:
    """A stored linear of either kind (4-bit ones keep ``.q4``)."""
    return Q4Linear.from_state(tensors, prefix) if f"{prefix}.q4" in tensors else QLinear.from_state(tensors, prefix)


class KVCache:
    """Keys and values of every layer in preallocated tensors [kv_heads, capacity, head_dim]; ``length`` positions
    are valid. Grows by doubling; cropping moves the length back (what the engine's caches need of
    ``transformers.DynamicCache``: ``get_seq_length`` and ``crop``)."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, capacity: int = 1024) -> None:
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim
        self.capacity = capacity
        self.keys = [torch.empty(kv_heads, capacity, head_dim) for _ in range(layers)]
        self.values = [torch.empty(kv_heads, capacity, head_dim) for _ in range(layers)]
        self.length = 0

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, count: int) -> None:
        """Keep ``count`` positions (``count`` < 0: drop that many from the end), as ``DynamicCache.crop``."""
        keep = self.length + count if count < 0 else count
        self.length = max(0, min(self.length, keep))

    def copy_prefix(self, other: KVCache, length: int) -> None:
        """Hold ``other``'s first ``length`` positions (a prefix both share): a copy of the same numbers."""
        if (other.layers, other.kv_heads, other.head_dim) != (self.layers, self.kv_heads, self.head_dim):
            raise ValueError("copy_prefix: the caches are of different models")
        if length > other.length:
            raise ValueError(f"copy_prefix: the other cache holds {other.length} positions, not {length}")
        self.reserve(length)
        for mine, theirs in ((self.keys, other.keys), (self.values, other.values)):
            for a, b in zip(mine, theirs, strict=True):
                a[:, :length] = b[:, :length]
        self.length = length

    def reserve(self, length: int) -> None:
        if length <= self.capacity:
            return
        capacity = max(length, 2 * self.capacity)
        for store in (self.keys, self.values):
            for i, old in enumerate(store):
                new = torch.empty(self.kv_heads, capacity, self.head_dim)
                new[:, :self.length] = old[:, :self.length]
                store[i] = new
        self.capacity = capacity


@dataclass
class _Out:
    last_hidden_state: Tensor  # [B, n, d]
    past_key_values: KVCache


class _Layer(torch.nn.Module):
    NAMES = ("qkv", "o", "gate_up", "down")

    def __init__(self, config: Any, linears: dict[str, QLinear | Q4Linear], norm1: Tensor, norm2: Tensor) -> None:
        super().__init__()
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.heads)
        self.eps = float(config.rms_norm_eps)
        self.qkv, self.o, self.gate_up, self.down = (linears[n] for n in self.NAMES)
        self.intermediate = self.gate_up.out_features // 2
        self.norm1, self.norm2 = norm1, norm2

    @classmethod
    def from_hf(cls, layer: Any, config: Any, absmax: dict[str, Tensor] | None, alpha: float) -> _Layer:
        """``absmax`` None: 4-bit weights, bf16 activations (:class:`Q4Linear`), nothing to smooth; else int8
        smoothed with SmoothQuant at ``alpha``."""
        attn, mlp = layer.self_attn, layer.mlp
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        q_w, k_w, v_w = (p.weight.detach().float() for p in (attn.q_proj, attn.k_proj, attn.v_proj))
        biases = [None if p.bias is None else p.bias.detach().float() for p in (attn.q_proj, attn.k_proj, attn.v_proj)]
        gate_w, up_w = mlp.gate_proj.weight.detach().float(), mlp.up_proj.weight.detach().float()
        o_w, down_w = attn.o_proj.weight.detach().float(), mlp.down_proj.weight.detach().float()
        norm1 = layer.input_layernorm.weight.detach().float().clone()
        norm2 = layer.post_attention_layernorm.weight.detach().float().clone()
        if absmax is None:
            bias = None if all(b is None for b in biases) else torch.cat([
                b if b is not None else torch.zeros(w.shape[0]) for b, w in zip(biases, (q_w, k_w, v_w), strict=True)])
            return cls(config, {"qkv": Q4Linear.quantized(torch.cat([q_w, k_w, v_w]), bias),
                                "o": Q4Linear.quantized(o_w, attn.o_proj.bias),
                                "gate_up": Q4Linear.quantized(torch.cat([gate_w, up_w])),
                                "down": Q4Linear.quantized(down_w)}, norm1, norm2)
        # SmoothQuant: divide each input channel of a linear by s (folded, exactly, into the op that makes that
        # input) and multiply the weight's column by s, so activation outliers move into the weights.
        s_qkv = _smoothing(absmax["qkv"], torch.cat([q_w, k_w, v_w]), alpha)
        norm1 /= s_qkv
        q_w, k_w, v_w = q_w * s_qkv, k_w * s_qkv, v_w * s_qkv
        s_mlp = _smoothing(absmax["gate_up"], torch.cat([gate_w, up_w]), alpha)
        norm2 /= s_mlp
        gate_w, up_w = gate_w * s_mlp, up_w * s_mlp
        group = heads // kv_heads  # o's input channel (head h, dim j) reads v's row (h // group, j)
        s_o = _smoothing(absmax["o"], o_w, alpha).view(kv_heads, group, head_dim).amax(1)  # [Hkv, D]
        o_w = o_w * s_o.unsqueeze(1).expand(kv_heads, group, head_dim).reshape(-1)
        v_w = v_w / s_o.reshape(-1, 1)
        if biases[2] is not None:
            biases[2] = biases[2] / s_o.reshape(-1)
        s_down = _smoothing(absmax["down"], down_w, alpha)
        up_w, down_w = up_w / s_down.unsqueeze(1), down_w * s_down
        bias = None if all(b is None for b in biases) else torch.cat([
            b if b is not None else torch.zeros(w.shape[0]) for b, w in zip(biases, (q_w, k_w, v_w), strict=True)])
        linears = {"qkv": QLinear.quantized(torch.cat([q_w, k_w, v_w]), bias),
                   "o": QLinear.quantized(o_w, attn.o_proj.bias),
                   "gate_up": QLinear.quantized(torch.cat([gate_w, up_w])),
                   "down": QLinear.quantized(down_w)}
        return cls(config, linears, norm1, norm2)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, keys: Tensor, values: Tensor, start: int) -> Tensor:
        """x [n, d], one sequence; ``sin`` is signed for :func:`_rotate`. Calls the linears' ``forward`` directly:
        a module's ``__call__`` costs microseconds a step has hundreds of."""
        n = x.shape[0]
        h = F.rms_norm(x, (x.shape[-1],), self.norm1, self.eps)
        qkv = self.qkv.forward(h)
        q_end, k_end = self.heads * self.head_dim, (self.heads + self.kv_heads) * self.head_dim
        qk = _rotate(qkv[:, :k_end].view(n, self.heads + self.kv_heads, self.head_dim).transpose(0, 1), cos, sin)
        q = qk[:self.heads]  # [H, n, D]
        keys[:, start:start + n] = qk[self.heads:]
        values[:, start:start + n] = qkv[:, k_end:].view(n, self.kv_heads, self.head_dim).transpose(0, 1)
        attn = attend(q, keys, values, start, self.kv_heads)  # one query row per call: row exactness
        x = self.o.forward(attn.transpose(0, 1).reshape(n, q_end)).add_(x)
        h = F.rms_norm(x, (x.shape[-1],), self.norm2, self.eps)
        gate_up = self.gate_up.forward(h)
        act = F.silu(gate_up[:, :self.intermediate]).mul_(gate_up[:, self.intermediate:])
        return self.down.forward(act).add_(x)


def _smoothing(absmax: Tensor, weight: Tensor, alpha: float) -> Tensor:
    """SmoothQuant's per-input-channel factor s = max|x|^alpha / max|w|^(1 - alpha), 1 where either is zero."""
    w_max = weight.abs().amax(dim=0)
    s = absmax.float().clamp_min(1e-5) ** alpha / w_max.clamp_min(1e-5) ** (1.0 - alpha)
    return torch.where((absmax > 0) & (w_max > 0), s, torch.ones_like(s)).clamp(1e-3, 1e3)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding in Hugging Face's half-split layout, x cos + rotate_half(x) sin with rotate_half(x) =
    (-x2, x1): here x cos + roll(x) (-sin1, sin2), the same products and sums (``sin`` comes signed). x [H, n, D]."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, -1) * sin


class _Decoder(torch.nn.Module):
    def __init__(self, config: Any, embed: Tensor, layers: list[_Layer], norm: Tensor) -> None:
        super().__init__()
        self.embed = embed
        self.layers = torch.nn.ModuleList(layers)
        self.norm = norm
        self.eps = float(config.rms_norm_eps)
        first = self.layers[0]
        self.head_dim, self.kv_heads = first.head_dim, first.kv_heads
        rope = getattr(config, "rope_parameters", None) or {}
        theta = float(rope.get("rope_theta") or getattr(config, "rope_theta", 10000.0))
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim))
        self._cos = self._sin = torch.empty(0, self.head_dim)
        self._scripted: Any = None  # the layers as one scripted graph (workers.models.fast_step), built at first use
        self.scripted = True  # False: the layers run eagerly (an A/B; the outputs are the same)
        self._gathered: Any = None  # the layers' weights gathered for several sequences at once (forward_ragged)

    def new_cache(self) -> KVCache:
        return KVCache(len(self.layers), self.kv_heads, self.head_dim)

    def uses_scripted(self) -> bool:
        """Whether the next pass runs the scripted layers: ``scripted`` and ``SPECTUNE_SCRIPTED_STEP`` (read each
        pass) allow it and every linear is of one kind (:class:`workers.models.fast_step.ScriptedLayers`)."""
        from workers.models.fast_step import enabled

        return self.scripted and enabled() and self._scripted is not False

    def __getstate__(self) -> dict[str, Any]:
        """A scripted function cannot be pickled or deep-copied: a copy scripts its layers again at first use."""
        state = dict(self.__dict__)
        state["_scripted"] = None
        state["_gathered"] = None
        return state

    def _rope(self, start: int, n: int) -> tuple[Tensor, Tensor]:
        if start + n > self._cos.shape[0]:
            size = max(start + n, 2 * self._cos.shape[0], 1024)
            freqs = torch.outer(torch.arange(size, dtype=torch.float64), self.inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
            half = self.head_dim // 2
            sign = torch.cat((-torch.ones(half, dtype=torch.float64), torch.ones(half, dtype=torch.float64)))
            self._cos, self._sin = emb.cos().float(), (emb.sin() * sign).float()  # sin signed for _rotate
        return self._cos[start:start + n], self._sin[start:start + n]

    def forward(self, input_ids: Tensor, past_key_values: KVCache | None = None, use_cache: bool = True,
                **_: Any) -> _Out:
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"the int8 CPU path decodes one sequence at a time: input_ids [1, n], got "
                             f"{tuple(input_ids.shape)}")
        cache = past_key_values if past_key_values is not None else self.new_cache()
        if not isinstance(cache, KVCache):
            raise TypeError(f"the int8 CPU path keeps its own KV cache (model.new_cache()), got {type(cache).__name__}")
        ids = input_ids[0]
        n, start = int(ids.shape[0]), cache.length
        cache.reserve(start + n)
        cos, sin = self._rope(start, n)
        x = self.embed[ids]
        if self.uses_scripted() and self._scripted is None:
            from workers.models.fast_step import ScriptedLayers

            self._scripted = ScriptedLayers.for_layers(list(self.layers)) or False
        if self.uses_scripted() and self._scripted:
            x = self._scripted(x, cos, sin, cache.keys, cache.values, start)
        else:
            for i, layer in enumerate(self.layers):
                x = layer.forward(x, cos, sin, cache.keys[i], cache.values[i], start)
        cache.length = start + n
        x = F.rms_norm(x, (x.shape[-1],), self.norm, self.eps)
        return _Out(last_hidden_state=x.unsqueeze(0), past_key_values=cache)


    def ragged_ready(self) -> bool:
        """Whether :meth:`forward_ragged` runs several sequences in one pass here: every linear of one kind (all
        int8 or all 4-bit: the layers :class:`workers.models.fast_step.ScriptedLayers` gathers). Otherwise the
        batched engine runs each sequence's pass alone (exact, without the shared weight reads)."""
        if self._gathered is None:
            from workers.models.fast_step import _NAMES, ScriptedLayers, _four_bits

            kinds = _four_bits([getattr(layer, name, None) for layer in self.layers for name in _NAMES])
            self._gathered = False if kinds is None else ScriptedLayers(list(self.layers))
        return self._gathered is not False

    def forward_ragged(self, feeds: list[tuple[Tensor, KVCache]]) -> list[Tensor]:
        """Several sequences' passes as one: ``feeds`` holds each sequence's new ids [n_s] and its own cache;
        returns each one's final hidden states [1, n_s, d] (post final norm), as :meth:`forward` would, bit for
        bit: the linears and norms run once over all rows (one read of each weight for the whole batch),
        attention per sequence over its own cache (:func:`workers.models.fast_step._layers_ragged`)."""
        if not feeds:
            return []
        if not self.ragged_ready():
            raise TypeError("forward_ragged needs layers whose linears are all int8 or all 4-bit")
        counts = [int(ids.shape[0]) for ids, _ in feeds]
        starts = [cache.length for _, cache in feeds]
        if len({id(cache) for _, cache in feeds}) != len(feeds):
            raise ValueError("forward_ragged: each sequence needs its own KV cache")
        for (_, cache), start, n in zip(feeds, starts, counts, strict=True):
            cache.reserve(start + n)
        self._rope(0, max(s + n for s, n in zip(starts, counts, strict=True)))
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, counts, strict=True)])
        cos, sin = self._cos.index_select(0, positions), self._sin.index_select(0, positions)
        x = self.embed[torch.cat([ids for ids, _ in feeds])]
        from workers.models.fast_step import enabled

        x = self._gathered.ragged(x, cos, sin, [c.keys for _, c in feeds], [c.values for _, c in feeds], starts,
                                  counts, scripted=self.scripted and enabled())
        for (_, cache), start, n in zip(feeds, starts, counts, strict=True):
            cache.length = start + n
        x = F.rms_norm(x, (x.shape[-1],), self.norm, self.eps)
        return [part.unsqueeze(0) for part in x.split(counts)]


class Int8CausalLM(torch.nn.Module):
    """A Llama/Qwen2-family causal LM rebuilt on int8 linears (see the module docstring)."""

    def __init__(self, config: Any, generation_config: Any, decoder: _Decoder, lm_head: QLinear | Q4Linear) -> None:
        super().__init__()
        self.config = config
        self.generation_config = generation_config
        self.decoder = decoder
        self.lm_head = lm_head
        self._embedding = torch.nn.Embedding.from_pretrained(decoder.embed, freeze=True)

    @classmethod
    def from_hf(cls, model: Any, calibration: Tensor, alpha: float = ALPHA, consume: bool = False,
                bits: int = 8) -> Int8CausalLM:
        """``model`` rebuilt; ``consume``: free each of its layers' weights once rebuilt (a model loaded only to be
        converted: the peak stays near one float copy of it). ``bits`` 4: every linear, the LM head included, in
        4-bit weights (:class:`Q4Linear`; ``calibration`` and ``alpha`` unused)."""
        why = supported(model)
        if why is None and bits == 4:
            why = _int4_ready() or _q4_widths(model.config)
        if why is not None:
            name = "int8 (the fast CPU path)" if bits == 8 else "int4+int8 (the fast CPU path's 4-bit draft)"
            raise ValueError(f"dtype {name} cannot run this model: {why}; use bf16 or fp32")
        if bits not in (4, 8):
            raise ValueError(f"the fast CPU path has 8- and 4-bit weights, not {bits}")
        config = model.config
        absmax = activation_absmax(model, calibration) if bits == 8 else [None] * len(model.get_decoder().layers)
        inner = model.get_decoder()
        layers = []
        for i, layer in enumerate(inner.layers):
            layers.append(_Layer.from_hf(layer, config, absmax[i], alpha))
            if consume:
                for param in layer.parameters():
                    param.data = param.data.new_empty(0)
        decoder = _Decoder(config, inner.embed_tokens.weight.detach().float().clone(), layers,
                           inner.norm.weight.detach().float().clone())
        head = model.get_output_embeddings()
        linear = Q4Linear if bits == 4 else QLinear
        return cls(config, getattr(model, "generation_config", None), decoder,
                   linear.quantized(head.weight, getattr(head, "bias", None)))

    def get_decoder(self) -> _Decoder:
        return self.decoder

    def get_output_embeddings(self) -> QLinear | Q4Linear:
        return self.lm_head

    def get_input_embeddings(self) -> torch.nn.Embedding:
        return self._embedding

    def new_cache(self) -> KVCache:
        return self.decoder.new_cache()

    def forward(self, input_ids: Tensor, **_: Any) -> Any:
        """Logits over every position of ``input_ids`` [1, n] from an empty cache (``.logits`` [1, n, V])."""
        hidden = self.decoder(input_ids).last_hidden_state
        return _Logits(self.lm_head(hidden), hidden)


@dataclass
class _Logits:
    logits: Tensor
    last_hidden_state: Tensor


CALIBRATION_TEXT = (
    "You are a careful assistant. Answer the question step by step, then give the final answer.\n\n"
    "A bakery sells muffins for $3 each and cookies for $1.50 each. On Monday it sold 40 muffins and twice as "
    "many cookies. On Tuesday it sold 25 muffins and 60 cookies. How much money did the bakery make over the "
    "two days? On Monday: 40 * 3 = 120 dollars from muffins and 80 * 1.5 = 120 dollars from cookies, so 240. "
    "On Tuesday: 25 * 3 = 75 and 60 * 1.5 = 90, so 165. Altogether 240 + 165 = 405. The answer is 405.\n\n"
    "def merge_intervals(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:\n"
    "    \"\"\"Merge overlapping closed intervals and return them sorted.\"\"\"\n"
    "    merged = []\n    for start, end in sorted(intervals):\n"
    "        if merged and start <= merged[-1][1]:\n            merged[-1] = (merged[-1][0], max(merged[-1][1], end))\n"
    "        else:\n            merged.append((start, end))\n    return merged\n\n"
    "The river rose through the night, and by morning the village had moved its boats to higher ground. "
    "Nobody could remember a spring like it: the snow had melted all at once, the fields were lakes, and the "
    "old bridge, which had stood for two hundred years, groaned under the weight of the water. Write a short "
    "summary of this passage in one sentence, then list three questions a reader might ask about it.\n"
)


def calibration_ids(tokenizer: Any, limit: int = 512) -> Tensor:
    """The fixed calibration sequence [1, n]: ``CALIBRATION_TEXT`` as a chat turn (plain text for a tokenizer
    without a chat template), so activation maxima come from prose, arithmetic and code, from no benchmark's
    items, and are the same on every machine."""
    messages = [{"role": "user", "content": CALIBRATION_TEXT}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except (ValueError, AttributeError, TypeError):
        text = CALIBRATION_TEXT
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:limit]
    return torch.tensor([ids], dtype=torch.long)


def activation_absmax(model: Any, calibration: Tensor) -> list[dict[str, Tensor]]:
    """Per layer, the largest |input| each input channel of its linears reaches over ``calibration`` ids [1, n]
    (one fp32 forward of ``model`` with hooks): ``qkv``, ``o``, ``gate_up``, ``down``."""
    found: list[dict[str, Tensor]] = [{} for _ in model.get_decoder().layers]
    hooks = []

    def keep(i: int, name: str):
        def hook(_module: Any, args: tuple[Tensor, ...]) -> None:
            x = args[0].detach().float().reshape(-1, args[0].shape[-1]).abs().amax(dim=0)
            found[i][name] = torch.maximum(found[i][name], x) if name in found[i] else x
        return hook

    for i, layer in enumerate(model.get_decoder().layers):
        for name, module in (("qkv", layer.self_attn.q_proj), ("o", layer.self_attn.o_proj),
                             ("gate_up", layer.mlp.gate_proj), ("down", layer.mlp.down_proj)):
            hooks.append(module.register_forward_pre_hook(keep(i, name)))
    try:
        model(input_ids=calibration)
    finally:
        for h in hooks:
            h.remove()
    return found


def quantize(model: Any, calibration: Tensor, alpha: float = ALPHA, consume: bool = False,
             bits: int = 8) -> Int8CausalLM:
    """``model`` (a transformers causal LM, any float dtype) on the fast path: int8, smoothed with activation maxima
    over ``calibration`` ids [1, n], or (``bits`` 4) 4-bit weights with bf16 activations; ValueError naming what it
    lacks. ``consume``: see ``Int8CausalLM.from_hf``."""
    with torch.inference_mode(False), torch.no_grad():
        fast = Int8CausalLM.from_hf(model, calibration, alpha, consume, bits)
    fast.eval()
    fast.requires_grad_(False)
    return fast


def new_cache(model: Any) -> Any:
    """An empty KV cache for ``model``: its own (this path) or a ``transformers.DynamicCache``."""
    if hasattr(model, "new_cache"):
        return model.new_cache()
    from transformers import DynamicCache

    return DynamicCache()


def head_width(model: Any) -> int:
    """How many ids ``model``'s LM head scores."""
    head = model.get_output_embeddings()
    width = getattr(head, "out_features", None)
    return int(width) if width is not None else int(head.weight.shape[0])
