"""The simulated run monitor: what one monitor reports of one generation, and how it waits on the
simulated cluster.

It reports what the real one would, in the same order: the first step, each checkpoint's verdict,
stragglers and slowdowns by signal; a crash, a lost node, a hang or failed SDC check, and every rank
holding, as what it completes with. A monitor that replaces another on the same generation (a retry,
the next segment after continue-as-new) skips what was already signalled, as the real one resumes
after what it acknowledged. In real time (the dev server) simulated time is the step numbers and
timestamps it reports; under a time-skipping server it goes quiet (core.messages.events.Quiet) instead of
waiting for anything later, and brings its first step and verdicts with its completion.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, NoReturn

from temporalio import activity

from stayalive.activities.checkpoints import Shelf
from stayalive.activities.reporting import signal_run
from stayalive.core.judgement.diagnosis import Diagnosis, Verdict
from stayalive.core.messages.events import (
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
    Quiet,
    RankFailed,
    RanksFinished,
    SdcDetected,
    SlowdownFound,
    SlownessTally,
    StragglerFound,
)
from stayalive.core.protocol.telemetry import SdcCheck
from stayalive.core.run.status import CheckpointRecord, Progress
from stayalive.sim.cluster import HANG_TIMEOUT_S, Fault, SimulatedCluster, SimulatedGeneration
from stayalive.training.checkpoint import checkpoint_dirname

HEARTBEAT_SECONDS = 0.05
QUIET_MAX_S = 3600.0  # a quiet monitor still reports at least hourly: progress, and the verdicts since
# A straggler's rent per report: enough that the ladder climbs a rung on each (its prices are a few
# seconds at the sim's step times), so a straggler is decided in two tallies, not thirty seconds of them.
RENT_S = 5.0
REBALANCED_SHARE = 0.2  # of a straggler's toll, what a rebalance leaves (bench/supervision measures ~0.25)


class Report:
    """What one simulated monitor has told the workflow of one generation."""

    def __init__(
        self, cluster: SimulatedCluster, generation: SimulatedGeneration, shelf: Shelf | None, quiet: bool = False
    ) -> None:
        self.cluster = cluster
        self.generation = generation
        self.shelf = shelf  # the keeper's view of the run's checkpoints: retention decides as it would
        self.quiet = quiet  # go quiet until the next happening instead of waiting for it
        self.held_back: list[tuple[str, FirstStep | CheckpointJudged]] = []
        self.held: CheckpointJudged | None = None  # the held step's verdict, which ends the generation

    def quiet_until(self, when: float) -> Quiet:
        now = self.cluster.clock()
        step = self.generation.step_at(now)
        progress = self.progress(step).model_copy(update={"at": min(now, self.generation.at(step))})
        return Quiet(until=min(when, now + QUIET_MAX_S), progress=progress)

    def completion(self, event: MonitorEvent) -> MonitorReport:
        """What the monitor completes with, bringing what it held back instead of signalling."""
        first = next((p for _, p in self.held_back if isinstance(p, FirstStep)), None)
        verdicts = [p for _, p in self.held_back if isinstance(p, CheckpointJudged)]
        self.generation.reported.update(key for key, _ in self.held_back)
        self.held_back = []
        return MonitorReport(generation=self.generation.number, event=event, first_step=first, verdicts=verdicts)

    def told(self, key: str) -> bool:
        """Reported already, or held back to go with this monitor's completion."""
        return key in self.generation.reported or any(key == k for k, _ in self.held_back)

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
        if self.told(key):
            return False
        if self.quiet and isinstance(payload, CheckpointJudged | FirstStep):
            self.held_back.append((key, payload))  # it goes with the completion
            return True
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
        pending = [s for s in g.checkpoint_steps() if not self.told(f"checkpoint {s}")]
        times: list[tuple[float, Callable[[], Any]]] = [(g.committed_at(s), self._checkpoint(s)) for s in pending[:1]]
        times += [(g.at(g.fault_step(f)), self._finding(f)) for f in self._findings()]
        if "found straggler" in g.reported and self._tally_due():
            times.append((self.cluster.clock(), self._tally()))
        if not times:
            times.append((g.ended_at(), self._end))
        when, happen = min(times, key=lambda t: t[0])
        if self.quiet and when > self.cluster.clock():
            return self.quiet_until(self._next_news(pending, when))
        changed = self.cluster.changed
        await until(self.cluster, not_before=when, or_changed=changed)
        if self.cluster.clock() < when:
            return None  # a command changed the plan: look again
        result: MonitorEvent | None = await happen()
        return result

    def _next_news(self, pending: list[int], when: float) -> float:
        """When the workflow next needs the monitor: at `when`, unless that is a regular checkpoint's
        verdict, which comes with the others after it at the next finding or the end (or the hourly
        report). The run's first checkpoint (its first measure of C) and a forced one are news at once."""
        g = self.generation
        if not pending or when != g.committed_at(pending[0]):
            return when
        if (g.first_of_run and len(pending) == len(g.checkpoint_steps())) or pending[0] in g.forced:
            return when
        findings = [g.at(g.fault_step(f)) for f in self._findings()]
        forced = [g.committed_at(s) for s in pending if s in g.forced]
        return min([*findings, *forced, g.ended_at()])

    def _findings(self) -> list[Fault]:
        """The stragglers and slowdowns still to report: they come before the generation ends."""
        g = self.generation
        return [
            f
            for f in g.faults
            if f.kind in ("straggler", "slowdown")
            and g.fault_step(f) < g.last_step
            and f"found {f.kind}" not in g.reported
        ]

    def _checkpoint(self, step: int) -> Callable[[], Any]:
        async def judge() -> None:
            g = self.generation
            damaged = g.damaged(step)
            record = CheckpointRecord(
                step=step,
                path=f"{g.directory}/{checkpoint_dirname(step, g.number)}",
                generation=g.number,
                blocking_seconds=g.blocking_seconds,
                written_at=datetime.fromtimestamp(g.committed_at(step), UTC),
                validated=not damaged,
                reason="simulated: a shard's checksum does not match" if damaged else "simulated: valid",
                last_verified_step=step,  # a check passed at every checkpointed step
            )
            deleted = [c.path for c in self.shelf.add(record)] if self.shelf is not None else []
            if self.shelf is not None:
                self.shelf.forget(deleted)
            judged = CheckpointJudged(generation=g.number, checkpoint=record, deleted=deleted)
            if step == g.hold_step:  # every rank holds: the verdict travels with the end of the generation
                g.reported.add(f"checkpoint {step}")
                self.held = judged
                return None
            await self.signal(f"checkpoint {step}", judged)
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
                g.tallied_at = g.at(step)
            return None

        return find

    def _tally_due(self) -> bool:
        """A known straggler's rent is tallied once per rebalance command, as the ranks' report after
        it; quiet, at each wake too (at least hourly), for the time since the last."""
        g = self.generation
        if self.quiet:
            return self.cluster.clock() > g.tallied_at
        return f"tally {g.commands}" not in g.reported

    def _tally(self) -> Callable[[], Any]:
        async def tally() -> None:
            g = self.generation
            now = self.cluster.clock()
            step = g.step_at(now)
            rent = RENT_S
            if self.quiet:  # the barrier waits (1 - 1/ratio) of each step on it; a rebalance wins back most
                straggler = next(f for f in g.faults if f.kind == "straggler")
                share = (1 - 1 / straggler.ratio) * (REBALANCED_SHARE if g.commands else 1.0)
                rent, g.tallied_at = (now - g.tallied_at) * share, now
            key = f"tally {g.commands}" if not self.quiet else f"tally at {now:.3f}"
            await self.signal(key, SlownessTally(progress=self.progress(step, rent=rent)))
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
            stalled = g.detect_after.get("hang") or HANG_TIMEOUT_S
            return Hang(step=step, stalled_s=stalled, timeout_s=stalled, at=g.at(step) + stalled, progress=progress)
        if fault.lasting:
            self.cluster.defective.add(g.node_of(rank))
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
