"""Killing a process of the stack mid-run loses nothing: the run completes with its whole timeline."""

from __future__ import annotations

import asyncio
from pathlib import Path

from temporalio.client import Client

from stayalive.core.run.lifecycle import RunState
from stayalive.core.run.timeline import Cause
from stayalive.workers.devstack import DevStack
from stayalive.workflows.run import RunWorkflow
from tests.helpers import start, tiny_spec, wait_for_step, wait_until


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


async def test_node_agent_killed_mid_run(client: Client, stack: DevStack, checkpoint_root: Path) -> None:
    spec = tiny_spec(checkpoint_root, target_step=150, health={"node_heartbeat_timeout": "5s"})
    handle = await start(client, spec, "kill-agent")
    await wait_for_step(client, handle, 30)
    stack.kill("agent-n2")  # its ranks die with it; n1's ranks see their peers vanish
    try:
        result = await handle.result()
    finally:
        stack.start_agent("n2")  # back for the tests that follow: it registers and is self-tested
    assert result.state == RunState.COMPLETED
    assert [(i.cause, i.node) for i in result.interruptions] == [(Cause.NODE_LOST, "n2")]
    lost = result.interruptions[0]
    assert "replaced n2 with spare n3" in lost.actions
    status = await handle.query(RunWorkflow.status_query)
    assert status.nodes == ["n1", "n3"]
    committed = [c for c in status.checkpoints if "never committed" not in c.reason]  # a write the kill tore
    assert all(c.validated for c in committed), "no committed checkpoint lost"


async def test_temporal_server_killed_and_restarted_on_its_database(
    client: Client, stack: DevStack, checkpoint_root: Path
) -> None:
    spec = tiny_spec(checkpoint_root, target_step=150, faults=[{"kind": "crash", "rank": 2, "at_step": 15}])
    handle = await start(client, spec, "kill-temporal")
    await wait_until(handle, lambda s: len(s.interruptions) == 1 and s.state == RunState.RUNNING)
    before = await handle.query(RunWorkflow.status_query)
    stack.kill("temporal")
    await asyncio.sleep(2)  # ranks train on; every worker is cut off from the server
    stack.start_temporal()

    result = await handle.result()
    assert result.state == RunState.COMPLETED
    assert [(i.cause, i.rank) for i in result.interruptions] == [(Cause.CRASH, 2)]
    assert result.interruptions[0].at == before.interruptions[0].at, "the interruption record survived the restart"
    status = await handle.query(RunWorkflow.status_query)
    committed = {c.step for c in before.checkpoints}
    assert committed <= {c.step for c in status.checkpoints}, "no checkpoint record lost"
    assert max(c.step for c in status.checkpoints if c.validated) == 150
