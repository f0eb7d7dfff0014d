"""The GPU check's host-side references: vLLM's greedy rule with torch's tie rule, and the chi-square test."""

from __future__ import annotations

import numpy as np
import pytest

from jobs.gpu.correctness import chi_square_p, vllm_greedy_reference


def test_the_reference_is_vllms_greedy_rule_with_the_first_index_among_ties():
    logits = np.array([[1.0, 3.0, 3.0], [5.0, 0.0, 5.0], [0.0, 0.0, 1.0], [2.0, 2.0, 0.0]], dtype=np.float32)
    # flat rows 0-1 are request 0's: draft 1 (the first of a tie: accepted), then 2 (a max, not the first:
    # rejected, emit 0); row 2 is request 1's: draft -1 (placeholder: rejected, emit 0); request 2: no
    # drafts (its bonus)
    out = vllm_greedy_reference(np.array([1, 2, -1]), [2, 1, 0], logits[[0, 1, 3]], np.array([7, 8, 9]), 2)
    assert out.tolist() == [[1, 0, -1], [0, -1, -1], [9, -1, -1]]


def test_chi_square_p_values():
    expected = np.full(16, 1000.0)
    assert chi_square_p(expected.copy(), expected)[2] > 0.99
    skewed = expected.copy()
    skewed[0], skewed[1] = 1300, 700
    stat, df, p = chi_square_p(skewed, expected)
    assert df == 15 and stat == pytest.approx(180.0) and p < 1e-20
    # the smallest bins are pooled until they expect 5: [1, 2, 3] -> 6, leaving two bins
    assert chi_square_p(np.array([1, 2, 3, 94]), np.array([1.0, 2.0, 3.0, 94.0]))[1] == 1
