"""int8 linears for the fast CPU path (``--dtype int8``, and the target of ``int4+int8``): int8 weights per output
channel, fbgemm's dynamic int8 GEMM, per-token activation scaling. The 4-bit linears: :mod:`workers.models.q4`;
the decoder that uses both: :mod:`workers.models.fast`."""

from __future__ import annotations

import threading
import warnings

import torch
from torch import Tensor

_REDUCE_RANGE = True  # 7-bit activations: no int16 saturation in AVX2's vpmaddubsw (fbgemm's own default)
_SPAN = torch.tensor([[-1.0, 1.0]])
_SCRATCH_ROWS = 64  # inputs of up to this many rows are scaled into a reused buffer (steps, verify passes)
_scratch = threading.local()  # per thread: {in_features: [rows, in_features + 2] buffer, its last 2 columns -1, +1}


def _span_buffer(n: int, width: int) -> Tensor:
    """Rows [n, width + 2] of a reused buffer whose last two columns hold -1 and +1 (the quantization span)."""
    buffers = getattr(_scratch, "buffers", None)
    if buffers is None:
        buffers = _scratch.buffers = {}
    buf = buffers.get(width)
    if buf is None:
        with torch.inference_mode(False):  # a normal tensor: written in and out of inference mode alike
            buf = buffers[width] = torch.empty(_SCRATCH_ROWS, width + 2)
            buf[:, width:] = _SPAN
    return buf[:n]


class QLinear(torch.nn.Module):
    """y = x W^T (+ b) with W int8 per output channel and x quantized per call (fbgemm dynamic int8)."""

    def __init__(self, qweight: Tensor, scale: Tensor, bias: Tensor | None = None) -> None:
        """``qweight`` [out, in] int8 and ``scale`` [out] (the weight is ``qweight * scale[:, None]``)."""
        super().__init__()
        self.out_features, self.in_features = int(qweight.shape[0]), int(qweight.shape[1])
        padded = torch.cat((qweight, qweight.new_zeros(qweight.shape[0], 2)), dim=1)  # the span columns (forward)
        scale = scale.double()
        with warnings.catch_warnings():  # quantized tensor creation is deprecated upstream; torch is pinned (2.13)
            warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
            quantized = torch._make_per_channel_quantized_tensor(padded, scale, torch.zeros_like(scale, dtype=torch.long),
                                                                 0)
        # No bias in the packed GEMM: rows are scaled before it and back after it (see forward), the bias added after.
        self._packed = torch.ops.quantized.linear_prepack(quantized, None)
        self._bias = None if bias is None else bias.detach().float()

    @classmethod
    def quantized(cls, weight: Tensor, bias: Tensor | None = None) -> QLinear:
        """From a float weight [out, in]: symmetric int8, one scale per output channel (its largest |w| / 127)."""
        weight = weight.detach().float()
        scale = (weight.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
        qweight = (weight / scale[:, None]).round_().clamp_(-127, 127).to(torch.int8)
        return cls(qweight, scale, bias)

    def state(self) -> dict[str, Tensor]:
        """The int8 weight [out, in], its scales [out] and the bias, as stored on disk (:func:`save`)."""
        qweight, _ = torch.ops.quantized.linear_unpack(self._packed)
        out = {"q": qweight.int_repr()[:, :self.in_features].contiguous(),
               "scale": qweight.q_per_channel_scales().float()}
        if self._bias is not None:
            out["bias"] = self._bias
        return out

    @classmethod
    def from_state(cls, tensors: dict[str, Tensor], prefix: str) -> QLinear:
        return cls(tensors[f"{prefix}.q"], tensors[f"{prefix}.scale"], tensors.get(f"{prefix}.bias"))

    def select(self, ids: Tensor) -> QLinear:
        """The rows ``ids`` of this layer (a proposal head), the same numbers."""
        state = self.state()
        bias = state.get("bias")
        return QLinear(state["q"].index_select(0, ids).contiguous(), state["scale"].index_select(0, ids).contiguous(),
                       None if bias is None else bias.index_select(0, ids))

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        if x.dtype != torch.float32:
            x = x.float()
        n = x.shape[0]
        # fbgemm quantizes its whole input with one (scale, zero point) from the input's min and max. Each row is
        # divided by its own largest |value| and two columns holding -1 and +1 (zero weights) are appended, so
        # every input spans exactly [-1, 1]: the quantization grid is every row's own (per-token quantization: a
        # row with a massive activation, the first token's attention sink, does not flatten the others) and the
        # same whatever rows stand beside it. The GEMM accumulates integers, so a row's result is bit-identical
        # in a verify pass, a prefill and a one-token step. A step's few rows are divided straight into a reused
        # buffer that holds the span columns already (the same values as the concatenation, fewer ops).
        rows = torch.linalg.vector_norm(x, float("inf"), dim=1, keepdim=True).clamp_min_(1e-30)
        if n <= _SCRATCH_ROWS:
            scaled = _span_buffer(n, self.in_features)
            torch.div(x, rows, out=scaled[:, :self.in_features])
        else:
            scaled = torch.cat((x / rows, _SPAN.expand(n, 2)), dim=1)
        out = torch.ops.quantized.linear_dynamic(scaled, self._packed, _REDUCE_RANGE).mul_(rows)
        if self._bias is not None:
            out.add_(self._bias)
        return out.view(*shape[:-1], self.out_features)

    @property
    def weight(self) -> Tensor:
        """The dequantized weight [out, in] in fp32 (what a rule that reads the LM head, DropMatch, uses)."""
        qweight, _ = torch.ops.quantized.linear_unpack(self._packed)
        return qweight.dequantize()[:, :self.in_features]

    @property
    def bias(self) -> Tensor | None:
        return self._bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"
