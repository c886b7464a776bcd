"""The rank's line to its node agent: reports go up without ever blocking a step, commands come down.

One TCP connection per rank to the agent on the same host. A background thread writes reports and
another reads commands, so the training loop only ever touches two in-memory queues. Reports are
serialized on the writer thread, off the step's path, and sent as soon as they are made: a rank that
crashes should have told its agent how far it got. The report queue is a `queue.SimpleQueue` (C, one
lock): a `threading.Event` woken every step cost the training thread measurably more CPU.
"""

from __future__ import annotations

import atexit
import contextlib
import queue
import socket
import threading

import structlog
from pydantic import BaseModel

from stayalive.core.control import Refused
from stayalive.core.telemetry import ToRank, to_rank
from stayalive.training.hub_client import connect_hub

log = structlog.get_logger()

PENDING_MAX = 100_000  # reports held while the agent is not reading; beyond it, they are dropped


class AgentChannel:
    def __init__(self, address: str, hello: BaseModel, token: str) -> None:
        self._sock, self._lines = connect_hub(address, hello, token, timeout=10)
        self._sock.settimeout(None)
        self._pending: queue.SimpleQueue[BaseModel | None] = queue.SimpleQueue()  # None: hang up after the rest
        self._inbox: queue.Queue[ToRank] = queue.Queue()
        self.dropped = 0
        self._writer = threading.Thread(target=self._write, name="stayalive-channel-writer", daemon=True)
        self._reader = threading.Thread(target=self._read, name="stayalive-channel-reader", daemon=True)
        self._writer.start()
        self._reader.start()
        atexit.register(self.close)  # a rank that exits (sys.exit too) sends what is pending first

    def send(self, message: BaseModel) -> None:
        if self._pending.qsize() >= PENDING_MAX:
            self.dropped += 1  # telemetry is best-effort; a step is never held up for it
            return
        self._pending.put(message)

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
        self._pending.put(None)
        self._writer.join(timeout)
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()

    def _write(self) -> None:
        while True:
            messages = [self._pending.get()]  # wait for the next report, then take what queued behind it
            with contextlib.suppress(queue.Empty):
                while True:
                    messages.append(self._pending.get_nowait())
            lines = [m.model_dump_json().encode() + b"\n" for m in messages if m is not None]
            try:
                if lines:
                    self._sock.sendall(b"".join(lines))
            except OSError as exc:
                log.warning("agent channel closed", error=str(exc))
                return
            if None in messages:
                return

    def _read(self) -> None:
        try:
            for line in self._lines:
                if line.startswith(b'{"t":"refused"'):  # the hub did not take this rank's token
                    log.error("node agent refused this rank", error=Refused.model_validate_json(line).error)
                    return
                self._inbox.put(to_rank.validate_json(line))
        except (OSError, ValueError) as exc:
            log.warning("agent channel read failed", error=str(exc))
