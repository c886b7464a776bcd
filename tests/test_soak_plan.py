"""The soak's schedule (bench/soak_plan.py) keeps the rules that make its checks mean something: each
fault lands in a generation it can reach, the same step never fails twice (that is a poisoned batch,
checked on its own), and every kind of the matrix is drawn."""

from __future__ import annotations

import pytest

from bench.soak_plan import CHECKPOINT_EVERY, KINDS, LAST_STEP, PARTITION_KINDS, STRAGGLER_STEPS, WORLD_SIZE, plan


@pytest.mark.parametrize("seed", range(8))
def test_every_run_keeps_the_rules(seed: int) -> None:
    runs = plan(seed, faults=110)
    assert sum(len(r.faults) for r in runs) >= 110
    for run in runs:
        faults = run.faults
        generation = 0
        for position, fault in enumerate(faults):
            assert fault.generation == generation, "one generation per interrupting fault before it"
            generation += fault.interrupts
            assert fault.step <= LAST_STEP
            if fault.kind == "partition":
                assert position == 0, "the namespaced node is in the group only in the first generation"
            if fault.kind in ("storage_outage", "disk_full"):
                assert position == len(faults) - 1
            if fault.kind == "bitflip":
                # the self-check replays step s on rank (s / every) mod W: only that flip is caught
                assert fault.step % CHECKPOINT_EVERY == 0 and fault.rank == fault.step // CHECKPOINT_EVERY % WORLD_SIZE
            if fault.kind == "straggler":
                follower = faults[position + 1]
                assert follower.interrupts and follower.step - fault.step >= STRAGGLER_STEPS, (
                    "its generation ends soon after"
                )
            if fault.on_restart or fault.kind == "crash_after_restart":
                assert faults[position - 1].interrupts
        failed_at = [f.step - 1 for f in faults if f.interrupts and f.expect.cause != "node_lost" and not f.action]
        assert len(failed_at) == len(set(failed_at)), f"run {run.index}: the same step fails twice: {failed_at}"
        steps = [f.step for f in faults if f.kind != "crash_after_restart"]
        assert steps == sorted(steps)


def test_the_draw_covers_the_whole_matrix_and_depends_only_on_the_seed() -> None:
    drawn = {f.kind for r in plan(3, faults=110) for f in r.faults}
    assert drawn == set(KINDS)
    assert plan(3, faults=110) == plan(3, faults=110)
    assert plan(3, faults=110) != plan(4, faults=110)
    without = {f.kind for r in plan(3, faults=110, partitions=False) for f in r.faults}
    assert not without & PARTITION_KINDS


def test_a_damaged_checkpoint_is_followed_by_a_crash_that_would_resume_from_it() -> None:
    damages = [f for r in plan(5, faults=110) for f in r.faults if f.damaged_step is not None]
    assert len(damages) >= 5
    for fault in damages:
        assert fault.damaged_step is not None
        corrupt, crash = fault.injected
        assert corrupt["at_step"] == fault.damaged_step and corrupt["generation"] == fault.generation
        assert crash["kind"] == "crash" and crash["at_step"] == fault.damaged_step + 3
