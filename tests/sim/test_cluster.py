"""The simulated cluster's plans: which steps a generation checkpoints, as ranks would, before and
after an `interval` command (a rank's checkpoint clock counts from its last checkpoint)."""

from __future__ import annotations

import pytest

from stayalive.core.protocol.telemetry import Command
from stayalive.core.run.launch import Launch
from stayalive.sim.cluster import FailureSchedule, Fault, SimulatedCluster
from stayalive.sim.failure_mix import Draw
from stayalive.sim.month import TrainingTimeSchedule

STEP_S = 1.0


def cluster_with(now: list[float]) -> SimulatedCluster:
    cluster = SimulatedCluster(["n1"], FailureSchedule(), step_seconds=STEP_S, clock=lambda: now[0])
    env = {
        "STAYALIVE_CHECKPOINT_DIR": "/ckpt/run",
        "STAYALIVE_TARGET_STEP": "100",
        "STAYALIVE_CHECKPOINT_EVERY_SECONDS": "10",
    }
    launch = Launch(
        run_id="r", generation=0, nodes=["n1"], ranks_per_node=1, entrypoint=["x"], env=env, answer_within=5
    )
    cluster.launch(launch)
    return cluster


@pytest.mark.parametrize(
    ("retunes", "expected"),
    [
        pytest.param([], list(range(10, 101, 10)), id="the launch's interval to the target"),
        pytest.param([(24.5, 30.0)], [10, 20, 50, 80, 100], id="longer from step 26: 30 steps after step 20"),
        pytest.param([(24.5, 3.0)], [10, 20, *range(26, 100, 3), 100], id="shorter: due at once, then every 3"),
        pytest.param(
            [(24.5, 30.0), (60.5, 10.0)], [10, 20, 50, 62, 72, 82, 92, 100], id="twice: each from its own step"
        ),
    ],
)
def test_an_interval_command_moves_the_plan_from_the_next_step(
    retunes: list[tuple[float, float]], expected: list[int]
) -> None:
    now = [0.0]
    cluster = cluster_with(now)
    for seq, (at, seconds) in enumerate(retunes, start=1):
        now[0] = at  # step int(at) + 1 is done (step 1 at t = 0): the command lands at the one after
        cluster.command("r", Command(seq=seq, kind="interval", seconds=seconds))
    generation = cluster.current("r")
    assert generation is not None
    assert generation.checkpoint_steps() == expected


@pytest.mark.parametrize(
    ("uptime_s", "expected"),
    [
        pytest.param(0.0, [("crash", 100), ("damage", 250), ("sdc", 400)], id="a fresh run meets every draw"),
        pytest.param(150.0, [("damage", 100), ("sdc", 250)], id="after 150 s of training: what is left, sooner"),
        pytest.param(400.0, [], id="past the last draw: nothing"),
    ],
)
def test_failures_come_at_points_of_training_time(uptime_s: float, expected: list[tuple[str, int]]) -> None:
    draws = [
        Draw(100.0, "crash", 0, "t"),
        Draw(250.0, "checkpoint_damaged", 0, "t"),
        Draw(300.0, "drain", 0, "t"),  # on the calendar: the operator's, not the schedule's
        Draw(400.0, "sdc_deterministic", 1, "t"),
    ]
    faults = TrainingTimeSchedule(draws).plan(0, uptime_s, step_seconds=1.0)
    assert [(f.kind, f.after_steps) for f in faults] == expected
    assert all(f.lasting == (f.kind == "sdc") for f in faults)


def test_a_generation_trains_until_its_fault_and_commits_nothing_after_it() -> None:
    now = [0.0]
    cluster = cluster_with(now)
    generation = cluster.current("r")
    assert generation is not None
    generation.faults = [Fault("damage", 15), Fault("crash", 45)]
    generation.blocking_seconds = 6.0  # the checkpoint of step 40 is still being written at step 45 ... 46
    assert generation.checkpoint_steps() == [10, 20, 30]
    assert [s for s in generation.checkpoint_steps() if generation.damaged(s)] == [20]
    assert generation.trained_seconds == 45 * STEP_S
    assert generation.ended_at() == generation.at(45)
