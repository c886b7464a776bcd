"""When a run gives up: failures coming faster than the spec's `failure_limit`, never planned
interruptions and never the run's length (real ranks, real Temporal)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from temporalio.client import Client, WorkflowFailureError

from stayalive.core.run.lifecycle import RunState
from stayalive.core.run.status import RunStatus
from stayalive.core.run.timeline import Cause
from stayalive.workers.devstack import process_alive
from stayalive.workflows.fleet import FleetWorkflow, fleet_handle
from stayalive.workflows.run import RunWorkflow
from tests.helpers import rank_pids, start, tiny_spec, wait_until

ONE_PER_HOUR = {"failures": 1, "window": "1h"}
PAUSES = 100
POLL_S = 0.05  # a hundred round trips: the default 0.3 s poll would be most of the test's time


async def test_a_second_failure_within_the_window_fails_the_run(client: Client, checkpoint_root: Path) -> None:
    crashes = [
        {"kind": "crash", "rank": 3, "at_step": 15, "generation": 0},  # on n2: the spare n3 takes its place
        {"kind": "crash", "rank": 0, "at_step": 25, "generation": 1},  # on n1, minutes later
    ]
    spec = tiny_spec(checkpoint_root, target_step=200, faults=crashes, failure_limit=ONE_PER_HOUR)
    handle = await start(client, spec, "failure-limit")
    result = await handle.result()
    assert result.state == RunState.FAILED
    assert [i.cause for i in result.interruptions] == [Cause.CRASH, Cause.CRASH]
    assert result.final_step < 200
    assert "2 failures within 1h" in result.failure and "failure_limit: at most 1" in result.failure
    last = result.interruptions[-1]
    assert result.failure in last.actions, "the verdict is on the timeline, with the failure that tipped it"
    rate = await fleet_handle(client).query(FleetWorkflow.failure_rate)
    assert rate.failures >= 2 and rate.gpu_hours > 0, "the fleet's baseline learned the run's failures"


def running_in(generation: int) -> Callable[[RunStatus], bool]:
    return lambda status: status.state == RunState.RUNNING and status.generation == generation


async def test_a_hundred_pauses_never_count_against_the_limit(client: Client, checkpoint_root: Path) -> None:
    # One rank on each of two nodes: every pause stops and every resume relaunches them, and half the
    # ranks take the same round trips at half the host's time (a hundred of them are most of the test).
    spec = tiny_spec(checkpoint_root, target_step=1_000_000, failure_limit=ONE_PER_HOUR, world_size=2, ranks_per_node=1)
    handle = await start(client, spec, "hundred-pauses")
    await wait_until(handle, lambda s: s.state == RunState.RUNNING)
    for generation in range(1, PAUSES + 1):
        await handle.signal(RunWorkflow.pause, f"planned pause {generation}")
        await wait_until(handle, lambda s: s.state == RunState.STOPPED, timeout=60, every=POLL_S)
        await handle.signal(RunWorkflow.resume)
        status = await wait_until(handle, running_in(generation), timeout=60, every=POLL_S)
    assert status.failure == ""
    assert [i.cause for i in status.interruptions] == [Cause.PAUSE] * PAUSES
    ranks = [pid for pids in (await rank_pids(client, handle)).values() for pid in pids.values()]
    await handle.cancel()
    with pytest.raises(WorkflowFailureError):
        await handle.result()
    # Its ranks train towards a million steps: a cancelled run must not leave them eating the host.
    deadline = time.monotonic() + 30
    while (alive := [pid for pid in ranks if process_alive(pid)]) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    assert not alive, f"ranks {alive} outlived their cancelled run"
