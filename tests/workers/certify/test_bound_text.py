"""What a certificate calls its bound: at one look the confirmation's upper bound; at a look of a
group-sequential plan the fixed-n bound at that look's level, named as such (with calibrated looks that level
is nominal, so the figure is a description, not a bound valid under the plan). Wording only: the numbers and
the decision are the same."""

from __future__ import annotations

from dataclasses import replace

from workers.certify.decide import Candidate, bound_text, drop_bound_from_counts, fixed_sequence, passes


def _bound(looks: int = 1, calibrated: bool = False, alpha: float = 0.0121511):
    bound = passes(drop_bound_from_counts(0, 0, 120, alpha), 0.05)
    if looks > 1:
        bound = replace(bound, look=1, looks=looks)
    return replace(bound, z=-2.714, z_max=-2.261) if calibrated else bound


def _reason(bound) -> str:
    return fixed_sequence([Candidate("trial-2", 1.5, 0.0, 0.0)], lambda c: bound, 0.05).reason


def test_one_look_states_the_confirmation_upper_bound():
    bound = _bound()
    assert bound_text(bound, "0.0333") == "confirmation upper bound 0.0333"
    assert bound_text(bound, "3.33%", single="upper bound") == "upper bound 3.33%"
    reason = _reason(bound)
    assert f"confirmation upper bound {bound.upper:.4f}, <= budget 0.05" in reason and "fixed-n" not in reason


def test_a_calibrated_look_names_its_figure_a_description_not_a_bound_of_the_plan():
    bound = _bound(looks=3, calibrated=True)
    reason = _reason(bound)
    assert (f"fixed-n upper bound {bound.upper:.4f} at its look's nominal level (a description, not a bound valid "
            "under the 3-look plan)") in reason
    assert "confirmation upper bound" not in reason and "Z_b -2.714 vs its threshold -2.261" in reason
    assert reason.startswith("trial-2's exact test p = ") and "<= budget 0.05 at alpha 0.05 on 120 items" in reason


def test_union_bound_looks_and_betting_bounds_say_the_alpha_their_look_spends():
    exact = _reason(_bound(looks=2))
    assert "fixed-n upper bound" in exact and "at the alpha its look spends" in exact
    assert "not a bound valid" not in exact and "(alpha 0.0121511 at look 1 of 2 (the alpha it spends))" in exact
    betting = replace(_bound(looks=2), method="betting", p_value=float("nan"), upper=0.04)
    text = _reason(betting)
    assert "fixed-n upper bound 0.0400 at the alpha its look spends (look 1 of 2) <= budget 0.05" in text
    assert "confirmation upper bound 0.0400 <= budget" in _reason(replace(betting, look=1, looks=1))
