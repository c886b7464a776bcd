"""The run monitor: one long-running activity per generation that reads every node's telemetry, with
two loops.

The watch loop runs the detectors (core/detectors.py). It heartbeats a live summary (step, loss,
steps/s, step-time p50/max, slowest rank) and signals the workflow a typed event only when the
workflow has something to decide: the first step of a generation, a hang, a straggler, a slowdown of
the whole run, a failed SDC check, a skipped update, or a stretch of healthy windows for the fleet's
baseline. The keeper loop (activities/checkpoints.py) judges each checkpoint the ranks commit and
signals the verdict.

It runs until the workflow cancels it (the generation ended), so a report costs the history one
signal, not an activity's end and the next one's start, and a generation has one activity to cancel
besides its ranks. History grows with decisions, not steps. What it already reported (its cursors,
the stragglers and slowdown it knows of, the checkpoints it kept) travels in its heartbeats, so a
monitor restarted on another supervisor worker resumes where the last one stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections.abc import Coroutine
from typing import Any, Literal

import numpy as np
from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.checkpoints import keep_checkpoints
from activities.reporting import Heartbeat, signal_run
from activities.telemetry import records
from core.detectors import WINDOW_STEPS, AbsoluteSlowdown, HangWatchdog, RelativeStraggler
from core.diagnosis import GpuHealth, Verdict, diagnose
from core.events import (
    MONITOR_REPORT,
    AnomalyFound,
    FirstStep,
    Hang,
    HealthyWindows,
    MonitorEvent,
    MonitorInput,
    MonitorReport,
    SdcDetected,
    SlowdownFound,
    SlownessTally,
    StragglerFound,
)
from core.goodput import straggler_wait
from core.progress import ProgressTracker, StepVectors
from core.run import Progress
from core.telemetry import Anomaly, Finished, GpuReport, Held, Record, Resumed, SdcCheck, StepReport

HEARTBEAT_SECONDS = 1.0


def resumed_cursor(beat: Heartbeat, after: dict[str, int]) -> dict[str, int]:
    """The cursor of this attempt: the last heartbeat's, when an earlier attempt died mid-way."""
    return {str(k): int(v) for k, v in beat.resumed.get("after", after).items()}


def resumed_knowledge(beat: Heartbeat, input: MonitorInput) -> MonitorInput:
    """What an earlier attempt had already reported (the last heartbeat's), so that it is not reported
    again; the workflow also ignores a report it already has."""
    known = beat.resumed
    if "known_stragglers" not in known:
        return input
    return input.model_copy(
        update={
            "known_stragglers": [int(r) for r in known["known_stragglers"]],
            "slowdown_known": bool(known["slowdown_known"]),
            "await_first_step": bool(known["await_first_step"]),
        }
    )


