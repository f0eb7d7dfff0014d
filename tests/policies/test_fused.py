"""The fused statistics kernel (policies.fused) against the eager kernels it replaces, and the two-stage
top-k (policies.distributions.top_ids) against torch.topk. The kernel is compiled once per process here
(Inductor, seconds); every case forces it on at small vocabularies, where the default leaves it off."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch

from policies import POLICIES, fused, get_spec, make_policy
from policies.distributions import kl_from_logprobs, top_ids
from tests.policies.batches import make_batch


def _logits(seed: int, shape: tuple[int, ...], masked: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * 3.0
    if masked:
        x[..., -masked:] = float("-inf")  # a padded draft's ids, a logits processor's bans
    return x


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0, 1.6])
@pytest.mark.parametrize("scaled", [False, True])
def test_row_stats_are_the_eager_log_partitions_kl_and_max_prob(temperature, scaled):
    z = _logits(0, (3, 4, 1000), masked=7)
    w = _logits(1, (3, 4, 1000)) + z.clamp_min(-30.0)  # the draft's T = 1 logits, finite everywhere
    t = temperature or 1.0
    given = w / t if scaled else w
    scale = (t, 1.0) if scaled and temperature > 0 else ((1.0, 1.0 / t) if temperature > 0 else (1.0, 1.0))
    with fused.forced("1"):
        stats = fused.row_stats(z, given, temperature, scale)
    assert stats is not None and fused.failure() is None
    tol = dict(rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(stats.target_lse1, torch.logsumexp(z, -1), **tol)
    torch.testing.assert_close(stats.target_lse, torch.logsumexp(z / t, -1), **tol)
    torch.testing.assert_close(stats.draft_lse1, torch.logsumexp(w, -1), **tol)
    torch.testing.assert_close(stats.draft_lse, torch.logsumexp(w / t, -1), **tol)
    torch.testing.assert_close(stats.max_prob1, torch.softmax(z, -1).amax(-1), **tol)
    logp, logq = torch.log_softmax(z, -1), torch.log_softmax(w, -1)
    torch.testing.assert_close(stats.kl1, kl_from_logprobs(logp, logq), **tol)
    with fused.forced("1"):
        target_only = fused.row_stats(z, None, temperature)
    assert target_only is not None and target_only.kl1 is None
    torch.testing.assert_close(target_only.target_lse, stats.target_lse, **tol)


def test_the_lossless_rules_share_is_the_two_log_partitions_at_t_and_a_kl_rule_gets_everything_once():
    z = _logits(8, (2, 3, 700))
    w = z + _logits(9, (2, 3, 700))
    with fused.forced("1"):
        half = fused.row_stats(z, w / 0.7, 0.7, (0.7, 1.0), at_t_only=True)
    assert half.target_lse1 is None and half.kl1 is None and half.draft_lse1 is None
    torch.testing.assert_close(half.target_lse, torch.logsumexp(z / 0.7, -1), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(half.draft_lse, torch.logsumexp(w / 0.7, -1), rtol=1e-5, atol=1e-4)
    batch = make_batch(seed=3, vocab=400, temperature=0.7)
    with fused.forced("1"):
        make_policy("lossless").decide(batch)
        assert "fused" not in batch.__dict__ and batch.fused_at_t.kl1 is None  # lossless: the half kernel
        judged = replace(batch)  # a fresh batch: the KL judge asks for everything first, then shares it
        make_policy("kl_judge").decide(judged)
        assert judged.__dict__["fused"].kl1 is not None and "fused_at_t" not in judged.__dict__


def test_kl_is_infinite_where_the_target_has_mass_and_the_draft_none_and_zero_where_neither():
    z = _logits(2, (2, 3, 500), masked=20)
    w = z.clone()
    with fused.forced("1"):
        same = fused.row_stats(z, w, 0.0)  # both masked alike: KL 0, not NaN
        w[0, 0, 5] = float("-inf")  # an id the target gives mass to, the draft none
        apart = fused.row_stats(z, w, 0.0)
    assert torch.allclose(same.kl1, torch.zeros_like(same.kl1), atol=1e-5)
    assert torch.isinf(apart.kl1[0, 0]) and torch.isfinite(apart.kl1.flatten()[1:]).all()


def test_a_bf16_draft_is_upcast_inside_the_kernel():
    z = _logits(3, (2, 2, 800))
    w = (z + _logits(4, (2, 2, 800))).to(torch.bfloat16)
    with fused.forced("1"):
        stats = fused.row_stats(z, w, 0.7, (1.0, 1 / 0.7))
    torch.testing.assert_close(stats.draft_lse1, torch.logsumexp(w.float(), -1), rtol=1e-5, atol=1e-4)


RULES = sorted(POLICIES)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("name", RULES)
def test_every_rule_decides_alike_with_the_fused_kernel_and_without(name, temperature):
    """The same batch, the same random numbers: the same decisions and (to float rounding) the same scores,
    whether the statistics come fused or from the eager kernels; the draft handed over scaled by T too."""
    policy = make_policy(name, **get_spec(name).example)
    for scaled in (False, True):
        batch = make_batch(seed=5, batch_size=4, vocab=512, hidden=16, temperature=temperature, scale=3.0)
        if scaled and temperature > 0:
            batch = replace(batch, draft_logits=batch.draft_logits / temperature, draft_scaled=True)
        results = {}
        for mode in ("0", "1"):
            with fused.forced(mode):
                fresh = replace(batch, generator=torch.Generator().manual_seed(9))
                results[mode] = (policy.decide(fresh), fresh.__dict__.get("fused") or fresh.__dict__.get("fused_at_t"))
        (eager, none), (fast, stats) = results["0"], results["1"]
        # at T > 0 every rule reads log-partitions (the lossless part); at T = 0 the KL judge, DropMatch js (its draft
        # atoms) and FLy (the target's T = 1 log-partition under its top-k entropy)
        assert none is None and (stats is not None) == (temperature > 0 or name in ("kl_judge", "any_of", "dropmatch",
                                                                                    "fly")), name
        assert torch.equal(eager.accepted, fast.accepted), (name, temperature, scaled)
        if eager.score is not None:
            torch.testing.assert_close(fast.score, eager.score, rtol=1e-4, atol=1e-4)


def test_a_kernel_that_fails_is_reported_once_and_the_eager_kernels_decide(monkeypatch, caplog):
    def broken(name):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(fused, "_kernel", broken)
    monkeypatch.setattr(fused, "_failed", [])
    monkeypatch.setattr(fused, "_reported", set())
    batch = make_batch(seed=6, vocab=256, temperature=0.8)
    with caplog.at_level(logging.WARNING, logger="spectune.policies"), fused.forced("1"):
        first = make_policy("kl_judge").decide(replace(batch, generator=torch.Generator().manual_seed(1)))
        assert fused.failure() == "RuntimeError: no C++ compiler"
        again = make_policy("kl_judge").decide(replace(batch, generator=torch.Generator().manual_seed(1)))
    with fused.forced("0"):
        eager = make_policy("kl_judge").decide(replace(batch, generator=torch.Generator().manual_seed(1)))
    assert torch.equal(first.accepted, eager.accepted) and torch.equal(again.accepted, eager.accepted)
    assert sum("fused statistics kernel failed" in r.getMessage() for r in caplog.records) == 1


def test_the_mode_comes_from_the_environment_and_a_bad_one_is_named(monkeypatch):
    block = torch.zeros(1, 1, fused.MIN_VOCAB)
    monkeypatch.setenv(fused.ENV, "auto")
    assert fused.enabled(block) and not fused.enabled(torch.zeros(1, 1, 320))  # real vocabularies on CPU only
    monkeypatch.setenv(fused.ENV, "0")
    assert not fused.enabled(block)
    monkeypatch.setenv(fused.ENV, "yes")
    with pytest.raises(ValueError, match="SPECTUNE_FUSED must be auto, 0 or 1, got 'yes'"):
        fused.mode()
    assert not fused.enabled(block)  # inside a step: reported, off, never a raise
    with pytest.raises(ValueError, match="auto, 0 or 1"):
        with fused.forced("on"):
            pass


@pytest.mark.parametrize("vocab", [151_936, 1000, 6400 + 37, 64 * 4 * 64])
def test_top_ids_selects_what_topk_selects(vocab):
    x = _logits(7, (3, 2, vocab))
    x[0, 0, :70] = 5.0  # ties across segments
    x[1, 1, 3] = float("nan")  # NaN counts as largest, as in torch.topk
    got, want = top_ids(x, 64), x.topk(64, dim=-1).indices
    assert got.shape == want.shape
    torch.testing.assert_close(x.gather(-1, got), x.gather(-1, want), equal_nan=True, rtol=0, atol=0)
    flat = x.reshape(-1, vocab)
    for row_got, row in zip(got.reshape(-1, 64), flat, strict=True):
        assert len(set(row_got.tolist())) == 64 and int(row_got.max()) < vocab
        assert row.gather(0, row_got).isnan().sum() == row.isnan().sum().clamp(max=64)


def test_a_failed_stream_kernel_leaves_the_statistics_kernels_on(monkeypatch, caplog):
    """The random-stream kernel's numbers equal the eager hash's, so its failure switches off only itself: the
    statistics kernels (whose figures differ from the eager ones in the last bits) keep deciding."""
    monkeypatch.setattr(fused, "_streams_failed", [])
    monkeypatch.setattr(fused, "_failed", [])
    monkeypatch.setattr(fused, "_compiled", {**fused._compiled, "streams": _raises})
    keys = torch.arange(4, dtype=torch.int64)
    with caplog.at_level(logging.WARNING, logger="spectune.policies"), fused.forced("1"):
        assert fused.stream_numbers(keys, 2, 20_000, 16) is None
        assert fused.stream_numbers(keys, 2, 20_000, 16) is None
    assert fused.failure() is None and fused._streams_failed
    assert sum("random-stream kernel failed" in r.getMessage() for r in caplog.records) == 1


def _raises(*args):
    raise RuntimeError("no C++ compiler")


@pytest.mark.parametrize("with_draft", [False, True], ids=["target", "pair_at_one"])
def test_a_rows_statistics_do_not_depend_on_the_block_height_at_one_thread(with_draft):
    """Replay's exactness on the fast path (workers.replay.exact_for: one thread) needs a row's T = 0 statistics
    to be the same numbers in a live round's block ([1, L, V], L = 1 compiles a kernel of its own) and in the
    teacher-forced pass's ([1, T + 1, V]): checked bit for bit at the real pair's vocabulary."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gen = torch.Generator().manual_seed(7)
        vocab = 151_936
        target = torch.randn(1, 70, vocab, generator=gen) * 4
        draft = (torch.randn(1, 70, vocab, generator=gen) * 4) if with_draft else None
        with fused.forced("1"):
            whole = fused.row_stats(target, draft, 0.0)
            assert whole is not None, fused.failure()
            for height in (1, 2, 5, 64):
                for start in (0, 70 - height):
                    rows = slice(start, start + height)
                    part = fused.row_stats(target[:, rows].contiguous(),
                                           None if draft is None else draft[:, rows].contiguous(), 0.0)
                    for field in ("target_lse1", "max_prob1", "draft_lse1", "kl1"):
                        a, b = getattr(whole, field), getattr(part, field)
                        if a is None:
                            assert b is None
                            continue
                        assert torch.equal(a[:, rows], b), (field, height, start)
    finally:
        torch.set_num_threads(threads)
