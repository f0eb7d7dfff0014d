"""The fast path's layers as one TorchScript graph: the same ATen ops in the same order as
:meth:`workers.models.fast._Layer.forward` (and the linears' ``forward``) over every layer, run by TorchScript's
interpreter instead of Python.

A one-token step of the 0.5B draft is some 600 small ops around its GEMMs, and each op called from Python pays
for argument parsing and dispatch: about 6 ms of the 4-bit draft's ~17 ms step on a 2-core EPYC, which is most of
what keeps the cost ratio c above 0.3 there. Run as one scripted graph the same ops skip Python's part; nothing
is fused or reordered (the graph executor's optimizations are off while it runs: no profiling, no specialisation,
no fusion), so every output is bit-identical to the eager layers (``tests/workers/models/test_fast_step.py``) and
row exactness, replay and the stored references are untouched. Passes of several rows (prefill, verify, a
draft's catch-up over accepted tokens) run the same graph: the same per-row attention calls as eager
(:func:`attend`).

Built for a decoder whose linears are all 4-bit (:class:`workers.models.q4.Q4Linear`, the draft of ``--dtype
int4+int8``) or all int8 (:class:`workers.models.q8.QLinear`). ``torch.jit.script`` is deprecated upstream in
favour of ``torch.compile``, which generates its own kernels and so changes numerics; torch is pinned (2.13),
where scripting works. ``SPECTUNE_SCRIPTED_STEP=0`` turns it off (the eager layers, for an A/B: ``python -m
jobs.bench.draft_cost`` times both in one run).
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import Any

import torch
from torch import Tensor

ENV = "SPECTUNE_SCRIPTED_STEP"
_NAMES = ("qkv", "o", "gate_up", "down")  # a layer's linears, in the lists' order: linear 4 i + k is layer i's k-th


def enabled() -> bool:
    """Whether decoders use the scripted layers (``SPECTUNE_SCRIPTED_STEP``: 1 by default, 0 turns it off)."""
    value = os.environ.get(ENV, "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{ENV} must be 0 or 1, got {value!r}")
    return value == "1"


def _linear(x: Tensor, j: int, four: bool, packed4: list[Tensor], groups: list[int], scales_zeros: list[Tensor],
            packed8: list[torch.classes.quantized.LinearPackedParamsBase], spans: list[Tensor], span_of: list[int],
            reduce_range: bool, outs: list[int], biases: list[Tensor | None]) -> Tensor:
    """Linear ``j`` on rows ``x`` [n, in]: :meth:`Q4Linear.forward` where ``four``, else :meth:`QLinear.forward`
    (``spans[span_of[j]]``: the calling thread's scratch rows for its input width, the last two columns -1 and +1)."""
    if four:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16).contiguous(), packed4[j], groups[j],
                                                         scales_zeros[j])
        out = out[:, :outs[j]].float()
    else:
        n = x.shape[0]
        width = x.shape[1]
        span = spans[span_of[j]]
        rows = torch.linalg.vector_norm(x, float("inf"), [1], True).clamp_min_(1e-30)
        if n <= span.shape[0]:
            scaled = span[:n]
            torch.div(x, rows, out=scaled[:, :width])
        else:
            scaled = torch.cat((x / rows, span[:1, width:].expand(n, 2)), dim=1)
        out = torch.ops.quantized.linear_dynamic(scaled, packed8[j], reduce_range).mul_(rows)
    bias = biases[j]
    if bias is not None:
        out.add_(bias)
    return out


def attend(q: Tensor, keys: Tensor, values: Tensor, start: int, kv_heads: int) -> Tensor:
    """Attention of query rows ``q`` [H, n, D] at positions ``start``.. over a layer's cache ``keys`` / ``values``
    [Hkv, capacity, D] (the n positions written): [H, n, D].

    One call per query row, over exactly the keys that row sees: the call a one-token step makes, so a row's
    attention is bit-identical in a verify pass, a prefill and a step (a multi-row call reduces in another order,
    and a float difference that flips one int8 level downstream grows into a different logit). Each row's H heads
    go in as their key head's group, [Hkv, H / Hkv, D] against [Hkv, length, D]: grouped-query attention without
    expanding the keys to H heads (``enable_gqa`` did, a copy of both per row and layer: 1.4-2.4x the call's time
    at 128-600 positions). Eager (:meth:`workers.models.fast._Layer.forward`) and scripted layers both call this."""
    heads = q.shape[0]
    n = q.shape[1]
    dim = q.shape[2]
    group = heads // kv_heads
    rows: list[Tensor] = []
    for r in range(n):
        row = q[:, r].contiguous().view(1, kv_heads, group, dim)
        out = torch.nn.functional.scaled_dot_product_attention(row, keys[:, :start + r + 1].unsqueeze(0),
                                                               values[:, :start + r + 1].unsqueeze(0))
        rows.append(out.view(heads, 1, dim))
    return rows[0] if n == 1 else torch.cat(rows, dim=1)


