"""4-bit weight-only linears for the fast CPU path's draft (``--dtype int4+int8``): torch's int4 CPU GEMM with bf16
activations. The int8 linears and the decoder that uses both: :mod:`workers.models.fast`."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

Q4_GROUPS = (128, 64, 32)  # group sizes torch's int4 CPU GEMM takes, largest first
Q4_CLIPS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)  # shrinkings of a group's range tried when quantizing (least error wins)


def _int4_ready() -> str | None:
    """None where torch's int4 weight-only CPU GEMM runs here, else why not (one line)."""
    op = getattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu", None)
    pack = getattr(torch, "_convert_weight_to_int4pack_for_cpu", None)
    if op is None or pack is None:
        return f"this PyTorch build ({torch.__version__}) has no int4 weight-only CPU GEMM"
    return None


def _q4_widths(config: Any) -> str | None:
    """None where every linear's input width takes a 4-bit group (:data:`Q4_GROUPS`), else which does not."""
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    widths = {"hidden_size": int(config.hidden_size), "intermediate_size": int(config.intermediate_size),
              "num_attention_heads x head_dim": heads * head_dim}
    bad = [f"{k} {v}" for k, v in widths.items() if v % min(Q4_GROUPS)]
    return f"4-bit groups need input widths divisible by {min(Q4_GROUPS)}: {', '.join(bad)}" if bad else None


class Q4Linear(torch.nn.Module):
    """y = x W^T (+ b) with W in 4 bits per group of input channels (asymmetric: w = (q - 8) scale + zero) and x in
    bf16: torch's int4 weight-only CPU GEMM, which unpacks each group to floats inside its tiles. Half of int8's
    weight bytes; what a memory-bound one-token step reads is what it costs (the draft's step on the fast path).
    A row's result does not depend on the rows beside it (the GEMM runs each row's dot products the same way
    whatever the row count, checked in tests), as :class:`QLinear`'s."""

    def __init__(self, nibbles: Tensor, scale: Tensor, zero: Tensor, bias: Tensor | None = None) -> None:
        """``nibbles`` [out, in / 2] uint8 (the even column in the low 4 bits), ``scale`` and ``zero`` [out, groups]."""
        super().__init__()
        self.out_features, self.in_features = int(nibbles.shape[0]), int(nibbles.shape[1]) * 2
        self.group = self.in_features // int(scale.shape[1])
        self._nibbles, self._scale, self._zero = nibbles.contiguous(), scale.float().contiguous(), zero.float().contiguous()
        pad = (-self.out_features) % 16  # the packed layout takes rows in sixteens: zero rows, sliced off after
        q = torch.stack((nibbles & 15, nibbles >> 4), dim=-1).reshape(self.out_features, self.in_features).to(torch.int32)
        scale, zero = self._scale, self._zero
        if pad:
            q = torch.cat((q, q.new_full((pad, self.in_features), 8)))
            scale = torch.cat((scale, scale.new_zeros(pad, scale.shape[1])))
            zero = torch.cat((zero, zero.new_zeros(pad, zero.shape[1])))
        self._packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
        self._scales_zeros = torch.stack((scale, zero), dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
        self._bias = None if bias is None else bias.detach().float()

    @classmethod
    def quantized(cls, weight: Tensor, bias: Tensor | None = None) -> Q4Linear:
        """From a float weight [out, in]: per group of the largest size in :data:`Q4_GROUPS` that divides ``in``,
        min/max over the group's range shrunk by whichever of :data:`Q4_CLIPS` leaves the least squared error."""
        weight = weight.detach().float()
        out, width = weight.shape
        group = next((g for g in Q4_GROUPS if width % g == 0), None)
        if group is None:
            raise ValueError(f"4-bit weights need in_features divisible by one of {Q4_GROUPS}, got {width}")
        nibbles, scales, zeros = [], [], []
        for rows in weight.split(8192):  # bounded scratch on a vocabulary-wide head
            w = rows.reshape(rows.shape[0], width // group, group)
            lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
            best_err = best_q = best_scale = best_zero = None
            for clip in Q4_CLIPS:
                c_lo, c_hi = lo * clip, hi * clip
                scale = ((c_hi - c_lo) / 15).clamp_min(1e-10)
                q = ((w - c_lo) / scale).round_().clamp_(0, 15)
                zero = c_lo + 8 * scale
                # the error with what the GEMM will use: scale and zero rounded to bf16 (the levels are set from the
                # unrounded ones: a stored draft's recipe, kept so that studies made on it stay one draft)
                s16, z16 = scale.to(torch.bfloat16).float(), zero.to(torch.bfloat16).float()
                err = ((q - 8) * s16 + z16 - w).square_().sum(-1, keepdim=True)
                if best_err is None:
                    best_err, best_q, best_scale, best_zero = err, q, scale, zero
                else:
                    better = err < best_err
                    best_err = torch.where(better, err, best_err)
                    best_q = torch.where(better, q, best_q)
                    best_scale, best_zero = torch.where(better, scale, best_scale), torch.where(better, zero, best_zero)
            q = best_q.reshape(rows.shape[0], width).to(torch.uint8)
            nibbles.append(q[:, 0::2] | (q[:, 1::2] << 4))
            scales.append(best_scale.reshape(rows.shape[0], -1))
            zeros.append(best_zero.reshape(rows.shape[0], -1))
        return cls(torch.cat(nibbles), torch.cat(scales), torch.cat(zeros), bias)

    def state(self) -> dict[str, Tensor]:
        """The packed 4-bit weight [out, in / 2], its scales and zeros [out, groups] and the bias (:func:`save`)."""
        out = {"q4": self._nibbles, "scale": self._scale, "zero": self._zero}
        if self._bias is not None:
            out["bias"] = self._bias
        return out

    @classmethod
    def from_state(cls, tensors: dict[str, Tensor], prefix: str) -> Q4Linear:
        return cls(tensors[f"{prefix}.q4"], tensors[f"{prefix}.scale"], tensors[f"{prefix}.zero"],
                   tensors.get(f"{prefix}.bias"))

    def select(self, ids: Tensor) -> Q4Linear:
        """The rows ``ids`` of this layer (a proposal head), the same numbers."""
        return Q4Linear(self._nibbles.index_select(0, ids), self._scale.index_select(0, ids),
                        self._zero.index_select(0, ids), None if self._bias is None else self._bias.index_select(0, ids))

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1]).to(torch.bfloat16).contiguous()
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self._packed, self.group, self._scales_zeros)
        out = out[:, :self.out_features].float()
        if self._bias is not None:
            out.add_(self._bias)
        return out.view(*shape[:-1], self.out_features)

    @property
    def weight(self) -> Tensor:
        """The dequantized weight [out, in] in fp32, with the bf16 scales and zeros the GEMM uses."""
        q = torch.stack((self._nibbles & 15, self._nibbles >> 4), dim=-1).reshape(self.out_features, -1).float()
        q = q.view(self.out_features, -1, self.group)
        s16 = self._scale.to(torch.bfloat16).float().unsqueeze(-1)
        z16 = self._zero.to(torch.bfloat16).float().unsqueeze(-1)
        return ((q - 8) * s16 + z16).reshape(self.out_features, self.in_features)

    @property
    def bias(self) -> Tensor | None:
        return self._bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 (group {self.group})"
