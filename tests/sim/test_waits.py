"""A simulated activity's wait ends on a cancel, whenever the cancel lands: a swallowed one leaves the
activity waiting forever and its worker unable to shut down."""

from __future__ import annotations

import asyncio

import pytest
from temporalio.testing import ActivityEnvironment

from stayalive.sim.cluster import FailureSchedule, SimulatedCluster
from stayalive.sim.monitor import until_cancelled


@pytest.mark.parametrize("turns", range(6))
async def test_a_cancel_landing_as_the_cluster_changes_ends_the_wait(turns: int) -> None:
    cluster = SimulatedCluster(["n1"], FailureSchedule())
    activity = ActivityEnvironment()
    waiting = asyncio.ensure_future(activity.run(until_cancelled, cluster))
    await asyncio.sleep(0.01)  # waiting on the cluster's `changed` now
    cluster.notify()
    for _ in range(turns):  # the cancel lands this many loop turns after the change
        await asyncio.sleep(0)
    activity.cancel()
    with pytest.raises(asyncio.CancelledError):
        async with asyncio.timeout(2):
            await waiting
