"""The run monitor: one long-running activity per generation that reads every node's telemetry.

It heartbeats a live summary (step, loss, steps/s, step-time p50/max) and completes with a typed
event only when the workflow has something to decide, so history grows with decisions, not steps.
Its cursor per node travels in heartbeats and in every event: a monitor restarted on another
supervisor worker resumes exactly where the last one stopped.
"""

from __future__ import annotations

import time

from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.telemetry import records
from core.events import FirstStep, MonitorEvent, MonitorInput
from core.progress import ProgressTracker
from core.telemetry import Held, Resumed, StepReport

HEARTBEAT_SECONDS = 1.0


def resumed_cursor(after: dict[str, int]) -> dict[str, int]:
    """The cursor of this attempt: the last heartbeat's, when an earlier attempt died mid-way."""
    details = activity.info().heartbeat_details
    if details and isinstance(details[0], dict) and "after" in details[0]:
        return {str(k): int(v) for k, v in details[0]["after"].items()}
    return dict(after)


@activity.defn
async def monitor_run(input: MonitorInput) -> MonitorEvent:
    after = resumed_cursor(input.after)
    tracker = ProgressTracker(input.world_size, input.generation)
    restored_from = None
    next_heartbeat = 0.0
    async for record in records(input.run_id, input.endpoints, after):
        if record is not None:
            message = record.message
            if message.generation == input.generation:
                if isinstance(message, Resumed):
                    restored_from = message.source
                elif isinstance(message, StepReport):
                    completed = tracker.observe(message)
                    if input.await_first_step and completed is not None and completed > input.resume_step:
                        after[record.node] = record.seq
                        return FirstStep(
                            step=completed,
                            at=message.at,
                            restored_from=restored_from,
                            progress=tracker.summary(),
                            after=after,
                        )
            after[record.node] = record.seq
        if time.monotonic() >= next_heartbeat:
            activity.heartbeat({"after": after, "progress": tracker.summary().model_dump()})
            next_heartbeat = time.monotonic() + HEARTBEAT_SECONDS
    raise AssertionError("the telemetry stream never ends")


@activity.defn
async def await_hold(input: MonitorInput) -> Held:
    """Wait until every rank of the generation has finished the same step, checkpointed it and holds."""
    after = resumed_cursor(input.after)
    held: dict[int, Held] = {}
    async for record in records(input.run_id, input.endpoints, after, only=["held"]):
        if record is None:
            activity.heartbeat({"after": after, "held": sorted(held)})
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
