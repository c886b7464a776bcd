"""Simulated activities: the real activities' names and types, answered from a SimulatedCluster.

Registered in place of activities/node.py (each node's queue) and activities/monitor.py,
activities/checkpoints.py, activities/fleet.py (the supervisor's queue), they let the real
RunWorkflow run a whole run in seconds. Every activity returns at once or waits on the cluster,
never on a long sleep: in the time-skipping test server, time runs for real while an activity is
outstanding, so simulated time is the step numbers and timestamps these activities report.

An activity the workflow cancels (a monitor with nothing more to report, the ranks of a generation
another node ended) waits heartbeating: a cancel reaches an activity only in the reply
to a heartbeat. Run these workers with a short `max_heartbeat_throttle_interval` (sim/workers.py
does) so that cancelled activities go away at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, NoReturn

from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.checkpoints import ChooseInput
from activities.fleet import RecordWindows, Replace, Replacement
from activities.paging import deliver_webhook, page
from activities.reporting import signal_run
from agent.node import NodeCommand, NodeStacks, PrepareNode
from core.events import (
    CHECKPOINT_JUDGED,
    MONITOR_REPORT,
    CheckpointJudged,
    FirstStep,
    MonitorInput,
    MonitorReport,
    NodeOutcome,
)
from core.fleet import EvictionOutcome, SelfTestResult
from core.fleet_requests import Acquire, Grant, MarkSuspect, RecordEviction, Release, SelfTestInput, TakeSpare
from core.launch import Endpoint, NodeEndpoint, NodeLaunch
from core.run import CheckpointRecord
from core.telemetry import Held
from sim.cluster import CURSOR, SimulatedCluster, SimulatedGeneration

HEARTBEAT_SECONDS = 0.05
HUB_PORT = 7000  # endpoints name the simulated node; nothing connects to them
RENDEZVOUS_PORT = 29500


class SimulatedNode:
    """One node agent's activities, on task queue `node.<id>`."""

    def __init__(self, cluster: SimulatedCluster, node: str) -> None:
        self.cluster = cluster
        self.node = node
        self.ranks: dict[str, list[int]] = {}  # run → the ranks this node runs now

    def activities(self) -> list[Callable[..., Any]]:
        return [
            self.prepare_node,
            self.run_ranks,
            self.release_run,
            self.send_command,
            self.dump_stacks,
            self.self_test,
        ]

    @activity.defn(name="prepare_node")
    async def prepare_node(self, request: PrepareNode) -> NodeEndpoint:
        rendezvous = Endpoint(host=self.node, port=RENDEZVOUS_PORT) if request.host_rendezvous else None
        return NodeEndpoint(node=self.node, hub=Endpoint(host=self.node, port=HUB_PORT), rendezvous=rendezvous)

    @activity.defn(name="run_ranks")
    async def run_ranks(self, launch: NodeLaunch) -> NodeOutcome:
        generation = self.cluster.launch(launch)
        self.ranks[launch.run_id] = launch.ranks
        outcome = generation.outcome(self.node, launch.ranks)
        if outcome is None:
            await until_cancelled(self.cluster)
        await until(self.cluster, lambda: self.cluster.caught_up(generation), not_before=generation.ends_at)
        return outcome

    @activity.defn(name="release_run")
    async def release_run(self, run_id: str) -> int:
        return len(self.ranks.pop(run_id, []))

    @activity.defn(name="send_command")
    async def send_command(self, request: NodeCommand) -> int:
        return len(self.ranks.get(request.run_id, []))

    @activity.defn(name="dump_stacks")
    async def dump_stacks(self, run_id: str) -> NodeStacks:
        raise ApplicationError("the simulator does not model hangs yet: no stacks to dump", non_retryable=True)

    @activity.defn(name="self_test")
    async def self_test(self, input: SelfTestInput) -> SelfTestResult:
        checks = {"gemm": True, "repeatability": True, "collective": True}
        return SelfTestResult(node=self.node, passed=True, checks=checks, detail="simulated", at=datetime.now(UTC))


