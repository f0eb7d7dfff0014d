"""The pair actors' start shown on the driver (cluster.startup): every actor's loading and calibration lines reach a
watch on the driver, named by actor, through the board; a silent start still says it is waiting."""

from __future__ import annotations

import time

import pytest

from cluster import startup as watch
from cluster.pair_actor import make_workers, profile_of, release
from cluster.runtime import init_ray

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray_up():
    init_ray(num_cpus=2)


def test_the_actors_start_and_calibration_reach_the_driver_as_they_happen(ray_up):
    lines: list[str] = []
    with watch.Watch(lines.append, every_s=0.2):
        workers = make_workers(2, "tiny-random", "fp32", cpus_per_actor=0.5)
        profile_of(workers[0])
    try:
        actors = {line.split(":")[0] for line in lines if line.startswith("actor ")}
        assert len(actors) == 2 and {a.split(" (")[0] for a in actors} == {"actor 1", "actor 2"}, lines
        for actor in actors:
            mine = [line.removeprefix(actor + ": ") for line in lines if line.startswith(actor + ":")]
            assert mine[0] == "actor process up: loading the engine's code"
            assert any(line.startswith("starting the CPU engine on tiny-random (fp32): done in") for line in mine)
        assert any("calibrating: timing the draft step" in line and "done in" in line for line in lines)
    finally:
        release(workers)


def test_a_watch_that_hears_nothing_says_it_is_waiting(ray_up):
    lines: list[str] = []
    with watch.Watch(lines.append, "nobody", every_s=0.05, quiet_s=0.2):
        time.sleep(0.6)
    assert lines and all(line.startswith("waiting for nobody: ") for line in lines)
    assert "(Ray is starting their processes)" in lines[0]
