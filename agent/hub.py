"""The node agent's switchboard: one TCP port, and the first line of a connection says who calls.

- A rank on this host (Hello): reports up, commands down, for its life.
- A reader, the run monitor on the supervisor (Subscribe): a run's records, resuming after the last
  one it acknowledged; step batches as binary frames when asked; a Beat every second.
- A rank on another host (PutFile, GetFile): a checkpoint shard into or out of the host-memory tier.
- The supervisor (core.messages.control's requests): launch, command, dump stacks, release, self-test; one
  JSON line answered by one.
- A node agent's relay, for a rank on another host (OpenStore): a connection to the generation's
  rendezvous store, which listens on this host's loopback only (agent/relay.py).
Everything else is one JSON object per line.

Before any of it the caller proves it holds a key (core.protocol.access): a rank its run's token, for its own
run only; the supervisor the fleet's secret. A caller that cannot is answered Refused, logged, and
hung up on, and nothing it sent is acted on.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any, Union

import structlog
from pydantic import BaseModel, Field, TypeAdapter, ValidationError

from stayalive.agent.channel import RunChannel
from stayalive.agent.relay import LOOPBACK, splice
from stayalive.core.messages.control import AgentAnswer, AgentRequest, Refused
from stayalive.core.protocol.access import Challenge, Proof, proven, run_token
from stayalive.core.protocol.telemetry import (
    FRAME_MARK,
    Ack,
    Beat,
    Command,
    FileHeader,
    GetFile,
    Hello,
    NodeSteps,
    OpenStore,
    PutFile,
    Record,
    StoreOpened,
    Subscribe,
    pack_steps,
    rank_message,
)
from stayalive.core.run.launch import Endpoint
from stayalive.training.checkpoint import CheckpointError
from stayalive.training.memory import memory_path

log = structlog.get_logger()

BEAT_SECONDS = 1.0
HANDSHAKE_SECONDS = 10.0  # a caller that does not prove itself by then is hung up on
Opening = Annotated[
    Union[Hello, Subscribe, PutFile, GetFile, OpenStore, AgentRequest],  # noqa: UP007
    Field(discriminator="t"),
]
_opening = TypeAdapter(Opening)
Answerer = Callable[[AgentRequest], Awaitable[AgentAnswer]]
RUN_DOORS = (Hello, PutFile, GetFile, OpenStore)  # a rank's openings: its run's token opens them


class NodeHub:
    def __init__(self, node: str, host: str, memory_dir: Path, secret: bytes, advertise: str | None = None) -> None:
        self.node = node
        self.host = host
        self.memory_dir = memory_dir
        self.secret = secret  # the fleet's: it opens the supervisor's doors, and each run's token derives from it
        self.advertise = advertise or host
        self.runs: dict[str, RunChannel] = {}
        self.answer: Answerer | None = None  # the agent's handler of the supervisor's requests
        # The agent's: (run, generation) → the loopback port of the rendezvous store it hosts, if it does.
        self.store_port: Callable[[str, int], int | None] = lambda run_id, generation: None
        self._server: asyncio.Server | None = None

    async def start(self) -> Endpoint:
        # A generation's start brings every rank's store connection to the store's hub at once (16,384
        # at 2,048 nodes): the kernel's longest accept queue, not asyncio's 100, so none is dropped.
        self._server = await asyncio.start_server(self._serve, self.host, 0, backlog=socket.SOMAXCONN)
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
            first = await self._admit(reader, writer)
            if first is None:
                return
            if isinstance(first, Subscribe):
                await self._stream(first, reader, writer)
            elif isinstance(first, PutFile):
                await self._keep_file(first, reader)
            elif isinstance(first, GetFile):
                await self._serve_file(first, writer)
            elif isinstance(first, Hello):
                await self._receive(first, reader, writer)
            elif isinstance(first, OpenStore):
                await self._open_store(first, reader, writer)
            else:
                await self._answer(first, writer)
        except (ConnectionError, ValidationError, CheckpointError, asyncio.IncompleteReadError, TimeoutError) as exc:
            log.warning("hub connection dropped", node=self.node, error=str(exc))
        except asyncio.CancelledError:
            # The agent is stopping: its loop cancels the connections still open. Ended, not raised:
            # Python 3.11's stream callback asks a cancelled handler for its exception and logs an error.
            pass
        finally:
            writer.close()

    async def _admit(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Opening | None:
        """The caller's opening, if it proved it holds the key that opening takes; None once a caller
        who did not is answered Refused (and logged)."""
        nonce = secrets.token_hex(16)
        writer.write(Challenge(nonce=nonce).model_dump_json().encode() + b"\n")
        await writer.drain()
        async with asyncio.timeout(HANDSHAKE_SECONDS):
            try:
                proof = Proof.model_validate_json(await reader.readline())
            except ValidationError:
                await self._refuse(writer, None, "no proof of a key: the hub answers only the fleet and its runs")
                return None
            opening = _opening.validate_json(await reader.readline())
        if not proven(self._key(opening), nonce, proof):
            door = "this run's token" if isinstance(opening, RUN_DOORS) else "the fleet's secret"
            await self._refuse(writer, opening, f"not authorized: {opening.t} takes {door}")
            return None
        return opening

    def _key(self, opening: Opening) -> bytes:
        """A rank's opening takes its own run's token; the supervisor's (requests, subscriptions) the fleet's secret."""
        if isinstance(opening, RUN_DOORS):
            return run_token(self.secret, opening.run_id).encode()
        return self.secret

    async def _refuse(self, writer: asyncio.StreamWriter, opening: Opening | None, why: str) -> None:
        log.warning(
            "hub refused a caller",
            node=self.node,
            peer=str(writer.get_extra_info("peername")),
            run_id=getattr(opening, "run_id", None),
            opening=None if opening is None else opening.t,
            reason=why,
        )
        writer.write(Refused(error=f"{self.node}: {why}").model_dump_json().encode() + b"\n")
        await writer.drain()

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
        tmp.rename(path)  # the node's ranks prune the tier: they know which checkpoint storage holds whole

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

    async def _open_store(self, request: OpenStore, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Join the caller to the generation's rendezvous store on this host's loopback."""
        port = self.store_port(request.run_id, request.generation)
        if port is None:
            await self._refuse(writer, request, f"no rendezvous store of generation {request.generation} here")
            return
        store = await asyncio.open_connection(LOOPBACK, port)
        writer.write(StoreOpened().model_dump_json().encode() + b"\n")
        await splice((reader, writer), store)

    async def _answer(self, request: AgentRequest, writer: asyncio.StreamWriter) -> None:
        """One request from the supervisor, one answer; a failure is answered, not dropped."""
        try:
            if self.answer is None:
                raise RuntimeError(f"the agent of {self.node} takes no requests yet")
            answer = await self.answer(request)
        except Exception as exc:
            log.exception("request failed", node=self.node, request=request.t)
            answer = Refused(error=f"{self.node}: {exc}")
        writer.write(answer.model_dump_json().encode() + b"\n")
        await writer.drain()

    async def _stream(self, subscribe: Subscribe, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A reader's stream: the run's records after where it is, as they arrive, and a Beat every
        second. It acknowledges what it has dealt with (Ack lines), and its place is kept here."""
        channel = self.run(subscribe.run_id)
        cursor = channel.start_for(subscribe.reader, subscribe.generation, subscribe.after)
        acks = asyncio.ensure_future(self._acks(subscribe, channel, reader))  # ends when the reader hangs up
        beat = time.monotonic() + BEAT_SECONDS
        try:
            while not acks.done():
                if batch := channel.after(cursor):
                    cursor = batch[-1].seq
                    writer.write(b"".join(_encode(subscribe, r) for r in batch if _wanted(subscribe, r)))
                    await writer.drain()
                    continue
                if time.monotonic() >= beat:
                    writer.write(Beat(at=time.time()).model_dump_json().encode() + b"\n")
                    await writer.drain()
                    beat = time.monotonic() + BEAT_SECONDS
                waiters: list[asyncio.Future[Any]] = [channel.next_arrival(), acks]
                left = max(0.0, beat - time.monotonic())
                await asyncio.wait(waiters, timeout=left, return_when=asyncio.FIRST_COMPLETED)
        finally:
            acks.cancel()

    @staticmethod
    async def _acks(subscribe: Subscribe, channel: RunChannel, reader: asyncio.StreamReader) -> None:
        """Until the reader hangs up: file each place it acknowledges under its name."""
        while line := await reader.readline():
            ack = Ack.model_validate_json(line)
            if subscribe.reader is not None:
                channel.read_at = time.monotonic()  # the reader is there (seq 0: only that)
                if ack.seq > 0:
                    channel.ack(subscribe.reader, ack.seq)


def _wanted(subscribe: Subscribe, record: Record) -> bool:
    """The kinds it asked for; of a generation's records, none of an older one (no news to it)."""
    message = record.message
    if subscribe.only is not None and message.t not in subscribe.only:
        return False
    generation = getattr(message, "generation", None)
    return subscribe.generation is None or generation is None or generation >= subscribe.generation


def _encode(subscribe: Subscribe, record: Record) -> bytes:
    if subscribe.packed_ranks is not None and isinstance(record.message, NodeSteps):
        return FRAME_MARK + pack_steps(record.seq, record.message, subscribe.packed_ranks)
    return record.model_dump_json().encode() + b"\n"
