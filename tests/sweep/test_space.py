"""The sweep's search space round-trips: what ``suggest`` asked, ``decode_params`` gives back."""

from __future__ import annotations

import optuna
import pytest

from policies import make_policy
from sweep.space import decode_params, suggest


@pytest.mark.parametrize("draft_len", [(3, 3), (2, 6)])
def test_suggest_then_decode_round_trips_including_a_fixed_draft_length(draft_len):
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(8):
        trial = study.ask()
        family, params, length = suggest(trial, ["kl_judge", "top_k", "dropmatch"], draft_len)
        make_policy(family, **params)  # every suggested point is a valid rule
        assert decode_params(trial.params, ["kl_judge", "top_k", "dropmatch"], draft_len) == (family, params, length)
        assert draft_len[0] <= length <= draft_len[1]
        study.tell(trial, 1.0)


@pytest.mark.parametrize("draft_len", [(1, 6), (3, 3), (5, 5), (1, 12)])
def test_a_look_ahead_rule_is_drawn_a_window_that_fits_in_its_draft_length(draft_len):
    """FLy at L <= W relaxes nothing: L is drawn first (2 or more) and its window below it, never a lossless
    trial in disguise, and decode_params reads the same point back."""
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    seen = set()
    for _ in range(40):
        trial = study.ask()
        family, params, length = suggest(trial, ["fly", "top_k"], draft_len)
        if family == "fly":
            assert 1 <= params["window"] < length, (params, length)
            seen.add((params["window"], length))
        assert decode_params(trial.params, ["fly", "top_k"], draft_len) == (family, params, length)
        study.tell(trial, 1.0)
    assert len(seen) > (0 if draft_len[1] <= 3 else 2)
