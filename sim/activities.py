"""Simulated activities: the real activities' names and types, answered from a SimulatedCluster.

Registered on the supervisor's queue in place of activities/nodes.py (launch, command, release, stack
dumps, self-test), activities/monitor.py and activities/checkpoints.py, they let the real RunWorkflow
and the real FleetWorkflow (with the real fleet and paging activities) run a whole run in seconds at
any width. Every activity returns at once or waits on the cluster, never on a long sleep: in the
time-skipping test server, time runs for real while an activity is outstanding, so simulated time is
the step numbers and timestamps these activities report.

The simulated monitor reports what the real one would, in the same order: the first step, each
checkpoint's verdict, stragglers and slowdowns by signal; a crash, a lost node, a hang or failed SDC
check, and every rank holding, as what it completes with. A monitor that replaces another on the
same generation (a retry, the next segment after continue-as-new) skips what was already signalled,
as the real one resumes after what it acknowledged.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, NoReturn

from temporalio import activity

from activities.paging import deliver_webhook, page
from activities.reporting import signal_run
from core.checkpoints import ChooseInput
from core.control import CommandRanks, HangInput, HangStacks, ReleaseRanks
from core.diagnosis import Diagnosis, Verdict
from core.events import (
    CHECKPOINT_JUDGED,
    MONITOR_REPORT,
    AllHeld,
    CheckpointJudged,
    FirstStep,
    Hang,
    MonitorEvent,
    MonitorInput,
    MonitorReport,
    NodeLost,
    RankFailed,
    RanksFinished,
    SdcDetected,
    SlowdownFound,
    SlownessTally,
    StragglerFound,
)
from core.fleet import SelfTestResult
from core.fleet_requests import SelfTestInput
from core.launch import Launch, Launched
from core.run import CheckpointRecord, Progress
from core.telemetry import SdcCheck
from sim.cluster import Fault, SimulatedCluster, SimulatedGeneration
from training.checkpoint import checkpoint_dirname

HEARTBEAT_SECONDS = 0.05
# A straggler's rent per report: enough that the ladder climbs a rung on each (its prices are a few
# seconds at the sim's step times), so a straggler is decided in two tallies, not thirty seconds of them.
RENT_S = 5.0


class SimulatedSupervisor:
    """The supervisor's activities that touch nodes, telemetry or storage, on task queue `stayalive`."""

    def __init__(self, cluster: SimulatedCluster, silent: Callable[[], set[str]] = set) -> None:
        self.cluster = cluster
        self.silent = silent  # nodes whose agents answer nothing (a launch finds them unreachable)

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

    @activity.defn(name="launch")
    async def launch(self, request: Launch) -> Launched:
        if silent := sorted(set(request.nodes) & self.silent()):
            self.cluster.mark("unreachable at launch")
            return Launched(unreachable={n: f"no answer within {request.answer_within:g}s" for n in silent})
        self.cluster.launch(request)
        return Launched(rendezvous=f"{request.nodes[0]}:29500")

    @activity.defn(name="command")
    async def command(self, request: CommandRanks) -> int:
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
        checks = {"gemm": True, "repeatability": True, "collective": True}
        return SelfTestResult(node=input.node, passed=True, checks=checks, detail="simulated", at=datetime.now(UTC))

    @activity.defn(name="choose_checkpoint")
    async def choose_checkpoint(self, input: ChooseInput) -> list[CheckpointRecord]:
        # Whatever a generation committed was signalled before it ended: nothing is left to judge.
        return []

    @activity.defn(name="monitor_run")
    async def monitor_run(self, input: MonitorInput) -> MonitorReport:
        generation = await launched(self.cluster, input.run_id, input.generation)
        report = Report(self.cluster, generation)
        if input.await_first_step:
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
        self.cluster.ended(input.run_id, ending.kind)
        return MonitorReport(generation=generation.number, event=ending)


