"""The counter hash behind every random stream: number ``j`` of the row keyed ``k`` is a pure function of
``(k, j)`` (SplitMix64's finaliser in int64 tensor arithmetic that wraps, on any device), turned into a float32
in (0, 1). :mod:`policies.randomness` builds its streams on it; :mod:`policies.fused` compiles
:func:`_numbers_by_element` into one loop. Both import this module and neither imports the other for it.
"""

from __future__ import annotations

import torch
from torch import Tensor

_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)  # as signed int64
_M1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_M2 = 0x94D049BB133111EB - (1 << 64)


def _signed(c: int) -> int:
    """A Python integer as the int64 that wraps to it (mod 2^64)."""
    c %= 1 << 64
    return c - (1 << 64) if c >= 1 << 63 else c


def _shr(x: Tensor, bits: int) -> Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic on signed integers)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(x: Tensor) -> Tensor:
    """SplitMix64's finaliser of ``x + golden`` (int64, wrapping): a bijection that scrambles every bit."""
    z = x + _GOLDEN
    z = (z ^ _shr(z, 30)) * _M1
    z = (z ^ _shr(z, 27)) * _M2
    return z ^ _shr(z, 31)


def _numbers(key: Tensor, n_heads: int, per_head: int, bits: int) -> Tensor:
    """float32 ``[B, n_heads, per_head]`` in (0, 1): number ``j`` of head ``h`` of the row keyed ``key[b]`` is
    hash ``j`` (24 bits: its top 24) or field ``j % 4`` of hash ``j // 4`` (16 bits), hash ``i`` being
    ``_mix(key + (h << 32) + i)``. Eager torch ops, a pass each; :func:`policies.fused.stream_numbers` makes
    the same numbers, bit for bit, in one compiled pass."""
    per_hash = 1 if bits == 24 else 4
    device = key.device
    index = ((torch.arange(n_heads, dtype=torch.int64, device=device) << 32).unsqueeze(1)
             + torch.arange((per_head + per_hash - 1) // per_hash, dtype=torch.int64, device=device))
    h = _mix(key.view(-1, 1, 1) + index)  # [B, heads, hashes per head]
    if bits == 24:
        return (_shr(h, 40).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    fields = torch.stack([_shr(h, 16 * i) & 0xFFFF for i in range(4)], dim=-1).flatten(2)[..., :per_head]
    return (fields.to(torch.float32) + 0.5) * (1.0 / (1 << 16))


def _numbers_by_element(key: Tensor, n_heads: int, per_head: int, bits: int) -> Tensor:
    """:func:`_numbers` written element by element (each number hashes its own index, so a compiler fuses
    it into one loop with no ``[.., 4]`` stack): what :func:`policies.fused.stream_numbers` compiles."""
    device = key.device
    j = torch.arange(per_head, dtype=torch.int64, device=device)
    head = (torch.arange(n_heads, dtype=torch.int64, device=device) << 32).unsqueeze(1)  # [heads, 1]
    if bits == 24:
        h = _mix(key.view(-1, 1, 1) + (head + j))
        return (_shr(h, 40).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    h = _mix(key.view(-1, 1, 1) + (head + (j >> 2)))
    # field j % 4 of the hash: bits 16·(j % 4) up; an arithmetic shift's sign bits never reach the low 16
    field = (h >> ((j & 3) << 4)) & 0xFFFF
    return (field.to(torch.float32) + 0.5) * (1.0 / (1 << 16))


def _gumbel_by_element(keys: Tensor, vocab: int) -> Tensor:
    """float32 ``[M, vocab]`` Gumbel(0, 1) noise: number ``v`` of the row keyed ``keys[m]`` from hash
    ``_mix(key + v * golden)``'s top 53 bits, ``u = (bits + 0.5) / 2^53``. What the upper tail needs is ``1 - u``,
    exact in float64: ``w = (2^53 - bits - 0.5) / 2^53``, ``E = -log u = -log1p(-w)`` ~ Exp(1), ``g = -log E``, all
    in float64 (both tails finite: g in about [-3.6, 37]), then float32. :func:`policies.fused.gumbel_noise`
    compiles it into one loop."""
    ids = torch.arange(int(vocab), dtype=torch.int64, device=keys.device)
    top = _shr(_mix(keys.unsqueeze(-1) + ids * _GOLDEN), 11).to(torch.float64)  # SplitMix64's own counter step
    w = ((1 << 53) - top - 0.5) * (1.0 / (1 << 53))
    return (-torch.log(-torch.log1p(-w))).to(torch.float32)