class _Detectors:
    """Everything the monitor knows about one generation, folded from its telemetry."""

    def __init__(self, input: MonitorInput) -> None:
        self.input = input
        self.known_stragglers = list(input.known_stragglers)
        self.slowdown_known = input.slowdown_known
        self.await_first_step = input.await_first_step
        self.progress = ProgressTracker(input.world_size, input.generation)
        self.vectors = StepVectors(input.world_size)
        self.relative = RelativeStraggler(input.world_size, sigma=input.straggler_sigma, k=input.straggler_steps)
        self.absolute = AbsoluteSlowdown(input.baseline)
        self.watchdog = HangWatchdog(input.step_timeout or "auto")
        self.watchdog.last_progress_at = time.time()  # the clock runs from the monitor's start
        self.node_of: dict[int, str] = {}
        self.gpus: dict[str, list[GpuHealth]] = {}
        self.window: list[float] = []  # the current window's step times
        self.healthy: list[float] = []  # medians of consecutive healthy windows, for the fleet's baseline
        self.restored_from: Literal["memory", "storage"] | None = None
        self.straggler_s = 0.0  # what the stragglers and slowdowns this generation knows of cost so far
        self.next_tally = time.monotonic() + input.tally_s
        self.finished: set[int] = set()  # ranks that reached the target step and exited cleanly

    def record(self, record: Record) -> MonitorEvent | None:
        """Fold one telemetry record in; the event it makes, if any."""
        message = record.message
        if isinstance(message, GpuReport):
            self.gpus[message.node] = message.readings
        elif message.generation != self.input.generation:
            pass
        elif isinstance(message, Resumed):
            self.restored_from = message.source
        elif isinstance(message, Finished):
            self.finished.add(message.rank)
        elif isinstance(message, SdcCheck) and not message.passed:
            return SdcDetected(check=message, progress=self.summary(), after={})
        elif isinstance(message, Anomaly):
            return AnomalyFound(anomaly=message, progress=self.summary(), after={})
        elif isinstance(message, StepReport):
            event = self.step(message, record.node)
            if event is None and self.await_first_step and self.progress.step > self.input.resume_step:
                return FirstStep(
                    step=self.progress.step,
                    at=message.at,
                    restored_from=self.restored_from,
                    progress=self.summary(),
                    after={},
                )
            return event
        return None

    def hang(self) -> Hang | None:
        """No step within the timeout. Ranks that all finished make no more progress, and that is no hang."""
        if len(self.finished) >= self.input.world_size or not self.watchdog.overdue(time.time()):
            return None
        stalled = time.time() - (self.watchdog.last_progress_at or time.time())
        return Hang(
            step=self.progress.step,
            stalled_s=stalled,
            timeout_s=self.watchdog.timeout,
            at=time.time(),
            progress=self.summary(),
            after={},
        )

    def verdict(self, node: str) -> Verdict | None:
        """Seed R2's diagnosis of one node from its GPUs and its rack's (the other nodes of this run)."""
        readings = self.gpus.get(node)
        if not readings:
            return None
        rack = readings[0].rack
        peers = [g for n, gs in self.gpus.items() if n != node for g in gs if g.rack == rack]
        return diagnose(readings, peers)

    def step(self, report: StepReport, node: str) -> MonitorEvent | None:
        self.node_of[report.rank] = node
        self.progress.observe(report)
        events: list[MonitorEvent | None] = []
        for step, compute, step_s in self.vectors.add(report):
            self.watchdog.progress(step, report.at, float(np.nanmedian(step_s)))
            events.append(self._judge(step, compute, step_s))
        return next((e for e in events if e is not None), None)

    def summary(self) -> Progress:
        return self.progress.summary().model_copy(update={"straggler_s": self.straggler_s})

    def reported(self, event: MonitorEvent) -> None:
        """The workflow has it: count the slowness afresh, and know what it now knows."""
        self.straggler_s = 0.0
        self.next_tally = time.monotonic() + self.input.tally_s
        if isinstance(event, FirstStep):
            self.await_first_step = False
        elif isinstance(event, StragglerFound):
            self.known_stragglers.append(event.rank)
        elif isinstance(event, SlowdownFound):
            self.slowdown_known = True

    def knowledge(self) -> dict[str, object]:
        return {
            "known_stragglers": self.known_stragglers,
            "slowdown_known": self.slowdown_known,
            "await_first_step": self.await_first_step,
        }

    def _judge(self, step: int, compute: np.ndarray, step_s: np.ndarray) -> MonitorEvent | None:
        summary = self.summary
        known_slowdown = self.absolute.baseline_median if self.slowdown_known and self.absolute.armed else None
        self.straggler_s += straggler_wait(compute, float(np.nanmedian(step_s)), self.known_stragglers, known_slowdown)
        for flag in self.relative.observe(step, compute):
            if flag.rank not in self.known_stragglers:
                self.healthy.clear()
                node = self.node_of.get(flag.rank, "?")
                return StragglerFound(
                    rank=flag.rank,
                    node=node,
                    step=step,
                    ratio=flag.ratio,
                    z=flag.z,
                    verdict=self.verdict(node),
                    rack=self.gpus[node][0].rack if self.gpus.get(node) else None,
                    progress=summary(),
                    after={},
                )
        if (slow := self.absolute.observe(step, step_s)) is not None and not self.slowdown_known:
            self.healthy.clear()
            verdicts = {n: v for n in sorted(set(self.node_of.values())) if (v := self.verdict(n)) is not None}
            return SlowdownFound(
                step=step,
                ratio=slow.ratio,
                window_median=slow.window_median,
                baseline_median=slow.baseline_median,
                verdicts=verdicts,
                progress=summary(),
                after={},
            )
        if (self.known_stragglers or self.slowdown_known) and time.monotonic() >= self.next_tally:
            return SlownessTally(progress=summary(), after={})
        return self._window(float(np.nanmedian(step_s)))

    def _window(self, step_s: float) -> MonitorEvent | None:
        """Healthy windows (none slow against the baseline, no straggler known) teach the fleet's
        baseline; a slow one starts the count over, so a slowdown never becomes the norm."""
        self.window.append(step_s)
        if len(self.window) < WINDOW_STEPS:
            return None
        median = statistics.median(self.window)
        self.window.clear()
        if self.known_stragglers or (self.absolute.armed and median > self.absolute.threshold):
            self.healthy.clear()
            return None
        self.healthy.append(median)
        if len(self.healthy) < self.input.healthy_windows:
            return None
        medians, self.healthy = self.healthy, []
        return HealthyWindows(medians=medians, progress=self.summary(), after={})


