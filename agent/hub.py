"""The node agent's local switchboard.

Ranks on this host connect to it (reports up, commands down); the run monitor connects to it from
the supervisor and subscribes to a run's records after a cursor, so a restarted monitor resumes
where the last one stopped. Everything is one JSON object per line over TCP.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
from pydantic import BaseModel, ValidationError

from core.launch import Endpoint
from core.telemetry import (
    Command,
    FileHeader,
    GetFile,
    Hello,
    PutFile,
    RankMessage,
    Record,
    StepReport,
    Subscribe,
    opening,
    rank_message,
)
from training.checkpoint import CheckpointError
from training.memory import memory_path, prune

log = structlog.get_logger()

# Records a node keeps per run for a monitor that reconnects: minutes of steps at thousands of steps/s.
_RETAINED = 200_000


@dataclass
class RunChannel:
    """One run's traffic on this node."""

    run_id: str
    node: str
    records: deque[Record] = field(default_factory=lambda: deque(maxlen=_RETAINED))
    seq: int = 0
    last_step: dict[int, int] = field(default_factory=dict)
    ranks: dict[int, asyncio.StreamWriter] = field(default_factory=dict)
    _arrival: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    def append(self, message: RankMessage) -> None:
        self.seq += 1
        self.records.append(Record(seq=self.seq, node=self.node, message=message))
        if isinstance(message, StepReport):
            self.last_step[message.rank] = message.step
        elif isinstance(message, Hello):
            self.last_step.pop(message.rank, None)  # a new generation starts counting again
        arrived, self._arrival = self._arrival, asyncio.get_running_loop().create_future()
        arrived.set_result(None)

    def next_arrival(self) -> asyncio.Future[None]:
        return self._arrival

    def after(self, cursor: int) -> list[Record]:
        if not self.records or self.records[-1].seq <= cursor:
            return []
        return list(itertools.islice(self.records, max(0, cursor + 1 - self.records[0].seq), None))


class NodeHub:
    def __init__(self, node: str, host: str, memory_dir: Path, advertise: str | None = None) -> None:
        self.node = node
        self.host = host
        self.memory_dir = memory_dir
        self.advertise = advertise or host
        self.runs: dict[str, RunChannel] = {}
        self._server: asyncio.Server | None = None

    async def start(self) -> Endpoint:
        self._server = await asyncio.start_server(self._serve, self.host, 0)
        return self.endpoint

    @property
    def endpoint(self) -> Endpoint:
        assert self._server is not None, "start the hub first"
        return Endpoint(host=self.advertise, port=self._server.sockets[0].getsockname()[1])

    def close(self) -> None:
        if self._server is not None:
            self._server.close()

    def run(self, run_id: str) -> RunChannel:
        if run_id not in self.runs:
            self.runs[run_id] = RunChannel(run_id=run_id, node=self.node)
        return self.runs[run_id]

    async def send(self, run_id: str, rank: int, message: BaseModel) -> None:
        """One message to one rank (a Rejoin is personal: each rank gets its own place)."""
        writer = self.run(run_id).ranks.get(rank)
        if writer is None:
            raise ConnectionError(f"rank {rank} of {run_id} is not connected to {self.node}")
        writer.write(message.model_dump_json().encode() + b"\n")
        await writer.drain()

    async def command(self, run_id: str, command: Command) -> int:
        """Send a command to every connected rank of the run; returns how many it reached."""
        line = command.model_dump_json().encode() + b"\n"
        reached = 0
        for writer in list(self.run(run_id).ranks.values()):
            with contextlib.suppress(ConnectionError):
                writer.write(line)
                await writer.drain()
                reached += 1
        return reached

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            first = opening.validate_json(await reader.readline())
            if isinstance(first, Subscribe):
                await self._stream(first, reader, writer)
            elif isinstance(first, PutFile):
                await self._keep_file(first, reader)
            elif isinstance(first, GetFile):
                await self._serve_file(first, writer)
            else:
                await self._receive(first, reader, writer)
        except (ConnectionError, ValidationError, CheckpointError, asyncio.IncompleteReadError) as exc:
            log.warning("hub connection dropped", node=self.node, error=str(exc))
        finally:
            writer.close()

    async def _receive(self, hello: Hello, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        channel = self.run(hello.run_id)
        rank = hello.rank
        channel.ranks[rank] = writer
        channel.append(hello)
        try:
            while line := await reader.readline():
                message = rank_message.validate_json(line)
                if isinstance(message, Hello):  # the process rejoined under a new rank: refile its line
                    if channel.ranks.get(rank) is writer:
                        del channel.ranks[rank]
                    rank = message.rank
                    channel.ranks[rank] = writer
                channel.append(message)
        finally:
            if channel.ranks.get(rank) is writer:
                del channel.ranks[rank]

    async def _keep_file(self, put: PutFile, reader: asyncio.StreamReader) -> None:
        """Keep a replica in this node's host-memory tier (written whole, then renamed into place)."""
        path = memory_path(self.memory_dir, put.run_id, put.checkpoint, put.file)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        with open(tmp, "wb") as f:
            remaining = put.size
            while remaining:
                chunk = await reader.readexactly(min(remaining, 1 << 22))
                await asyncio.to_thread(f.write, chunk)
                remaining -= len(chunk)
        tmp.rename(path)
        prune(self.memory_dir, put.run_id)

    async def _serve_file(self, get: GetFile, writer: asyncio.StreamWriter) -> None:
        path = memory_path(self.memory_dir, get.run_id, get.checkpoint, get.file)
        size = path.stat().st_size if path.is_file() else -1
        writer.write(FileHeader(size=size).model_dump_json().encode() + b"\n")
        if size >= 0:
            with open(path, "rb") as f:
                while chunk := await asyncio.to_thread(f.read, 1 << 22):
                    writer.write(chunk)
                    await writer.drain()
        await writer.drain()

    async def _stream(self, subscribe: Subscribe, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        channel = self.run(subscribe.run_id)
        cursor = subscribe.after
        hung_up = asyncio.ensure_future(reader.read())  # the monitor never writes again: EOF means it left
        try:
            while not hung_up.done():
                if batch := channel.after(cursor):
                    cursor = batch[-1].seq
                    if subscribe.only is not None:
                        batch = [r for r in batch if r.message.t in subscribe.only]
                    if not batch:
                        continue
                    writer.write(b"".join(r.model_dump_json().encode() + b"\n" for r in batch))
                    await writer.drain()
                else:
                    waiters: list[asyncio.Future[Any]] = [channel.next_arrival(), hung_up]
                    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            hung_up.cancel()
