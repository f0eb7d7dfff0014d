"""GenerationStats.plus: the one merge of two runs' counts (an item's turns; a replayed prefix and its live decode)."""

from __future__ import annotations

from workers.stats import GenerationStats


def test_plus_adds_every_count_and_position_and_keeps_the_later_prompt():
    a = GenerationStats(draft_len=2, num_generated=5, num_drafts=2, num_draft_tokens=4, num_accepted_tokens=3,
                        accepted_per_position=[2, 1], target_forwards=2, draft_forwards=4, prompt_tokens=10,
                        wall_time_s=1.5, lossless_fallback_steps=1)
    b = GenerationStats(draft_len=2, num_generated=3, num_drafts=1, num_draft_tokens=2, num_accepted_tokens=2,
                        accepted_per_position=[1, 1], target_forwards=1, draft_forwards=2, prompt_tokens=17,
                        cached_prompt_tokens=8, wall_time_s=0.5)
    c = a.plus(b)
    assert (c.num_generated, c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens) == (8, 3, 6, 5)
    assert (c.target_forwards, c.draft_forwards, c.wall_time_s, c.lossless_fallback_steps) == (3, 6, 2.0, 1)
    assert c.accepted_per_position == [3, 2] and (c.prompt_tokens, c.cached_prompt_tokens) == (17, 8)
    assert a.num_generated == 5 and a.accepted_per_position == [2, 1], "neither run is written"


def test_plus_from_an_empty_total_takes_the_run_as_it_is():
    run = GenerationStats(draft_len=3, num_generated=4, accepted_per_position=[1, 0, 0], target_forwards=2)
    total = GenerationStats(draft_len=3).plus(run)
    assert total.accepted_per_position == [1, 0, 0] and total.num_generated == 4 and total.target_forwards == 2