@activity.defn
async def monitor_run(input: MonitorInput) -> None:
    """Watch the generation until the workflow cancels it: signal each finding of the detectors and, with
    a keeper, each checkpoint's verdict."""
    beat = Heartbeat()
    loops = [watch(input, beat)]
    if input.keeper is not None:
        loops.append(keep_checkpoints(input, input.keeper, beat))
    await _until_one_returns(loops)


async def watch(input: MonitorInput, beat: Heartbeat) -> None:
    """Run the detectors over every record, signalling what they find. A hang or a failed SDC check
    ends the generation: after one, it only heartbeats. Returns only when the workflow run is gone."""
    after = resumed_cursor(beat, input.after)
    seen = _Detectors(resumed_knowledge(beat, input))
    next_heartbeat = 0.0
    async with contextlib.aclosing(records(input.run_id, input.endpoints, after)) as stream:
        async for record in stream:
            event = None
            if record is not None:
                event = seen.record(record)
                after[record.node] = record.seq
            if (event := event or seen.hang()) is not None:
                found = MonitorReport(generation=input.generation, event=event.model_copy(update={"after": after}))
                if not await signal_run(MONITOR_REPORT, found):
                    return
                seen.reported(event)
                if isinstance(event, Hang | SdcDetected):
                    break
            if time.monotonic() >= next_heartbeat:
                beat(after=after, progress=seen.summary().model_dump(), **seen.knowledge())
                next_heartbeat = time.monotonic() + HEARTBEAT_SECONDS
    while True:  # until cancelled
        beat(after=after, progress=seen.summary().model_dump(), **seen.knowledge())
        await asyncio.sleep(HEARTBEAT_SECONDS)


async def _until_one_returns(loops: list[Coroutine[Any, Any, None]]) -> None:
    """Run the loops side by side until one returns (or raises); then stop the others."""
    tasks = [asyncio.ensure_future(loop) for loop in loops]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            task.result()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@activity.defn
async def await_hold(input: MonitorInput) -> Held:
    """Wait until every rank of the generation has finished the same step, checkpointed it and holds."""
    beat = Heartbeat()
    after = resumed_cursor(beat, input.after)
    held: dict[int, Held] = {}
    async for record in records(input.run_id, input.endpoints, after, only=["held"]):
        if record is None:
            beat(after=after, held=sorted(held))
            continue
        after[record.node] = record.seq
        message = record.message
        if isinstance(message, Held) and message.generation == input.generation:
            held[message.rank] = message
            if len(held) == input.world_size:
                steps = {h.step for h in held.values()}
                if len(steps) != 1:  # cannot happen while ranks agree on commands; fail loudly if it does
                    raise ApplicationError(f"ranks hold at different steps {sorted(steps)}", non_retryable=True)
                return next(iter(held.values()))
    raise AssertionError("the telemetry stream never ends")