class Report:
    """What one simulated monitor has told the workflow of one generation."""

    def __init__(self, cluster: SimulatedCluster, generation: SimulatedGeneration) -> None:
        self.cluster = cluster
        self.generation = generation
        self.held: CheckpointJudged | None = None  # the held step's verdict, which ends the generation

    def progress(self, step: int, rent: float = 0.0) -> Progress:
        g = self.generation
        return Progress(
            step=step,
            steps_per_second=1 / g.step_seconds,
            step_seconds_p50=g.step_seconds,
            step_seconds_max=g.step_seconds,
            at=g.at(step),
            straggler_s=rent,
        )

    async def signal(self, key: str, payload: MonitorEvent | CheckpointJudged) -> bool:
        """Signal the workflow once (True when this call sent it): a monitor that replaces this one
        skips what is already reported."""
        if key in self.generation.reported:
            return False
        if isinstance(payload, CheckpointJudged):
            sent = await signal_run(CHECKPOINT_JUDGED, payload)
        else:
            sent = await signal_run(MONITOR_REPORT, MonitorReport(generation=self.generation.number, event=payload))
        if not sent:  # the run continued as new: the next segment's monitor reports it
            await until_cancelled(self.cluster)
        self.generation.reported.add(key)
        return True

    async def next(self, input: MonitorInput) -> MonitorEvent | None:
        """Wait for the generation's next happening and report it; what ends it is returned."""
        g = self.generation
        pending = [s for s in g.checkpoint_steps() if f"checkpoint {s}" not in g.reported]
        findings = [f for f in g.faults if f.kind in ("straggler", "slowdown") and g.fault_step(f) < g.last_step]
        times: list[tuple[float, Callable[[], Any]]] = [(g.committed_at(s), self._checkpoint(s)) for s in pending[:1]]
        times += [(g.at(g.fault_step(f)), self._finding(f)) for f in findings if f"found {f.kind}" not in g.reported]
        if any(f.kind == "straggler" for f in findings) and f"tally {g.commands}" not in g.reported:
            times.append((self.cluster.clock(), self._tally()))
        if not times:
            times.append((g.committed_at(g.last_step), self._end))
        when, happen = min(times, key=lambda t: t[0])
        changed = self.cluster.changed
        await until(self.cluster, not_before=when, or_changed=changed)
        if self.cluster.clock() < when:
            return None  # a command changed the plan: look again
        result: MonitorEvent | None = await happen()
        return result

    def _checkpoint(self, step: int) -> Callable[[], Any]:
        async def judge() -> None:
            g = self.generation
            record = CheckpointRecord(
                step=step,
                path=f"{g.directory}/{checkpoint_dirname(step, g.number)}",
                generation=g.number,
                blocking_seconds=g.blocking_seconds,
                written_at=datetime.fromtimestamp(g.committed_at(step), UTC),
                validated=True,
                reason="simulated: every checkpoint is valid",
                last_verified_step=step,  # a check passed at every checkpointed step
            )
            if step == g.hold_step:  # every rank holds: the verdict travels with the end of the generation
                g.reported.add(f"checkpoint {step}")
                self.held = CheckpointJudged(generation=g.number, checkpoint=record, deleted=[])
                return None
            await self.signal(
                f"checkpoint {step}", CheckpointJudged(generation=g.number, checkpoint=record, deleted=[])
            )
            return None

        return judge

    def _finding(self, fault: Fault) -> Callable[[], Any]:
        async def find() -> None:
            g = self.generation
            step = g.fault_step(fault)
            if fault.kind == "straggler":
                rank = fault.rank % g.launch.world_size
                event: MonitorEvent = StragglerFound(
                    rank=rank,
                    node=g.node_of(rank),
                    step=step,
                    ratio=fault.ratio,
                    z=8.0,
                    verdict=None,
                    progress=self.progress(step, rent=RENT_S),
                )
            else:
                hot = Verdict(
                    diagnosis=Diagnosis.ENVIRONMENTAL,
                    evidence="the whole rack runs hot (simulated)",
                    evict=False,
                    action="page facilities",
                )
                event = SlowdownFound(
                    step=step,
                    ratio=fault.ratio,
                    window_median=g.step_seconds * fault.ratio,
                    baseline_median=g.step_seconds,
                    verdicts={g.launch.nodes[0]: hot},
                    progress=self.progress(step),
                )
            if await self.signal(f"found {fault.kind}", event):
                self.cluster.mark(fault.kind)
            return None

        return find

    def _tally(self) -> Callable[[], Any]:
        async def tally() -> None:
            g = self.generation
            if "found straggler" not in g.reported:
                return None
            step = g.step_at(self.cluster.clock())
            await self.signal(f"tally {g.commands}", SlownessTally(progress=self.progress(step, rent=RENT_S)))
            return None

        return tally

    async def _end(self) -> MonitorEvent:
        g = self.generation
        step = g.last_step
        progress = self.progress(step)
        fault = g.ending
        if fault is None and g.hold_step is not None:
            return AllHeld(step=step, judged=self.held, progress=progress)
        if fault is None:
            return RanksFinished(generation=g.number, last_step=step, progress=progress)
        rank = fault.rank % g.launch.world_size
        if fault.kind == "crash":
            return RankFailed(
                node=g.node_of(rank),
                generation=g.number,
                rank=rank,
                exit_code=fault.exit_code,
                last_step=step,
                at=g.at(step),
                log_tail=f"simulated crash of rank {rank} after step {step}",
                progress=progress,
            )
        if fault.kind == "node_lost":
            return NodeLost(node=g.node_of(rank), detail="simulated: the node agent fell silent", progress=progress)
        if fault.kind == "hang":
            return Hang(step=step, stalled_s=10.0, timeout_s=10.0, at=g.at(step) + 10.0, progress=progress)
        check = SdcCheck(
            rank=rank,
            generation=g.number,
            step=step + 1,
            method="self",
            passed=False,
            culprit=rank,
            last_verified=max([s for s in g.checkpoint_steps() if s <= step], default=g.resume_step),
            detail=f"rank {rank}'s replay of step {step + 1} differs bitwise (simulated)",
        )
        return SdcDetected(check=check, progress=progress)


async def launched(cluster: SimulatedCluster, run_id: str, number: int) -> SimulatedGeneration:
    """The generation, once it is launched (no telemetry before that)."""
    await until(cluster, ready=lambda: cluster.generation(run_id, number) is not None)
    generation = cluster.generation(run_id, number)
    assert generation is not None
    return generation


async def until(
    cluster: SimulatedCluster,
    ready: Callable[[], bool] = lambda: True,
    not_before: float = 0.0,
    or_changed: asyncio.Event | None = None,
) -> None:
    """Wait until `ready()` holds and the cluster's clock has reached `not_before` (or, given
    `or_changed`, until the cluster changes), heartbeating."""
    while True:
        changed = cluster.changed  # taken before the check: a change after it still wakes this wait
        now = cluster.clock()
        if (ready() and now >= not_before) or (or_changed is not None and or_changed.is_set()):
            return
        activity.heartbeat()
        timeout = min(HEARTBEAT_SECONDS, not_before - now) if ready() else HEARTBEAT_SECONDS
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancel that lands as the
        # wait ends (gh-86296), and the cancelled activity then waits forever, holding its worker's
        # shutdown (the stall this suite saw about one run in four).
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(timeout, 0.0)):
                await changed.wait()


async def until_cancelled(cluster: SimulatedCluster) -> NoReturn:
    await until(cluster, ready=lambda: False)
    raise AssertionError("a wait for nothing ended without a cancel")
