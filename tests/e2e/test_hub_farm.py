"""Real node hubs at width on one host (sim/hub_farm.py): 32 nodes of 4 emulated ranks each, before
the real supervisor worker on a dev server of this module's own. A rank's crash relaunches the run
on a spare in place of its node; a collective hang is pinned on the one rank that never entered the
all-reduce, from every rank's stack dump; every node acknowledges every generation."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from temporalio.client import WorkflowHandle

from stayalive.core.run.spec import RunSpec
from stayalive.core.run.timeline import Cause
from stayalive.sim.hub_farm import farm_command, farm_spec, node_name, until
from stayalive.workers.devstack import DevStack, free_port
from stayalive.workers.secret import create_secret
from stayalive.workers.temporal import connect, plain
from stayalive.workflows.run import TASK_QUEUE, RunWorkflow
from tests.helpers import steps_judged

NODES = 32
RANKS_PER_NODE = 4
SPARES = 2
CRASHED = 77  # a rank of n00019
CULPRIT = 101  # a rank of n00025


@pytest.fixture(scope="module")
async def farm(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[DevStack]:
    state = tmp_path_factory.mktemp("farm")
    names = [node_name(i) for i in range(NODES + SPARES)]
    stack = DevStack(state_dir=state, nodes=names, ui_port=None, port=free_port(), metrics_port=free_port())
    create_secret(stack.secret_file)
    try:
        stack.start_temporal()
        stack.start_supervisor()
        stack.spawn("farm", farm_command(stack, 0, len(names), NODES, state / "events.jsonl"))
        await stack.ready(timeout=120)
        yield stack
    finally:
        stack.stop()


def spec(root: Path) -> RunSpec:
    return farm_spec(
        "farm",
        NODES,
        RANKS_PER_NODE,
        SPARES,
        0.5,
        target_step=1_000_000,
        checkpoint={"root": str(root), "interval": "1000000 steps"},
        faults=[
            {"kind": "crash", "rank": CRASHED, "at_step": 4, "generation": 0},
            {"kind": "collective_hang", "rank": CULPRIT, "at_step": 8, "generation": 1},
        ],
        health={"step_timeout": "5s"},
    )


def acknowledged(events: Path) -> Counter[int]:
    """How many nodes answered each generation's StartRanks."""
    lines = [json.loads(line) for line in events.read_text().splitlines()]
    return Counter(e["generation"] for e in lines if e["event"] == "acknowledged")


async def test_a_crash_and_a_hang_at_32_nodes_are_each_pinned_on_their_rank(farm: DevStack, tmp_path: Path) -> None:
    client = await connect(plain(farm.address))
    handle: WorkflowHandle[RunWorkflow, object] = await client.start_workflow(
        RunWorkflow.run, spec(tmp_path), id=f"farm-{int(time.time())}", task_queue=TASK_QUEUE
    )

    async def relaunched_twice() -> bool:
        return (await handle.query(RunWorkflow.status_query)).generation >= 2

    await until(relaunched_twice, 180, "the second relaunch")
    status = await handle.query(RunWorkflow.status_query)
    crash, hang = status.interruptions[:2]
    assert (crash.cause, crash.node, crash.rank) == (Cause.CRASH, node_name(CRASHED // RANKS_PER_NODE), CRASHED)
    assert (hang.cause, hang.node, hang.rank) == (Cause.HANG, node_name(CULPRIT // RANKS_PER_NODE), CULPRIT)
    assert hang.artifacts, "every rank's stacks, dumped before the relaunch"
    assert node_name(CRASHED // RANKS_PER_NODE) not in status.nodes and status.spares_used
    judged = await asyncio.to_thread(steps_judged, farm.metrics_url, handle.id)
    assert judged >= 8, "the steps of both generations, each in the monitor's judging-lag histogram"

    async def every_node_answered() -> bool:
        return acknowledged(farm.state_dir / "events.jsonl").get(2, 0) == NODES

    await until(every_node_answered, 30, "every node's answer to generation 2")
    assert acknowledged(farm.state_dir / "events.jsonl") == {0: NODES, 1: NODES, 2: NODES}
    await handle.terminate("test over")
