"""Reading a run's telemetry from its node agents, as the run monitor's loops do: one stream per node,
resumed after the last record this reader acknowledged (the agent keeps the place), reconnecting
when the line drops.

Step batches arrive as binary frames and go straight to `on_frame` (kept as bytes, decoded in bulk
later); every other record is queued in arrival order. Anything an agent sends, a Beat included,
counts as hearing from it: a node the reader has not heard from for long is silent, not quiet. A
hub sends its first Beat only once it has sent every record it held, so a stream that has brought
one since it opened is caught up: a monitor taking over reads minutes of records at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import structlog
from pydantic import ValidationError

from stayalive.activities.hubs import open_hub
from stayalive.core.messages.control import Refused
from stayalive.core.protocol.telemetry import FRAME_MARK, Ack, Beat, Record, Subscribe, frame_seq, steps_frame

log = structlog.get_logger()


class NodeStreams:
    def __init__(
        self,
        subscribe: Subscribe,
        hubs: dict[str, str],
        secret: bytes,
        on_frame: Callable[[bytes], None] = lambda _: None,
    ) -> None:
        self.subscribe = subscribe  # the same for every node: the run, this reader's name, what it wants
        self.hubs = hubs  # node → where its agent's hub listens
        self.secret = secret  # the fleet's: a hub streams a run's records only to its holders
        self.on_frame = on_frame
        self.records: asyncio.Queue[Record] = asyncio.Queue()
        self.heard = dict.fromkeys(hubs, time.monotonic())  # node → when it last sent anything
        self.read: dict[str, int] = {}  # node → the newest seq read (frames included)
        self.caught_up: set[str] = set()  # nodes whose stream has brought a Beat since it opened
        self._writers: dict[str, asyncio.StreamWriter] = {}
        self._acked: dict[str, int] = {}
        self._tasks: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> NodeStreams:
        self._tasks = [asyncio.create_task(self._follow(node, hub)) for node, hub in self.hubs.items()]
        return self

    async def __aexit__(self, *_: object) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def keepalive(self) -> None:
        """Tell every node this reader is still there (an Ack of nothing): an agent unread for long
        takes itself for cut off from the run and fences itself out (core/decisions/fencing.py)."""
        line = Ack(seq=0).model_dump_json().encode() + b"\n"
        for writer in self._writers.values():
            with contextlib.suppress(ConnectionError, RuntimeError):
                writer.write(line)

    def ack(self, places: dict[str, int]) -> None:
        """Tell each node this reader is done with its records up to `places[node]`."""
        for node, seq in places.items():
            if seq > self._acked.get(node, 0) and (writer := self._writers.get(node)) is not None:
                with contextlib.suppress(ConnectionError, RuntimeError):
                    writer.write(Ack(seq=seq).model_dump_json().encode() + b"\n")
                    self._acked[node] = seq

    def behind(self) -> list[str]:
        """Nodes connected whose backlog has not all arrived yet."""
        return [node for node in self._writers if node not in self.caught_up]

    async def next(self, timeout: float) -> Record | None:
        """The next record from any node, or None after `timeout` seconds of nothing."""
        try:
            async with asyncio.timeout(timeout):  # not wait_for: it can swallow a cancel on 3.11 (gh-86296)
                return await self.records.get()
        except TimeoutError:
            return None

    def drain(self) -> list[Record]:
        """Every record queued now, without waiting."""
        drained = []
        while not self.records.empty():
            drained.append(self.records.get_nowait())
        return drained

    async def _follow(self, node: str, hub: str) -> None:
        """Stream one node's records, reconnecting (from where this reader acknowledged) if the line drops."""
        packed = self.subscribe.packed_ranks
        size = steps_frame(packed).itemsize if packed is not None else 0
        backoff = 0.2
        while True:
            try:
                reader, writer = await open_hub(hub, self.subscribe, self.secret)
                self._writers[node], self._acked[node] = writer, 0
                self.caught_up.discard(node)
                backoff = 0.2
                while mark := await reader.read(1):
                    self.heard[node] = time.monotonic()
                    if mark == FRAME_MARK:
                        frame = await reader.readexactly(size)
                        self.read[node] = frame_seq(frame)
                        self.on_frame(frame)
                        continue
                    line = mark + await reader.readline()
                    if line.startswith(b'{"t":"beat"'):
                        Beat.model_validate_json(line)  # the agent is alive; nothing to file
                        self.caught_up.add(node)
                        continue
                    if line.startswith(b'{"t":"refused"'):
                        raise ConnectionRefusedError(Refused.model_validate_json(line).error)
                    record = Record.model_validate_json(line)
                    self.read[node] = record.seq
                    await self.records.put(record)
            except (OSError, asyncio.IncompleteReadError, ValidationError) as exc:
                log.warning("node telemetry unreachable", run_id=self.subscribe.run_id, node=node, error=str(exc))
            finally:
                self._writers.pop(node, None)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)
