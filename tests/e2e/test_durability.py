"""Killing a process of the stack mid-run loses nothing: the run completes with its whole timeline."""

from __future__ import annotations

import asyncio
from pathlib import Path

from temporalio.client import Client

from core.run import Cause, RunState
from tests.helpers import start, tiny_spec, wait_until
from workers.devstack import DevStack
from workflows.run import RunWorkflow


async def test_supervisor_worker_killed_mid_run(client: Client, stack: DevStack, checkpoint_root: Path) -> None:
    spec = tiny_spec(
        checkpoint_root,
        target_step=120,
        faults=[{"kind": "crash", "rank": 1, "at_step": 15}],
        checkpoint={"root": str(checkpoint_root), "interval": "20 steps"},
    )
    handle = await start(client, spec, "kill-supervisor")
    # After the injected crash is on the timeline and the next generation trains, take the supervisor away.
    await wait_until(handle, lambda s: len(s.interruptions) == 1 and s.state == RunState.RUNNING and s.generation == 1)
    stack.kill("supervisor")
    await asyncio.sleep(3)  # ranks keep training; nobody is deciding anything
    stack.start_supervisor()

    result = await handle.result()
    assert result.state == RunState.COMPLETED
    assert result.final_step == 120
    assert [(i.cause, i.node, i.rank) for i in result.interruptions] == [(Cause.CRASH, "n1", 1)]
    assert result.interruptions[0].resumed_from == 0  # the crash came before the first checkpoint (step 20)
    status = await handle.query(RunWorkflow.status_query)
    steps = sorted(c.step for c in status.checkpoints if c.validated)
    assert steps[-1] == 120
    assert all(c.validated for c in status.checkpoints), [c.reason for c in status.checkpoints if not c.validated]
