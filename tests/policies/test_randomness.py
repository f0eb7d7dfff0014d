"""Counter-based per-row streams: SplitMix64 exactly, uniform, independent, and a row's numbers fixed
by its key whatever else shares the batch; inverse-CDF sampling matches the distribution."""

from __future__ import annotations

import math

import pytest
import torch
from scipy import stats

from policies.randomness import RowStreams, _mix, sample_rows

MASK = (1 << 64) - 1


def splitmix_reference(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def test_the_mix_is_splitmix64_with_wrapping_int64_arithmetic():
    xs = [0, 1, 2, 12345, (1 << 63) - 1, -(1 << 63), -1, 0x0123456789ABCDEF]
    got = _mix(torch.tensor(xs, dtype=torch.int64)).tolist()
    assert [g & MASK for g in got] == [splitmix_reference(x & MASK) for x in xs]


def test_a_rows_numbers_depend_on_its_key_and_draw_only():
    a = RowStreams(torch.tensor([7, 11, 13]))
    b = RowStreams(torch.tensor([13, 99, 7, 5]))
    ua1, ub1 = a.uniform((3, 4, 5)), b.uniform((4, 4, 5))
    assert torch.equal(ua1[0], ub1[2]) and torch.equal(ua1[2], ub1[0]), "same key, same numbers, any position"
    ua2 = a.uniform((3, 4, 5))
    assert not torch.equal(ua1, ua2), "the next draw differs"
    chunk = RowStreams(torch.tensor([7, 11, 13]), start=1).rows(1, 3)
    assert torch.equal(chunk.uniform((2, 4, 5)), ua2[1:]), "a chunk at the same draw is the same rows"
    with pytest.raises(ValueError, match="first dimension is the rows"):
        a.uniform((2, 3))


def test_streams_are_uniform_and_rows_draws_and_positions_independent():
    s = RowStreams(torch.arange(64) * 1_000_003)
    u = torch.cat([s.uniform((64, 4096)) for _ in range(3)], dim=1)  # 3 draws of 64 rows x 4096
    assert 0.0 < float(u.min()) and float(u.max()) < 1.0
    assert stats.kstest(u.flatten().numpy(), "uniform").pvalue > 1e-3
    flat = u.reshape(64, 3, 4096)
    for x, y in ((flat[:, 0], flat[:, 1]), (flat[:-1, 0], flat[1:, 0]), (flat[:, 0, :-1], flat[:, 0, 1:])):
        r = float(torch.corrcoef(torch.stack([x.flatten(), y.flatten()]))[0, 1])
        assert abs(r) < 5 / math.sqrt(x.numel()), "draws, neighbouring rows and positions uncorrelated"


def test_inverse_cdf_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.0, 0.2, 0.3]).expand(20_000, 4) * 3.0  # any positive total
    ids = sample_rows(probs, RowStreams(torch.arange(20_000)).uniform((20_000,)))
    counts = torch.bincount(ids, minlength=4).tolist()
    assert counts[1] == 0, "a zero-probability id is never drawn"
    assert stats.chisquare([counts[0], counts[2], counts[3]], [10_000, 4_000, 6_000]).pvalue > 1e-3
    edge = sample_rows(torch.tensor([[0.0, 1.0, 0.0]]), torch.tensor([1.0 - 2**-24]))
    assert edge.tolist() == [1], "u near 1 stays on the last id with mass, never past the end"


def test_a_row_with_no_usable_mass_gets_its_argmax_not_an_error():
    probs = torch.tensor([[float("nan"), 1.0, 0.5], [0.0, 0.0, 0.0], [0.2, float("inf"), 0.1], [0.1, 0.7, 0.2]])
    ids = sample_rows(probs, torch.full((4,), 0.5))
    assert ids.tolist()[:3] == [0, 0, 1] and 0 <= ids.tolist()[3] < 3


def test_16_bit_draws_are_uniform_and_extend_like_24_bit_ones():
    s = RowStreams(torch.arange(8) * 7919)
    u = s.uniform((8, 3, 5, 1001), bits=16, heads=True)
    assert 0.0 < float(u.min()) and float(u.max()) < 1.0
    assert stats.kstest(u.flatten().numpy(), "uniform").pvalue > 1e-3
    keep = (u >= 0.3).float().mean().item()
    assert abs(keep - 0.7) < 5 * math.sqrt(0.21 / u.numel()), "a 16-bit number compared with p keeps 1 - p"
    head_r = float(torch.corrcoef(torch.stack([u[:, 0].flatten(), u[:, 1].flatten()]))[0, 1])
    assert abs(head_r) < 5 / math.sqrt(u[:, 0].numel()), "heads are independent"
    with pytest.raises(ValueError, match="bits must be 16 or 24"):
        s.uniform((8, 4), bits=8)
    with pytest.raises(ValueError, match="needs shape \\[rows, heads"):
        s.uniform((8,), heads=True)


@pytest.mark.parametrize("bits", [16, 24])
def test_with_heads_a_draw_extends_in_heads_and_in_length(bits):
    """What a padded request and a lower K see: the numbers they would have drawn alone."""
    big = RowStreams(torch.tensor([3, 4]), start=5).uniform((2, 4, 6, 7), bits=bits, heads=True)
    small = RowStreams(torch.tensor([4]), start=5).uniform((1, 2, 3, 7), bits=bits, heads=True)
    assert torch.equal(big[1, :2, :3], small[0]), "more heads and a longer draft only add numbers"
    assert not torch.equal(big[:, 0], big[:, 1]), "each head its own numbers"
    plain = RowStreams(torch.tensor([3, 4]), start=5).uniform((2, 6, 7), bits=bits)
    assert torch.equal(plain, big[:, 0, :6]), "head 0 of a draw with heads is the draw without"


@pytest.mark.parametrize("bits", [16, 24])
def test_the_compiled_draw_makes_the_eager_hashs_numbers_bit_for_bit(bits):
    """policies.fused.stream_numbers (one compiled pass, used for draws of MIN_STREAM_NUMBERS or more on CPU)
    gives every row, head and position the numbers the eager hash gives, lengths not a multiple of 4 included;
    a draw below the threshold, or with the fused kernels off, is hashed eagerly."""
    from policies import fused
    from policies.randomness import _numbers

    keys = torch.tensor([3, -7, 2 ** 62, -(2 ** 63), 0], dtype=torch.int64)
    for n_heads, per_head in [(5, 4 * 1537 + 3), (2, 40_001)]:
        calls = fused.CALLS["streams"]
        with fused.forced("1"):
            compiled = fused.stream_numbers(keys, n_heads, per_head, bits)
        assert compiled is not None and fused.CALLS["streams"] == calls + 1 and fused.failure() is None
        assert torch.equal(compiled, _numbers(keys, n_heads, per_head, bits))
        with fused.forced("1"):  # the same draw through RowStreams: the compiled numbers, laid out by shape
            drawn = RowStreams(keys, start=4).uniform((5, n_heads, per_head), bits, heads=True)
        with fused.forced("0"):
            eager = RowStreams(keys, start=4).uniform((5, n_heads, per_head), bits, heads=True)
        assert torch.equal(drawn, eager)
    with fused.forced("1"):
        assert fused.stream_numbers(keys[:1], 1, fused.MIN_STREAM_NUMBERS - 1, bits) is None
    with fused.forced("0"):
        assert fused.stream_numbers(keys, 5, 40_000, bits) is None
