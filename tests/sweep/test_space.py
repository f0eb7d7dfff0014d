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


def test_a_look_ahead_rule_is_drawn_a_draft_length_its_window_fits_in():
    """FLy at L <= W relaxes nothing: its draft length comes from above its window where the range reaches."""
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    seen = set()
    for _ in range(40):
        trial = study.ask()
        family, params, length = suggest(trial, ["fly"], (1, 6))
        assert length > params["window"] or length == 6, (params, length)
        assert decode_params(trial.params, ["fly"], (1, 6)) == (family, params, length)
        seen.add(length)
        study.tell(trial, 1.0)
    assert len(seen) > 2
