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
from policies.hashing import _M1, _M2, _mix, _numbers, _signed


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
