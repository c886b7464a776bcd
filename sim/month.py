"""A month of one run: the real RunWorkflow and FleetWorkflow under the time-skipping test server,
the simulated cluster reading the server's clock, failures drawn from a measured mix.

Failures arrive over the time ranks train (TrainingTimeSchedule): a job fails while it computes, and
its restart is what the failure costs. Planned maintenance comes by the calendar: an operator (this
module's Operator) drains the node at its time. Nothing waits on real time: a simulated monitor goes
quiet until its next happening (core.messages.events.Quiet), the workflow waits on a timer, and the server
jumps to it. What `python -m bench.month` runs and tests/sim checks at a smaller size.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
from temporalio.api.history.v1 import HistoryEvent
from temporalio.client import WorkflowExecutionStatus, WorkflowHandle, WorkflowUpdateStage
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

from stayalive.core.run.lifecycle import RunState
from stayalive.core.run.spec import RunSpec
from stayalive.core.run.status import RunStatus
from stayalive.sim import history
from stayalive.sim.cluster import ENDED, Fault, FaultKind, SimulatedCluster
from stayalive.sim.failure_mix import Draw, Kind
from stayalive.sim.server_clock import ServerClock
from stayalive.sim.workers import register, register_search_attributes, simulated_workers
from stayalive.workflows.fleet import fleet_handle
from stayalive.workflows.run import TASK_QUEUE, DrainNode, RunWorkflow

DAY_S = 86_400.0
RANKS_PER_NODE = 8
STEP_S = 1.0
BLOCKING_S = 30.0  # C: the checkpoint cost assumed at 16,384 GPUs (docs/architecture.md §16)
STARTUP_S = 600.0  # R: the restart assumed at 16,384 GPUs, reschedule to first step (docs/architecture.md §16)
REJOIN_S = 60.0  # survivors of a hold re-form the group and go on, in memory
HANG_DETECTED_S = 120.0  # the step timeout before the run monitor calls it a hang
SPARES_SHARE = 0.03  # hot spares, a share of the nodes (docs/architecture.md §16)
NODE_HEARTBEAT_S = 30.0
AWAKE_S = 3600.0  # the operator's clock advances the server an hour at a time between drains

# What each kind of the mix does to a generation in the simulator (the mix's own table, MAPPING in
# sim/failure_mix.py, says which root cause is which kind).
FAULTS: dict[Kind, tuple[FaultKind, bool]] = {
    "crash": ("crash", False),
    "node_lost": ("node_lost", False),
    "hang": ("hang", False),
    "straggler": ("straggler", False),
    "slowdown": ("slowdown", False),
    "sdc_transient": ("sdc", False),
    "sdc_deterministic": ("sdc", True),  # the node repeats it: its self-test fails
    "checkpoint_damaged": ("damage", False),
}


@dataclass(frozen=True)
class TrainingTimeSchedule:
    """Faults at fixed points of the run's training time (`Draw.at_s`, seconds the ranks trained), on
    the node a draw names (its index in the generation's nodes)."""

    draws: Sequence[Draw]
    ranks_per_node: int = RANKS_PER_NODE

    def plan(self, generation: int, uptime_s: float, step_seconds: float) -> list[Fault]:
        faults = []
        for draw in self.draws:
            if draw.kind == "drain" or draw.at_s <= uptime_s:
                continue
            kind, lasting = FAULTS[draw.kind]
            after = max(1, math.ceil((draw.at_s - uptime_s) / step_seconds))
            faults.append(Fault(kind, after, rank=draw.node * self.ranks_per_node, ratio=1.5, lasting=lasting))
        return faults

    def pace(self, generation: int) -> float | None:
        return None


def crashes_every(mtbf_s: float, restart_s: float, training_s: float, seed: int) -> list[Draw]:
    """Crashes whose wall-clock MTBF is `mtbf_s` when each costs `restart_s`: over `training_s` of
    training, exactly training_s / (mtbf_s - restart_s) of them (rounded), each uniformly placed. The
    count is fixed, not drawn: the reference table (docs/architecture.md §14) is an expectation, and a
    Poisson count's spread (±6% at 233) would move the overhead by more than the half point it is
    compared to."""
    rng = np.random.default_rng(seed)
    count = round(training_s / (mtbf_s - restart_s))
    at = np.sort(rng.uniform(0.0, training_s, size=count))
    nodes = rng.integers(1 << 20, size=count)
    return [Draw(float(t), "crash", int(n), "reference table") for t, n in zip(at, nodes, strict=True)]


@dataclass(frozen=True)
class Month:
    """One simulated run: its width, its failures (unexpected ones on training time, planned drains
    on the calendar), its interval, and how long to train."""

    name: str
    nodes: int
    draws: Sequence[Draw]
    target_step: int
    interval: str = "auto"
    prior_mtbf_s: float | None = None  # None: the fleet's measured rate, as a run would start
    stall_s: float = 1800.0  # real seconds before the run counts as stuck

    def spec(self, root: Path) -> RunSpec:
        spares = max(2, math.ceil(self.nodes * SPARES_SHARE))
        return RunSpec.model_validate(
            {
                "name": self.name,
                "world_size": self.nodes * RANKS_PER_NODE,
                "ranks_per_node": RANKS_PER_NODE,
                "nodes": [f"n{i:04d}" for i in range(self.nodes)],
                "spare_nodes": [f"s{i:03d}" for i in range(spares)],
                "min_nodes": self.nodes,
                "entrypoint": ["python", "-m", "stayalive.training.train"],
                "target_step": self.target_step,
                "checkpoint": {
                    "root": str(root),
                    "interval": self.interval,
                    "prior_mtbf": self.prior_mtbf_s,
                    "max_interval": 4 * 3600.0,
                },
                "health": {"node_heartbeat_timeout": NODE_HEARTBEAT_S},
                "paging": {"jsonl": str(pages_file(root))},
                "failure_limit": {"failures": 20, "window": "6h"},
            }
        )

    @property
    def drains(self) -> list[Draw]:
        return [d for d in self.draws if d.kind == "drain"]


def pages_file(root: Path) -> Path:
    """Where a month's run sends its pages (its spec's JSONL sink)."""
    return root / "pages.jsonl"


@dataclass
class MonthRan:
    """What one month left: the run's final state, the cluster's record, and the histories."""

    month: Month
    root: Path  # the checkpoint root its spec names, and its pages' file
    status: RunStatus
    cluster: SimulatedCluster
    run: list[list[HistoryEvent]]  # the run's chain of executions
    fleet: list[list[HistoryEvent]]
    costs: list[history.Cost]  # what each interruption cost the histories, as sim/history counts it
    real_s: float  # seconds this machine took


async def simulate(month: Month, root: Path, server: Path) -> MonthRan:
    """Run `month` on a fresh time-skipping test server (the `temporal-test-server` binary at `server`)."""
    began = time.monotonic()
    async with await WorkflowEnvironment.start_time_skipping(
        test_server_existing_path=str(server), data_converter=pydantic_data_converter
    ) as env:
        client = env.client
        await register_search_attributes(client)
        clock = ServerClock(client)
        await clock.read()
        spec = month.spec(root)
        cluster = SimulatedCluster(
            [*spec.nodes, *spec.spare_nodes],
            TrainingTimeSchedule(month.draws),
            step_seconds=STEP_S,
            startup_seconds=STARTUP_S,
            rejoin_seconds=REJOIN_S,
            checkpoint_blocking_seconds=BLOCKING_S,
            detect_after={"hang": HANG_DETECTED_S, "node_lost": NODE_HEARTBEAT_S},
            clock=clock,
        )
        async with asyncio.timeout(month.stall_s), simulated_workers(client, cluster, server=clock):
            await register(client, spec.nodes, spec.spare_nodes)
            handle = await client.start_workflow(RunWorkflow.run, spec, id=month.name, task_queue=TASK_QUEUE)
            operator = Operator(env, client.get_workflow_handle(handle.id), clock, cluster)
            await operator.run(month.drains)
            status: RunStatus = await client.get_workflow_handle(handle.id).query(RunWorkflow.status_query)
        run = await history.chain(client, handle.id)
        fleet = await history.chain(client, fleet_handle(client).id)
    interruptions = what_interrupted(cluster)
    costs = history.costs(interruptions, [e for s in run for e in s], [e for s in fleet for e in s], empty_tasks=False)
    return MonthRan(month, root, status, cluster, run, fleet, costs, time.monotonic() - began)


def what_interrupted(cluster: SimulatedCluster) -> list[tuple[float, str]]:
    """The marks of interruptions: failures, the operator's drains, and holds nobody marked (the
    straggler ladder's evictions). A finding interrupts nothing: the run goes on."""
    drains = [at for at, what in cluster.marks if what == "drain"]
    evictions = [(at, "eviction") for at in cluster.holds if not any(0 <= at - d < 60 for d in drains)]
    kept = [(at, what) for at, what in cluster.marks if what in ("drain", *ENDED)]
    return sorted([*kept, *evictions])


@dataclass
class Operator:
    """The person at the run: drains each node whose maintenance is due, on the calendar, and
    otherwise lets the server's clock run (an hour at a time) until the run ends."""

    env: WorkflowEnvironment
    handle: WorkflowHandle
    clock: ServerClock
    cluster: SimulatedCluster

    async def run(self, drains: list[Draw]) -> None:
        start = await self.clock.read()
        for draw in drains:
            if not await self._advance_to(start + draw.at_s):
                return
            await self._drain(draw)
        while not await self._closed():
            await self.env.sleep(timedelta(seconds=AWAKE_S))

    async def _advance_to(self, at: float) -> bool:
        """Let the server's clock run to `at`; False if the run ended first."""
        while (now := await self.clock.read()) < at:
            if await self._closed():
                return False
            await self.env.sleep(timedelta(seconds=min(AWAKE_S, at - now)))
        return not await self._closed()

    async def _drain(self, draw: Draw) -> None:
        """Drain the draw's node once the run is RUNNING (maintenance waits for a restart to finish)."""
        while True:
            status: RunStatus = await self.handle.query(RunWorkflow.status_query)
            if status.state.terminal:
                return
            if status.state == RunState.RUNNING:
                break
            await self.env.sleep(timedelta(seconds=60))
        node = status.nodes[draw.node % len(status.nodes)]
        self.cluster.mark("drain")
        await self.handle.start_update(
            RunWorkflow.drain_node,
            DrainNode(node=node, reason="planned maintenance"),
            wait_for_stage=WorkflowUpdateStage.ACCEPTED,
        )

    async def _closed(self) -> bool:
        description = await self.handle.describe()
        return description.status not in (WorkflowExecutionStatus.RUNNING, WorkflowExecutionStatus.CONTINUED_AS_NEW)