class SimulatedSupervisor:
    """The supervisor's run-level activities, on task queue `stayalive`."""

    def __init__(self, cluster: SimulatedCluster) -> None:
        self.cluster = cluster

    def activities(self) -> list[Callable[..., Any]]:
        return [
            self.monitor_run,
            self.await_hold,
            self.choose_checkpoint,
            self.acquire_nodes,
            self.replace_node,
            self.take_spare,
            self.release_nodes,
            self.baseline,
            self.record_baseline,
            self.mark_suspect,
            self.eviction_outcomes,
            self.record_eviction,
            page,  # the real ones: a page goes to the log and, where the spec names them, a file and a webhook
            deliver_webhook,
        ]

    @activity.defn(name="monitor_run")
    async def monitor_run(self, input: MonitorInput) -> None:
        generation = await launched(self.cluster, input.run_id, input.generation)
        if input.await_first_step:
            await until(self.cluster, lambda: True, not_before=generation.first_step_at)
            first = FirstStep(
                step=generation.resume_step + 1,
                at=generation.first_step_at,
                restored_from="storage" if generation.resume_step else None,
                progress=generation.first_step(),
                after=input.after,
            )
            await signal_run(MONITOR_REPORT, MonitorReport(generation=input.generation, event=first))
        # The workflow has the first step (or had it before a continue-as-new). No detector is
        # simulated (hangs, stragglers): what is left to report is each checkpoint, once committed.
        self.cluster.take_first_step(generation)
        assert input.keeper is not None
        cursor = input.keeper.after.get(CURSOR, 0)
        while (pending := generation.checkpoint_after(cursor)) is not None:
            cursor, step = pending
            await until(self.cluster, lambda: True, not_before=generation.committed_at(step))
            judged = CheckpointJudged(
                generation=input.generation, checkpoint=generation.checkpoint(step), after={CURSOR: cursor}, deleted=[]
            )
            if not await signal_run(CHECKPOINT_JUDGED, judged):
                return  # the run continued as new: the next segment's monitor reports it
            self.cluster.take_checkpoints(input.run_id, cursor)
        await until_cancelled(self.cluster)

    @activity.defn(name="await_hold")
    async def await_hold(self, input: MonitorInput) -> Held:
        raise ApplicationError("the simulator does not model holds (drain, pause) yet", non_retryable=True)

    @activity.defn(name="choose_checkpoint")
    async def choose_checkpoint(self, input: ChooseInput) -> list[CheckpointRecord]:
        # A generation ends only once the workflow has recorded its checkpoints: nothing is left to judge.
        return []

    @activity.defn(name="acquire_nodes")
    async def acquire_nodes(self, request: Acquire) -> Grant:
        return self.cluster.acquire(request.run_id, request.wanted)

    @activity.defn(name="replace_node")
    async def replace_node(self, request: Replace) -> Replacement:
        record = self.cluster.quarantine(request.run_id, request.node, request.reason)
        return Replacement(quarantine=record, spare=self.cluster.take_spare(request.run_id, request.candidates))

    @activity.defn(name="take_spare")
    async def take_spare(self, request: TakeSpare) -> str | None:
        return self.cluster.take_spare(request.run_id, request.candidates)

    @activity.defn(name="release_nodes")
    async def release_nodes(self, request: Release) -> list[str]:
        return self.cluster.release(request.run_id)

    @activity.defn(name="baseline")
    async def baseline(self, config_digest: str) -> list[float]:
        return list(self.cluster.baselines.get(config_digest, []))

    @activity.defn(name="record_baseline")
    async def record_baseline(self, request: RecordWindows) -> int:
        self.cluster.baselines.setdefault(request.config_digest, []).extend(request.medians)
        return len(request.medians)

    @activity.defn(name="mark_suspect")
    async def mark_suspect(self, request: MarkSuspect) -> None:
        self.cluster.suspects.append((request.node, request.reason))

    @activity.defn(name="eviction_outcomes")
    async def eviction_outcomes(self) -> list[EvictionOutcome]:
        return list(self.cluster.evictions)

    @activity.defn(name="record_eviction")
    async def record_eviction(self, request: RecordEviction) -> EvictionOutcome:
        outcome = EvictionOutcome(
            node=request.node, run_id=request.run_id, at=datetime.now(UTC), resolved=request.resolved
        )
        self.cluster.evictions.append(outcome)
        return outcome


async def launched(cluster: SimulatedCluster, run_id: str, number: int) -> SimulatedGeneration:
    """The generation, once some node has launched its ranks (no telemetry before that)."""
    await until(cluster, lambda: cluster.generation(run_id, number) is not None)
    generation = cluster.generation(run_id, number)
    assert generation is not None
    return generation


async def until(cluster: SimulatedCluster, ready: Callable[[], bool], not_before: float = 0.0) -> None:
    """Wait until `ready()` holds and the cluster's clock has reached `not_before`, heartbeating."""
    while True:
        changed = cluster.changed  # taken before the check: a change after it still wakes this wait
        now = cluster.clock()
        if ready() and now >= not_before:
            return
        activity.heartbeat()
        timeout = min(HEARTBEAT_SECONDS, not_before - now) if ready() else HEARTBEAT_SECONDS
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancel that lands as the
        # wait ends (gh-86296), and the cancelled activity then waits forever, holding its worker's
        # shutdown (the stall this suite saw about one run in four).
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await changed.wait()


async def until_cancelled(cluster: SimulatedCluster) -> NoReturn:
    await until(cluster, lambda: False)
    raise AssertionError("a wait for nothing ended without a cancel")
