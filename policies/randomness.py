"""Counter-based random streams, one per batch row: a request's draws depend on its key alone.

A rule decides a whole batch in one call; when each request carries its own seed (a per-request rule in
vLLM), its random numbers must not depend on which other requests share the batch, nor on their order.
A ``torch.Generator`` cannot give that without one call per request. :class:`RowStreams` can: the
``j``-th number of draw ``s`` for the row keyed ``k`` is a hash of ``(k, s, j)`` (SplitMix64's finaliser,
twice, in int64 tensor arithmetic that wraps, on any device), turned into a float32 in (0, 1) from its top
24 bits. No generator state, no host sync, the same numbers on CPU and CUDA and in every process.

Sampling from a distribution with one uniform per row is by inverse CDF (:func:`sample_rows`), not
``torch.multinomial`` (which syncs with the host and draws from a generator).
"""

from __future__ import annotations

import torch
from torch import Tensor

from policies import fused

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


class RowStreams:
    """Random numbers for a batch whose row ``i`` is keyed ``keys[i]`` (int64, any values).

    Each :meth:`uniform` call is one *draw* (numbered from ``start``); a rule that makes its draws in a
    fixed order gives each row the same numbers whatever the batch. :meth:`rows` is a chunk of the batch
    at the same draw number (a chunked rule call sees the same streams as an unchunked one)."""

    def __init__(self, keys: Tensor, start: int = 0) -> None:
        if keys.dim() != 1:
            raise ValueError(f"keys must be one per row ([B]), got shape {tuple(keys.shape)}")
        self.keys = keys.to(torch.int64)
        self.draws = int(start)

    def __len__(self) -> int:
        return int(self.keys.shape[0])

    def rows(self, lo: int, hi: int) -> RowStreams:
        return RowStreams(self.keys[lo:hi], self.draws)

    def uniform(self, shape: tuple[int, ...] | torch.Size, bits: int = 24, heads: bool = False) -> Tensor:
        """float32 in (0, 1) of ``shape`` (``shape[0]`` = the rows), then the next draw.

        ``bits``: 24 (one hash per number) or 16 (four numbers from each 64-bit hash, at a quarter of the
        hashing: enough where a number is only compared with a probability, as a dropout mask's is).
        ``heads``: ``shape[1]`` numbers independent sub-draws (DropMatch's heads), each numbered from 0, as if
        each were a draw of its own. Number ``j`` of a row (of a head) never depends on how many numbers the
        draw makes, so a longer draw extends a shorter one: a request padded to a longer draft, or more
        heads, leaves the numbers it had unchanged."""
        shape = tuple(int(s) for s in shape)
        if not shape or shape[0] != len(self):
            raise ValueError(f"a draw's first dimension is the rows ({len(self)}), got shape {shape}")
        if bits not in (16, 24):
            raise ValueError(f"bits must be 16 or 24, got {bits}")
        if heads and len(shape) < 2:
            raise ValueError(f"a draw with heads needs shape [rows, heads, ...], got {shape}")
        draw, self.draws = self.draws, self.draws + 1
        n_heads = shape[1] if heads else 1
        per_head = 1
        for s in shape[(2 if heads else 1):]:
            per_head *= s
        key = _mix(self.keys + _signed(draw * _M2))  # [B]: this row's key for this draw
        numbers = fused.stream_numbers(key, n_heads, per_head, bits)  # one compiled kernel where it runs
        return (_numbers(key, n_heads, per_head, bits) if numbers is None else numbers).view(shape)


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


class PositionStreams:
    """Random numbers keyed by (seed, absolute position) instead of by row: the numbers a rule draws for the
    draft slot at sequence position ``positions[b, l]`` depend on the seed and that position alone, never on
    the block it was drafted in, the draft length or the steps before. What makes a T = 0 decision a
    function of the position's own inputs, so a replay over a teacher-forced pass (``workers.replay``) draws
    the masks live decoding drew.

    Draws have the layout :class:`RowStreams` draws have: ``shape[0]`` the rows, and the draft positions next
    (``heads``: ``[rows, heads, positions, ...]``; else ``[rows, positions, ...]``)."""

    def __init__(self, seed: int, positions: Tensor, start: int = 0) -> None:
        if positions.dim() != 2:
            raise ValueError(f"positions must be [B, L], got shape {tuple(positions.shape)}")
        self.seed, self.positions, self.draws = int(seed), positions.to(torch.int64), int(start)

    def __len__(self) -> int:
        return int(self.positions.shape[0])

    def rows(self, lo: int, hi: int) -> PositionStreams:
        return PositionStreams(self.seed, self.positions[lo:hi], self.draws)

    def uniform(self, shape: tuple[int, ...] | torch.Size, bits: int = 24, heads: bool = False) -> Tensor:
        shape = tuple(int(s) for s in shape)
        b, n = self.positions.shape
        axis = 2 if heads else 1
        if len(shape) <= axis or shape[0] != b or shape[axis] != n:
            raise ValueError(f"a position-keyed draw needs shape [rows={b}, {'heads, ' if heads else ''}"
                             f"positions={n}, ...], got {shape}")
        keys = _mix(self.positions.flatten() + _signed(self.seed * _M1))  # [B * L]
        streams = RowStreams(keys, self.draws)
        self.draws += 1
        rest = shape[axis + 1:]
        if heads:
            u = streams.uniform((b * n, shape[1], *rest), bits, heads=True)  # [B*L, K, ...]
            return u.view(b, n, shape[1], *rest).transpose(1, 2).contiguous()
        return streams.uniform((b * n, *rest) if rest else (b * n,), bits).view(shape)


def sample_rows(probs: Tensor, uniforms: Tensor) -> Tensor:
    """One token per row of ``probs`` ``[..., V]`` (non-negative, any positive total) by inverse CDF at
    ``uniforms`` ``[...]`` in (0, 1): the first id whose cumulative mass exceeds ``u`` x the row's total.
    ``probs`` is read, never written; one cumulative sum of its size is the only intermediate. A row with
    no usable mass (NaN or infinite entries, or all zero: broken logits) gets its largest entry's id
    (NaN-aware, as ``argmax``) instead: always a valid id, decided on the device (``torch.multinomial``
    raises there, after a host read)."""
    cdf = probs.float().cumsum(dim=-1)
    total = cdf[..., -1]
    target = (uniforms.to(cdf.dtype) * total).unsqueeze(-1).contiguous()
    ids = torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)
    broken = ~(torch.isfinite(total) & (total > 0))
    return torch.where(broken, probs.argmax(dim=-1), ids)


def uniform(shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device,
            streams: RowStreams | None = None, bits: int = 24, heads: bool = False) -> Tensor:
    """A rule's uniforms: from the rows' own streams when the batch has them (``bits`` and ``heads`` as
    :meth:`RowStreams.uniform`), else from ``generator``."""
    if streams is not None:
        return streams.uniform(shape, bits, heads).to(device)
    return torch.rand(shape, generator=generator, device=device)
