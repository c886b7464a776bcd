"""Supervisors scale out on Temporal itself: three supervisor worker processes on one task queue
before 64 real node hubs (sim/hub_farm.py, two emulated ranks each, rank 0 committing real
checkpoints). The worker running the generation's monitor is SIGKILLed mid-generation; Temporal
retries the monitor on another worker, which reads each node's stream from where the dead one's
last acknowledgement left it. The run loses no step report, no interruption record and no
checkpoint verdict."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from temporalio.client import WorkflowHandle

from stayalive.core.run.lifecycle import RunState
from stayalive.core.run.spec import RunSpec
from stayalive.core.run.timeline import Cause
from stayalive.sim.hub_farm import farm_command, farm_spec, node_name, until
from stayalive.workers.devstack import DevStack, free_port
from stayalive.workers.secret import create_secret
from stayalive.workers.temporal import connect, plain
from stayalive.workflows.run import RunWorkflow
from tests.helpers import start, steps_judged

NODES = 64
RANKS_PER_NODE = 2
SPARES = 2
SUPERVISORS = 3
INTERVAL = 4  # rank 0 commits a checkpoint every 4 steps
CRASHED, CRASH_AT = 101, 24  # a rank of n00050, once the monitor's worker is gone
TARGET = 40
# Generation 0 commits 4 … 20 (every rank waits at step 24 for the dead one), generation 1 resumes
# from 20 and commits 24 … 40.
COMMITTED = [*range(INTERVAL, CRASH_AT, INTERVAL), *range(CRASH_AT, TARGET + 1, INTERVAL)]
# Every step each generation's ranks all completed: 1 … 23, then 21 … 40.
STEPS = (CRASH_AT - 1) + (TARGET - (CRASH_AT - INTERVAL))


@pytest.fixture(scope="module")
async def supervised_farm(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[DevStack, dict[str, str]]]:
    """The dev server, three supervisor workers (name → its /metrics) and a farm of 66 nodes."""
    state = tmp_path_factory.mktemp("supervisors")
    names = [node_name(i) for i in range(NODES + SPARES)]
    dev = DevStack(state_dir=state, nodes=names, ui_port=None, port=free_port(), metrics_port=free_port())
    create_secret(dev.secret_file)
    metrics = {"supervisor": dev.metrics_url}
    try:
        dev.start_temporal()
        dev.start_supervisor()
        for index in range(1, SUPERVISORS):
            port = free_port()
            dev.start_supervisor(f"supervisor-{index}", port)
            metrics[f"supervisor-{index}"] = f"http://127.0.0.1:{port}/metrics"
        dev.spawn("farm", farm_command(dev, 0, len(names), NODES, state / "events.jsonl"))
        await dev.ready(timeout=120)
        yield dev, metrics
    finally:
        dev.stop()


def spec(root: Path) -> RunSpec:
    return farm_spec(
        "scale-out",
        NODES,
        RANKS_PER_NODE,
        SPARES,
        0.5,
        target_step=TARGET,
        checkpoint={"root": str(root), "interval": f"{INTERVAL} steps"},
        faults=[{"kind": "crash", "rank": CRASHED, "at_step": CRASH_AT, "generation": 0}],
    )


async def monitoring_worker(handle: WorkflowHandle, dev: DevStack) -> str:
    """The stack's name of the supervisor process whose worker runs the generation's monitor."""
    described = await handle.describe()
    (monitor,) = [a for a in described.raw_description.pending_activities if a.activity_type.name == "monitor_run"]
    pid = int(monitor.last_worker_identity.split("@", 1)[0])  # the SDK's identity: pid@host
    (name,) = [name for name, process in dev.processes.items() if process.pid == pid]
    return name


async def test_a_supervisor_killed_mid_generation_loses_no_step_report_record_or_verdict(
    supervised_farm: tuple[DevStack, dict[str, str]], tmp_path: Path
) -> None:
    dev, metrics = supervised_farm
    client = await connect(plain(dev.address))
    handle = await start(client, spec(tmp_path), "scale-out")

    async def judged(step: int) -> bool:
        return any(c.step == step and c.validated for c in await handle.query(RunWorkflow.checkpoints))

    await until(lambda: judged(2 * INTERVAL), 120, f"the verdict on step {2 * INTERVAL}")
    victim = await monitoring_worker(handle, dev)
    judged_by_victim = await asyncio.to_thread(steps_judged, metrics.pop(victim), handle.id)
    dev.kill(victim)

    result = await asyncio.wait_for(handle.result(), timeout=180)
    assert result.state == RunState.COMPLETED, result.failure
    assert result.final_step == TARGET
    (crash,) = result.interruptions
    assert (crash.cause, crash.node, crash.rank) == (Cause.CRASH, node_name(CRASHED // RANKS_PER_NODE), CRASHED)
    # Every checkpoint of generation 0 was judged, those after the kill by the retried keeper: the
    # restart resumed from the newest.
    assert crash.resumed_from == CRASH_AT - INTERVAL

    records = await handle.query(RunWorkflow.checkpoints)
    status = await handle.query(RunWorkflow.status_query)
    assert all(c.validated for c in records), [c.reason for c in records if not c.validated]
    assert {c.step for c in records} <= set(COMMITTED)
    assert len(records) + status.deleted_checkpoints.count == len(COMMITTED), "a verdict per checkpoint committed"

    # Steps the dead worker had judged, and those its successor and the next generation's monitor
    # judged: a monitor that took over after the dead one's acknowledged place misses none (it may
    # judge again the few read since the last acknowledgement).
    judged_after = [await asyncio.to_thread(steps_judged, url, handle.id) for url in metrics.values()]
    assert judged_by_victim > 0, "the killed worker was monitoring the generation"
    assert judged_by_victim + sum(judged_after) >= STEPS, (judged_by_victim, judged_after)
