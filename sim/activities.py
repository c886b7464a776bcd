"""Simulated activities: the real activities' names and types, answered from a SimulatedCluster.

Registered on the supervisor's queue in place of activities/nodes.py (launch, command, release, stack
dumps, self-test), activities/monitor.py and activities/checkpoints.py, they let the real RunWorkflow
and the real FleetWorkflow (with the real fleet and paging activities) run a whole run in seconds at
any width. Every activity returns at once or waits on the cluster, never on a long sleep. The run
monitor's reports are sim/monitor.py's.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from temporalio import activity

from stayalive.activities.checkpoints import Shelf
from stayalive.activities.paging import deliver_webhook, page
from stayalive.core.decisions.checkpoints import ChooseInput
from stayalive.core.fleet.model import SelfTestResult
from stayalive.core.fleet.requests import SelfTestInput
from stayalive.core.messages.control import CommandRanks, HangInput, HangStacks, ReleaseRanks
from stayalive.core.messages.events import FirstStep, MonitorInput, MonitorReport, Quiet
from stayalive.core.run.launch import Launch, Launched
from stayalive.core.run.status import CheckpointRecord
from stayalive.sim.cluster import SimulatedCluster
from stayalive.sim.monitor import Report, launched, until
from stayalive.sim.server_clock import ServerClock


class SimulatedSupervisor:
    """The supervisor's activities that touch nodes, telemetry or storage, on task queue `stayalive`."""

    def __init__(
        self, cluster: SimulatedCluster, silent: Callable[[], set[str]] = set, server: ServerClock | None = None
    ) -> None:
        self.cluster = cluster
        self.silent = silent  # nodes whose agents answer nothing (a launch finds them unreachable)
        # Under a time-skipping server whose clock the cluster reads: each activity reads the clock as
        # it starts, and a monitor goes quiet (core.messages.events.Quiet) rather than wait for anything later.
        self.server = server

    def activities(self) -> list[Callable[..., Any]]:
        return [
            self.launch,
            self.command,
            self.release,
            self.dump_stacks,
            self.self_test,
            self.monitor_run,
            self.choose_checkpoint,
            page,  # the real ones: a page goes to the log and, where the spec names them, a file and a webhook
            deliver_webhook,
        ]

    async def _now(self) -> None:
        if self.server is not None:
            await self.server.read()

    @activity.defn(name="launch")
    async def launch(self, request: Launch) -> Launched:
        await self._now()
        if silent := sorted(set(request.nodes) & self.silent()):
            self.cluster.mark("unreachable at launch")
            return Launched(unreachable={n: f"no answer within {request.answer_within:g}s" for n in silent})
        self.cluster.launch(request)
        return Launched(rendezvous=f"{request.nodes[0]}:29500")

    @activity.defn(name="command")
    async def command(self, request: CommandRanks) -> int:
        await self._now()
        return self.cluster.command(request.run_id, request.command)

    @activity.defn(name="release")
    async def release(self, request: ReleaseRanks) -> int:
        return 0

    @activity.defn(name="dump_stacks")
    async def dump_stacks(self, request: HangInput) -> HangStacks:
        generation = self.cluster.generation(request.run_id, request.generation)
        hung = generation.ending if generation is not None else None
        rank = hung.rank % (len(request.nodes) * request.ranks_per_node) if hung is not None else None
        world = len(request.nodes) * request.ranks_per_node
        return HangStacks(
            culprit=rank,
            suspects=[rank] if rank is not None else [],
            ranks_dumped=world,
            artifact=f"{request.directory}/incidents/hang-g{request.generation}-step{request.step}.txt",
            summary=f"rank {rank}'s stack differs from the other {world - 1} (simulated)",
        )

    @activity.defn(name="self_test")
    async def self_test(self, input: SelfTestInput) -> SelfTestResult:
        await self._now()
        passed = self.cluster.self_test(input.node)
        checks = {"gemm": True, "repeatability": passed, "collective": True}
        at = datetime.fromtimestamp(self.cluster.clock(), UTC)
        return SelfTestResult(node=input.node, passed=passed, checks=checks, detail="simulated", at=at)

    @activity.defn(name="choose_checkpoint")
    async def choose_checkpoint(self, input: ChooseInput) -> list[CheckpointRecord]:
        # Whatever a generation committed was signalled before it ended: nothing is left to judge.
        return []

    @activity.defn(name="monitor_run")
    async def monitor_run(self, input: MonitorInput) -> MonitorReport:
        await self._now()
        generation = await launched(self.cluster, input.run_id, input.generation)
        shelf = Shelf(input.keeper, list(input.keeper.checkpoints)) if input.keeper is not None else None
        report = Report(self.cluster, generation, shelf, quiet=self.server is not None)
        if input.await_first_step:
            if report.quiet and (first_at := generation.at(generation.resume_step + 1)) > self.cluster.clock():
                return report.completion(report.quiet_until(first_at))
            await until(self.cluster, not_before=generation.at(generation.resume_step + 1))
            first = FirstStep(
                step=generation.resume_step + 1,
                at=generation.at(generation.resume_step + 1),
                restored_from="storage" if generation.resume_step else None,
                progress=report.progress(generation.resume_step + 1),
            )
            await report.signal("first", first)
        while (ending := await report.next(input)) is None:
            pass
        if not isinstance(ending, Quiet):
            self.cluster.ended(input.run_id, ending.kind)
        return report.completion(ending)
