"""cluster.runtime: a bad engine switch is refused by name before Ray starts; the switches that are set travel to the
actors in the runtime environment."""

from __future__ import annotations

import pytest

from cluster import runtime


@pytest.mark.parametrize("name,value,says", [("SPECTUNE_SCRIPTED_STEP", "on", "must be 0 or 1, got 'on'"),
                                             ("SPECTUNE_FUSED", "yes", "must be auto, 0 or 1, got 'yes'")])
def test_a_bad_engine_switch_fails_before_ray_starts(monkeypatch, name, value, says):
    import ray

    monkeypatch.setenv(name, value)
    started = ray.is_initialized()
    with pytest.raises(ValueError, match=f"{name} {says}"):
        runtime.init_ray(num_cpus=1)
    assert ray.is_initialized() == started


def test_the_engine_switches_are_the_ones_the_engines_read():
    from policies import fused
    from workers.models import fast_step

    assert set(runtime.ENGINE_ENV) == {fused.ENV, fast_step.ENV}
