"""The rank's line to its node agent: reports go up without ever blocking a step, commands come down.

One TCP connection per rank to the agent on the same host. A background thread writes reports and
another reads commands, so the training loop only ever touches two in-memory queues.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading

import structlog
from pydantic import BaseModel

from core.telemetry import ToRank, to_rank

log = structlog.get_logger()


class AgentChannel:
    def __init__(self, address: str, hello: BaseModel) -> None:
        host, port = address.rsplit(":", 1)
        self._sock = socket.create_connection((host, int(port)), timeout=10)
        self._sock.settimeout(None)
        self._outbox: queue.Queue[bytes | None] = queue.Queue(maxsize=100_000)
        self._inbox: queue.Queue[ToRank] = queue.Queue()
        self.dropped = 0
        self.send(hello)
        self._writer = threading.Thread(target=self._write, name="stayalive-channel-writer", daemon=True)
        self._reader = threading.Thread(target=self._read, name="stayalive-channel-reader", daemon=True)
        self._writer.start()
        self._reader.start()

    def send(self, message: BaseModel) -> None:
        try:
            self._outbox.put_nowait(message.model_dump_json().encode() + b"\n")
        except queue.Full:
            self.dropped += 1  # telemetry is best-effort; a step is never held up for it

    def received(self) -> list[ToRank]:
        """What the agent sent since the last call, without waiting."""
        received = []
        while True:
            try:
                received.append(self._inbox.get_nowait())
            except queue.Empty:
                return received

    def next(self, timeout: float) -> ToRank | None:
        """Wait for the agent's next message (None on timeout)."""
        try:
            return self._inbox.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self, timeout: float = 5.0) -> None:
        """Flush what is queued (the final reports matter), then hang up."""
        self._outbox.put(None)
        self._writer.join(timeout)
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()

    def _write(self) -> None:
        while (line := self._outbox.get()) is not None:
            try:
                self._sock.sendall(line)
            except OSError as exc:
                log.warning("agent channel closed", error=str(exc))
                return

    def _read(self) -> None:
        try:
            for line in self._sock.makefile("rb"):
                self._inbox.put(to_rank.validate_json(line))
        except (OSError, ValueError) as exc:
            log.warning("agent channel read failed", error=str(exc))
