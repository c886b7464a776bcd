"""The run monitor: one long-running activity per run that reads every node's telemetry.

It heartbeats a live summary (step, loss, steps/s, step-time p50/max) and completes with a typed
event only when the workflow has something to decide, so history grows with decisions, not steps.
Its cursor per node travels in heartbeats and in every event: a monitor restarted on another
supervisor worker resumes exactly where the last one stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import structlog
from temporalio import activity

from core.events import CheckpointWritten, FirstStep, MonitorEvent, MonitorInput
from core.launch import NodeEndpoint
from core.progress import ProgressTracker
from core.telemetry import CheckpointCommitted, Record, StepReport, Subscribe

log = structlog.get_logger()

HEARTBEAT_SECONDS = 1.0


async def _follow(run_id: str, endpoint: NodeEndpoint, after: dict[str, int], records: asyncio.Queue[Record]) -> None:
    """Stream one node's records into `records`, reconnecting (from the latest cursor) if the line drops."""
    backoff = 0.2
    while True:
        try:
            reader, writer = await asyncio.open_connection(endpoint.hub.host, endpoint.hub.port)
            subscribe = Subscribe(run_id=run_id, after=after.get(endpoint.node, 0))
            writer.write(subscribe.model_dump_json().encode() + b"\n")
            await writer.drain()
            backoff = 0.2
            while line := await reader.readline():
                await records.put(Record.model_validate_json(line))
        except OSError as exc:
            log.warning("node telemetry unreachable", run_id=run_id, node=endpoint.node, error=str(exc))
        await asyncio.sleep(backoff)
        backoff = min(backoff * 2, 5.0)


def _resumed_cursor(input: MonitorInput) -> dict[str, int]:
    """The cursor of this attempt: the last heartbeat's, when an earlier attempt died mid-way."""
    details = activity.info().heartbeat_details
    if details and isinstance(details[0], dict) and "after" in details[0]:
        return {str(k): int(v) for k, v in details[0]["after"].items()}
    return dict(input.after)


@activity.defn
async def monitor_run(input: MonitorInput) -> MonitorEvent:
    after = _resumed_cursor(input)
    records: asyncio.Queue[Record] = asyncio.Queue()
    followers = [asyncio.create_task(_follow(input.run_id, e, after, records)) for e in input.endpoints]
    tracker = ProgressTracker(input.world_size, input.generation)
    next_heartbeat = 0.0
    try:
        while True:
            with contextlib.suppress(TimeoutError):
                record = await asyncio.wait_for(records.get(), timeout=HEARTBEAT_SECONDS)
                message = record.message
                if message.generation == input.generation:
                    if isinstance(message, StepReport):
                        completed = tracker.observe(message)
                        if input.await_first_step and completed is not None and completed > input.resume_step:
                            after[record.node] = record.seq
                            return FirstStep(step=completed, at=message.at, progress=tracker.summary(), after=after)
                    elif isinstance(message, CheckpointCommitted):
                        after[record.node] = record.seq
                        return CheckpointWritten(
                            step=message.step,
                            path=message.path,
                            blocking_seconds=message.blocking_s,
                            at=time.time(),
                            progress=tracker.summary(),
                            after=after,
                        )
                after[record.node] = record.seq
            if time.monotonic() >= next_heartbeat:
                activity.heartbeat({"after": after, "progress": tracker.summary().model_dump()})
                next_heartbeat = time.monotonic() + HEARTBEAT_SECONDS
    finally:
        for follower in followers:
            follower.cancel()
