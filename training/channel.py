"""The rank's line to its node agent: reports go up without ever blocking a step, commands come down.

One TCP connection per rank to the agent on the same host. A report is sent as soon as it is made,
from the thread that made it, without waiting (MSG_DONTWAIT): a rank that crashes has told its agent
how far it got. Only when the socket's buffer is full (the agent is not reading) do reports queue
for a writer thread, which sends them in order and blocks instead of the step. Waking a writer
thread for every report cost each rank 0.1 ms of CPU a step, the largest part of what the
training API cost a 25 ms step on a shared host (bench.api). A reader thread takes commands in.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import queue
import socket
import threading

import structlog
from pydantic import BaseModel

from stayalive.core.messages.control import Refused
from stayalive.core.protocol.telemetry import ToRank, to_rank
from stayalive.training.hub_client import connect_hub

log = structlog.get_logger()

PENDING_MAX = 100_000  # reports held while the agent is not reading; beyond it, they are dropped


class AgentChannel:
    def __init__(self, address: str, hello: BaseModel, token: str) -> None:
        self._sock, self._lines = connect_hub(address, hello, token, timeout=10)
        self._sock.settimeout(None)
        self._inbox: queue.SimpleQueue[ToRank] = queue.SimpleQueue()
        self.dropped = 0
        # What the socket did not take yet, in order; senders append behind it while it is not empty.
        self._backlog: collections.deque[bytes] = collections.deque()
        self._flushing = False  # the writer thread is sending lines taken from the backlog
        self._closing = False
        self._queued = threading.Condition()  # guards the backlog; a direct send holds it too
        self._writer = threading.Thread(target=self._write, name="stayalive-channel-writer", daemon=True)
        self._reader = threading.Thread(target=self._read, name="stayalive-channel-reader", daemon=True)
        self._writer.start()
        self._reader.start()
        atexit.register(self.close)  # a rank that exits (sys.exit too) sends what is pending first

    def send(self, *messages: BaseModel) -> None:
        """Send `messages` in order, in one write where the socket takes them."""
        lines = b"".join(message.model_dump_json().encode() + b"\n" for message in messages)
        with self._queued:
            if self._closing:
                return
            if not (self._backlog or self._flushing):
                try:
                    sent = self._sock.send(lines, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    sent = 0
                except OSError:
                    return  # the agent is gone: the writer thread has said so, or the reader will
                if sent == len(lines):
                    return
                lines = lines[sent:]
            if len(self._backlog) >= PENDING_MAX:
                self.dropped += 1  # telemetry is best-effort; a step is never held up for it
                return
            self._backlog.append(lines)
            self._queued.notify()

    def received(self) -> list[ToRank]:
        """What the agent sent since the last call, without waiting."""
        received = []
        while not self._inbox.empty():  # this thread is the only reader: not empty means a message
            received.append(self._inbox.get_nowait())
        return received

    def next(self, timeout: float) -> ToRank | None:
        """Wait for the agent's next message (None on timeout)."""
        try:
            return self._inbox.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self, timeout: float = 5.0) -> None:
        """Flush what is pending (the final reports matter), then hang up."""
        with self._queued:
            self._closing = True
            self._queued.notify()
        self._writer.join(timeout)
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()

    def _write(self) -> None:
        """Send the backlog, blocking, until the channel closes with nothing left to send."""
        while True:
            with self._queued:
                self._queued.wait_for(lambda: self._backlog or self._closing)
                if not self._backlog:
                    return
                lines = b"".join(self._backlog)
                self._backlog.clear()
                self._flushing = True  # what is sent meanwhile queues behind these lines
            try:
                self._sock.sendall(lines)
            except OSError as exc:
                log.warning("agent channel closed", error=str(exc))
                with self._queued:
                    self._closing = True
                return
            with self._queued:
                self._flushing = False

    def _read(self) -> None:
        try:
            for line in self._lines:
                if line.startswith(b'{"t":"refused"'):  # the hub did not take this rank's token
                    log.error("node agent refused this rank", error=Refused.model_validate_json(line).error)
                    return
                self._inbox.put(to_rank.validate_json(line))
        except (OSError, ValueError) as exc:
            log.warning("agent channel read failed", error=str(exc))
