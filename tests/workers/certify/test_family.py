"""The family of attempts on one benchmark and pair spends alpha: the k-th attempt at alpha * 2^-k, and an exact
enumeration shows P(any certificate of the family is wrong) <= alpha for families of up to 10 attempts at the
sizes this project uses."""

from __future__ import annotations

import pytest

from workers.certify.family import attempt_size, family_alpha, family_error, spent

ALPHA = 0.05
# (n, looks, budget) per attempt: the sizes of this project's attempts (40, 64 and 120 confirmation items at
# 2-10%, 320 at 1-5% with 3 looks) and of the certificates README plans (161 at 5%, 823 at 2%)
FAMILY = [(40, 1, 0.05), (120, 2, 0.05), (64, 1, 0.01), (320, 3, 0.05), (161, 1, 0.05), (823, 1, 0.02),
          (64, 2, 0.1), (40, 1, 0.1), (265, 1, 0.05), (120, 1, 0.02)]


def test_the_kth_attempt_gets_alpha_times_two_to_the_minus_k_and_the_family_never_spends_alpha():
    assert [family_alpha(ALPHA, k) for k in (1, 2, 3, 4)] == [0.025, 0.0125, 0.00625, 0.003125]
    assert spent(ALPHA, 10) < ALPHA and spent(ALPHA, 40) <= ALPHA
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="number in its family"):
            family_alpha(ALPHA, bad)


@pytest.mark.slow
def test_an_exact_enumeration_holds_every_attempt_to_its_share_and_the_family_to_alpha():
    sizes = []
    for k, (n, looks, budget) in enumerate(FAMILY, start=1):
        level = family_alpha(ALPHA, k)
        s = attempt_size(n, looks, level, budget)
        # the sup over the nuisance is taken on the exact module's grid; 1e-9 absorbs float rounding only
        assert s <= level * (1 + 1e-9), f"attempt {k} (n {n}, {looks} looks, budget {budget}): size {s} > {level}"
        assert s > level / 4, f"attempt {k}: size {s} far below its level {level}: the enumeration is not biting"
        sizes.append(s)
        assert family_error(sizes) <= ALPHA, f"after {k} attempts P(any wrong) <= {family_error(sizes)}"
    assert family_error(sizes) <= spent(ALPHA, len(FAMILY)) < ALPHA


def test_attempts_each_at_full_alpha_would_not_hold_the_family_level():
    sizes = [attempt_size(n, 1, ALPHA, b) for n, _, b in FAMILY[:5] if _ == 1]
    assert family_error(sizes) > ALPHA, "four attempts at 0.05 each: the family's error passes 0.05"


@pytest.mark.parametrize("budget", [0.005, 0.01, 0.02, 0.05, 0.1, 0.3])
def test_the_score_rises_with_each_loss_and_falls_with_each_win_so_a_larger_drop_never_certifies_more(budget):
    """The coupling behind "the size is largest at drop = b": turning ties into losses at a fixed P(won) raises
    lost pointwise and leaves won alone, so every look's region {Z_b <= z} can only shrink, for the fixed-n test
    and every look plan. That needs Z_b non-decreasing in lost at fixed won and non-increasing in won at fixed
    lost, at every outcome (checked here by enumeration, n <= 200)."""
    import numpy as np

    from workers.certify.exact import score_z

    for n in (1, 2, 7, 40, 64, 120, 200):
        lost, won = np.meshgrid(np.arange(n + 1), np.arange(n + 1), indexing="ij")
        z = np.where(lost + won <= n, score_z(lost, won, n, budget), np.nan)
        up = np.diff(z, axis=0)  # one more loss, the same wins
        down = np.diff(z, axis=1)  # one more win, the same losses
        assert np.all(up[~np.isnan(up)] >= -1e-12), f"n {n}: a loss lowered Z_b"
        assert np.all(down[~np.isnan(down)] <= 1e-12), f"n {n}: a win raised Z_b"
