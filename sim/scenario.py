"""One simulated run through every kind of interruption the real path has, at any width: the
scenario tests/sim and `python -m bench.scale` both drive.

Generation by generation (each ends, and the next begins, where the previous line says):

    0  a rank crashes                    5  every rank slows down (the rack runs hot), then a rank crashes
    1  a node agent falls silent         6  a person drains a node
    2  a rank hangs in a collective      7  a person pauses the run, then resumes it
    3  a check finds corruption          8  a person forces a checkpoint, then rolls the run back to it;
    4  a rank straggles: S1, S2, evicted    a node's agent stops answering: the next launch loses it
                                         10 trains to the target step

Generations 4 and 6-8 step slowly, so that a person (this driver) can act on them while they run.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from temporalio.api.history.v1 import HistoryEvent
from temporalio.client import Client, WorkflowHandle

from stayalive.core.fleet.model import Quarantine
from stayalive.core.run.lifecycle import RunState
from stayalive.core.run.spec import RunSpec
from stayalive.core.run.status import RunResult, RunStatus
from stayalive.core.run.timeline import Cause
from stayalive.sim import history
from stayalive.sim.cluster import FailureSchedule, Fault, SimulatedCluster
from stayalive.sim.workers import register, simulated_workers
from stayalive.workflows.fleet import FleetWorkflow, fleet_handle
from stayalive.workflows.run import TASK_QUEUE, DrainNode, ResumeFrom, RunWorkflow

CHECKPOINT_EVERY = 100
FAULT_AFTER = 150  # steps past the resume step: one checkpoint, then 50 steps lost
FAST_S = 0.0002  # seconds per simulated step
SLOW_S = 0.01  # ... in the generations a person acts on
TARGET = 20_000  # far enough that an eviction at generation 4 pays back its restart
RANKS_PER_NODE = 8
SPARES = 8  # one for every node the scenario quarantines, and one more
# The timeline this scenario makes: each interruption's cause, in order.
CAUSES = [
    Cause.CRASH,
    Cause.NODE_LOST,
    Cause.HANG,
    Cause.SDC,
    Cause.DRAIN,  # the straggler's eviction
    Cause.CRASH,  # after the slowdown
    Cause.DRAIN,
    Cause.PAUSE,
    Cause.ROLLBACK,
    Cause.NODE_LOST,  # at launch
]


def schedule(world_size: int) -> FailureSchedule:
    """Ranks spread over the group, so each fault lands on a different node."""

    def rank(i: int) -> int:
        return (i * world_size // 7 + 3) % world_size

    return FailureSchedule(
        faults={
            0: [Fault("crash", FAULT_AFTER, rank=rank(0))],
            1: [Fault("node_lost", FAULT_AFTER, rank=rank(1))],
            2: [Fault("hang", FAULT_AFTER, rank=rank(2))],
            3: [Fault("sdc", FAULT_AFTER, rank=rank(3))],
            4: [Fault("straggler", 30, rank=rank(4), ratio=2.0)],
            5: [Fault("slowdown", 30, ratio=1.3), Fault("crash", FAULT_AFTER, rank=rank(5))],
        },
        step_seconds={4: SLOW_S, 6: SLOW_S, 7: SLOW_S, 8: SLOW_S},
    )


def spec(nodes: int, root: Path) -> RunSpec:
    group = [f"n{i:04d}" for i in range(nodes)]
    return RunSpec.model_validate(
        {
            "name": f"every-kind-{nodes}",
            "world_size": nodes * RANKS_PER_NODE,
            "ranks_per_node": RANKS_PER_NODE,
            "nodes": group,
            "spare_nodes": [f"s{i:02d}" for i in range(SPARES)],
            "min_nodes": nodes,
            "entrypoint": ["python", "-m", "stayalive.training.train"],
            "target_step": TARGET,
            "checkpoint": {"root": str(root), "interval": f"{CHECKPOINT_EVERY} steps"},
            "health": {"node_heartbeat_timeout": "5s"},
        }
    )


@dataclass
class Driver:
    """A person at the run: drains, pauses, forces a checkpoint and rolls back, each while the
    generation meant for it runs; and, before the rollback, a node whose agent stops answering."""

    client: Client
    handle: WorkflowHandle
    cluster: SimulatedCluster
    silent: set[str] = field(default_factory=set)

    async def run(self) -> RunResult:
        status = await self._running(6)
        self.cluster.mark("drain")
        await self.handle.execute_update(RunWorkflow.drain_node, DrainNode(node=status.nodes[1], reason="fan failing"))
        await self._running(7)
        self.cluster.mark("pause")
        await self.handle.signal(RunWorkflow.pause, "maintenance window")
        await self._until(lambda s: s.state == RunState.STOPPED)
        await asyncio.sleep(0.2)
        await self.handle.signal(RunWorkflow.resume)
        status = await self._running(8)
        self.cluster.mark("force checkpoint")
        before = max(c.step for c in status.checkpoints)
        await self.handle.signal(RunWorkflow.force_checkpoint)
        status = await self._until(
            lambda s: max(c.step for c in s.checkpoints) > before and s.state == RunState.RUNNING
        )
        self.silent.add(status.nodes[2])  # its agent stops answering: the launch after the rollback loses it
        newest = max(c.step for c in status.checkpoints if c.resumable)
        self.cluster.mark("resume_from")
        await self.handle.execute_update(RunWorkflow.resume_from, ResumeFrom(step=newest))
        result: RunResult = await self.handle.result()
        return result

    async def _running(self, generation: int) -> RunStatus:
        return await self._until(lambda s: s.generation == generation and s.state == RunState.RUNNING)

    async def _until(self, ready: Callable[[RunStatus], bool], timeout: float = 120.0) -> RunStatus:
        deadline = time.monotonic() + timeout
        while True:
            status: RunStatus = await self.handle.query(RunWorkflow.status_query)
            if ready(status):
                return status
            if status.state.terminal or time.monotonic() > deadline:
                raise RuntimeError(f"the run never got there: {status.state}, generation {status.generation}")
            await asyncio.sleep(0.05)


@dataclass
class Ran:
    """One run of the scenario, and what it cost."""

    result: RunResult
    status: RunStatus
    quarantines: list[Quarantine]
    costs: list[history.Cost]  # one per marked interruption or finding, in order
    run: list[list[HistoryEvent]]  # the run's chain of executions
    fleet: list[list[HistoryEvent]]  # the fleet's
    relaunch_s: list[float]  # from each failure the monitor reported to the next launch
    register_s: float  # for every node of the cluster to register with the fleet at once
    cpu_s: float  # this process's CPU time for the run: the workers and the simulator


async def every_kind(client: Client, nodes: int, root: Path, stall_s: float = 600.0) -> Ran:
    """Run the scenario at `nodes` × 8 ranks (plus spares) on `client`'s server, from a fleet that
    learns of every node at once, and read back what it cost."""
    run_spec = spec(nodes, root)
    cluster = SimulatedCluster(
        [*run_spec.nodes, *run_spec.spare_nodes], schedule(run_spec.world_size), step_seconds=FAST_S
    )
    silent: set[str] = set()
    async with asyncio.timeout(stall_s), simulated_workers(client, cluster, silent=lambda: silent):
        began = time.monotonic()
        await register(client, run_spec.nodes, run_spec.spare_nodes)
        registered = time.monotonic() - began
        cpu = time.process_time()
        handle = await client.start_workflow(RunWorkflow.run, run_spec, id=f"every-kind-{nodes}", task_queue=TASK_QUEUE)
        result = await Driver(client, handle, cluster, silent).run()
        cpu = time.process_time() - cpu
        status: RunStatus = await handle.query(RunWorkflow.status_query)
        quarantines = await fleet_handle(client).query(FleetWorkflow.quarantines)
    run = await history.chain(client, handle.id)
    fleet = await history.chain(client, fleet_handle(client).id)
    costs = history.costs(cluster.marks, [e for s in run for e in s], [e for s in fleet for e in s])
    relaunch = cluster.relaunch_latencies(status.run_id)
    return Ran(result, status, quarantines, costs, run, fleet, relaunch, registered, cpu)
