"""Reading a run's telemetry from its node agents, as the run monitor and the checkpoint keeper do."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import structlog

from core.launch import NodeEndpoint
from core.telemetry import Record, Subscribe

log = structlog.get_logger()


async def _follow(
    run_id: str, endpoint: NodeEndpoint, after: dict[str, int], only: list[str] | None, out: asyncio.Queue[Record]
) -> None:
    """Stream one node's records into `out`, reconnecting (from the latest cursor) if the line drops."""
    backoff = 0.2
    while True:
        try:
            reader, writer = await asyncio.open_connection(endpoint.hub.host, endpoint.hub.port)
            subscribe = Subscribe(run_id=run_id, after=after.get(endpoint.node, 0), only=only)
            writer.write(subscribe.model_dump_json().encode() + b"\n")
            await writer.drain()
            backoff = 0.2
            while line := await reader.readline():
                await out.put(Record.model_validate_json(line))
        except OSError as exc:
            log.warning("node telemetry unreachable", run_id=run_id, node=endpoint.node, error=str(exc))
        await asyncio.sleep(backoff)
        backoff = min(backoff * 2, 5.0)


async def records(
    run_id: str, endpoints: list[NodeEndpoint], after: dict[str, int], only: list[str] | None = None
) -> AsyncGenerator[Record | None, None]:
    """Every node's records after `after`, merged as they arrive; None each idle second, so a caller
    can heartbeat. The caller advances `after` as it consumes records."""
    queue: asyncio.Queue[Record] = asyncio.Queue()
    followers = [asyncio.create_task(_follow(run_id, e, after, only, queue)) for e in endpoints]
    try:
        while True:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancel that lands as a
            # record arrives (gh-86296), and a cancelled monitor or keeper would then run on forever.
            try:
                async with asyncio.timeout(1.0):
                    record = await queue.get()
            except TimeoutError:
                yield None
            else:
                yield record
    finally:
        for follower in followers:
            follower.cancel()