def _layers(x: Tensor, cos: Tensor, sin: Tensor, keys: list[Tensor], values: list[Tensor], start: int,
            norms1: list[Tensor], norms2: list[Tensor], eps: float, four: bool, packed4: list[Tensor],
            groups: list[int], scales_zeros: list[Tensor], packed8: list[torch.classes.quantized.LinearPackedParamsBase],
            spans: list[Tensor], span_of: list[int], reduce_range: bool, outs: list[int], biases: list[Tensor | None],
            heads: int, kv_heads: int, head_dim: int, intermediate: int) -> Tensor:
    """Every layer's :meth:`_Layer.forward` for rows ``x`` [n, d] at positions ``start``.. (``sin`` signed, as
    there). Writes the keys and values of the n positions."""
    n = x.shape[0]
    d = x.shape[-1]
    q_end = heads * head_dim
    k_end = (heads + kv_heads) * head_dim
    for i in range(len(norms1)):
        j = 4 * i
        h = torch.rms_norm(x, [d], norms1[i], eps)
        qkv = _linear(h, j, four, packed4, groups, scales_zeros, packed8, spans, span_of, reduce_range, outs, biases)
        rot = qkv[:, :k_end].view(n, heads + kv_heads, head_dim).transpose(0, 1)
        qk = rot * cos + torch.roll(rot, head_dim // 2, -1) * sin
        q = qk[:heads]
        keys[i][:, start:start + n] = qk[heads:]
        values[i][:, start:start + n] = qkv[:, k_end:].view(n, kv_heads, head_dim).transpose(0, 1)
        attn = attend(q, keys[i], values[i], start, kv_heads)  # one query row per call (row exactness)
        x = _linear(attn.transpose(0, 1).reshape(n, q_end), j + 1, four, packed4, groups, scales_zeros, packed8,
                    spans, span_of, reduce_range, outs, biases).add_(x)
        h = torch.rms_norm(x, [d], norms2[i], eps)
        gate_up = _linear(h, j + 2, four, packed4, groups, scales_zeros, packed8, spans, span_of, reduce_range, outs,
                          biases)
        act = torch.nn.functional.silu(gate_up[:, :intermediate]).mul_(gate_up[:, intermediate:])
        x = _linear(act, j + 3, four, packed4, groups, scales_zeros, packed8, spans, span_of, reduce_range, outs,
                    biases).add_(x)
    return x


def _layers_ragged(x: Tensor, cos: Tensor, sin: Tensor, keys: list[list[Tensor]], values: list[list[Tensor]],
                   starts: list[int], counts: list[int], norms1: list[Tensor], norms2: list[Tensor], eps: float,
                   four: bool, packed4: list[Tensor], groups: list[int], scales_zeros: list[Tensor],
                   packed8: list[torch.classes.quantized.LinearPackedParamsBase], spans: list[Tensor],
                   span_of: list[int], reduce_range: bool, outs: list[int], biases: list[Tensor | None], heads: int,
                   kv_heads: int, head_dim: int, intermediate: int) -> Tensor:
    """:func:`_layers` for several sequences at once (the batched engine): rows ``x`` [N, d] are sequence s's
    ``counts[s]`` rows at positions ``starts[s]``.. in order, ``cos``/``sin`` [N, D] each row's own, ``keys[s]`` /
    ``values[s]`` sequence s's cache per layer. Every op but attention is row-wise (norms, rotary, the linears,
    whose rows do not depend on the rows beside them), so they run once over all N rows and read each weight once;
    attention runs per sequence over its own cache, one query row per call, as :func:`_layers` does: a row's
    result is bit-identical to the same row decoded alone (``tests/workers/test_cpu_batch.py``)."""
    n = x.shape[0]
    d = x.shape[-1]
    q_end = heads * head_dim
    k_end = (heads + kv_heads) * head_dim
    offsets: list[int] = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    for i in range(len(norms1)):
        j = 4 * i
        h = torch.rms_norm(x, [d], norms1[i], eps)
        qkv = _linear(h, j, four, packed4, groups, scales_zeros, packed8, spans, span_of, reduce_range, outs, biases)
        rot = qkv[:, :k_end].view(n, heads + kv_heads, head_dim).transpose(0, 1)
        qk = rot * cos + torch.roll(rot, head_dim // 2, -1) * sin
        parts: list[Tensor] = []
        for s in range(len(counts)):
            a, b, start = offsets[s], offsets[s + 1], starts[s]
            keys[s][i][:, start:start + b - a] = qk[heads:, a:b]
            values[s][i][:, start:start + b - a] = qkv[a:b, k_end:].view(b - a, kv_heads, head_dim).transpose(0, 1)
            parts.append(attend(qk[:heads, a:b], keys[s][i], values[s][i], start, kv_heads))
        attn = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        x = _linear(attn.transpose(0, 1).reshape(n, q_end), j + 1, four, packed4, groups, scales_zeros, packed8,
                    spans, span_of, reduce_range, outs, biases).add_(x)
        h = torch.rms_norm(x, [d], norms2[i], eps)
        gate_up = _linear(h, j + 2, four, packed4, groups, scales_zeros, packed8, spans, span_of, reduce_range, outs,
                          biases)
        act = torch.nn.functional.silu(gate_up[:, :intermediate]).mul_(gate_up[:, intermediate:])
        x = _linear(act, j + 3, four, packed4, groups, scales_zeros, packed8, spans, span_of, reduce_range, outs,
                    biases).add_(x)
    return x


def _four_bits(linears: list[Any]) -> bool | None:
    """True where every linear is 4-bit, False where every one is int8, None for anything else."""
    from workers.models.q4 import Q4Linear
    from workers.models.q8 import QLinear

    if linears and all(isinstance(lin, Q4Linear) for lin in linears):
        return True
    if linears and all(isinstance(lin, QLinear) for lin in linears):
        return False
    return None


@functools.cache
def _scripted() -> Any:
    with warnings.catch_warnings():  # deprecated upstream (see the module docstring); torch is pinned
        warnings.filterwarnings("ignore", message=".*torch.jit.script.*deprecated.*")
        return torch.jit.script(_layers)


@functools.cache
def _scripted_ragged() -> Any:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.jit.script.*deprecated.*")
        return torch.jit.script(_layers_ragged)


class ScriptedLayers:
    """One decoder's layers as the scripted graph, their weights gathered once (see the module docstring)."""

    def __init__(self, layers: list[Any]) -> None:
        first = layers[0]
        linears = [getattr(layer, name) for layer in layers for name in _NAMES]
        four = _four_bits(linears)
        if four is None:
            raise TypeError("the scripted layers are built for layers whose linears are all 4-bit or all int8")
        self.four = four
        self.eps = float(first.eps)
        self.norms1 = [layer.norm1 for layer in layers]
        self.norms2 = [layer.norm2 for layer in layers]
        self.packed4 = [lin._packed for lin in linears] if self.four else []
        self.groups = [int(lin.group) for lin in linears] if self.four else []
        self.scales_zeros = [lin._scales_zeros for lin in linears] if self.four else []
        self.packed8 = [] if self.four else [lin._packed for lin in linears]
        self.widths = sorted({int(lin.in_features) for lin in linears})
        self.span_of = [self.widths.index(int(lin.in_features)) for lin in linears]
        self.outs = [int(lin.out_features) for lin in linears]
        self.biases = [lin._bias for lin in linears]
        self.shape = (int(first.heads), int(first.kv_heads), int(first.head_dim), int(first.intermediate))
        self._run = _scripted()

    @classmethod
    def for_layers(cls, layers: list[Any]) -> ScriptedLayers | None:
        """The graph for ``layers``, or None where it does not apply (linears neither all 4-bit nor all int8) or is
        turned off."""
        if not enabled() or _four_bits([getattr(layer, name, None) for layer in layers for name in _NAMES]) is None:
            return None
        return cls(layers)

    def __call__(self, x: Tensor, cos: Tensor, sin: Tensor, keys: list[Tensor], values: list[Tensor],
                 start: int) -> Tensor:
        from workers.models.q8 import _REDUCE_RANGE, _SCRATCH_ROWS, _span_buffer

        heads, kv_heads, head_dim, intermediate = self.shape
        spans = [] if self.four else [_span_buffer(_SCRATCH_ROWS, w) for w in self.widths]  # this thread's
        with torch.jit.optimized_execution(False):  # the graph as written: no specialisation, no fusion
            return self._run(x, cos, sin, keys, values, start, self.norms1, self.norms2, self.eps, self.four,
                             self.packed4, self.groups, self.scales_zeros, self.packed8, spans, self.span_of,
                             _REDUCE_RANGE, self.outs, self.biases, heads, kv_heads, head_dim, intermediate)

    def ragged(self, x: Tensor, cos: Tensor, sin: Tensor, keys: list[list[Tensor]], values: list[list[Tensor]],
               starts: list[int], counts: list[int], scripted: bool = True) -> Tensor:
        """Several sequences' rows in one pass (:func:`_layers_ragged`); ``scripted`` False runs the same function
        eagerly (``SPECTUNE_SCRIPTED_STEP=0``: the same ops, bit-identical)."""
        from workers.models.q8 import _REDUCE_RANGE, _SCRATCH_ROWS, _span_buffer

        heads, kv_heads, head_dim, intermediate = self.shape
        spans = [] if self.four else [_span_buffer(_SCRATCH_ROWS, w) for w in self.widths]
        run = _scripted_ragged() if scripted else _layers_ragged
        with torch.jit.optimized_execution(False):
            return run(x, cos, sin, keys, values, starts, counts, self.norms1, self.norms2, self.eps, self.four,
                       self.packed4, self.groups, self.scales_zeros, self.packed8, spans, self.span_of, _REDUCE_RANGE,
                       self.outs, self.biases, heads, kv_heads, head_dim, intermediate)
