"""A rank's reports to its node agent: sent at once, in order, never holding up the step, all
delivered when the rank closes its channel (training/channel.py)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from stayalive.core.protocol.access import Challenge
from stayalive.core.protocol.telemetry import Hello, StepReport
from stayalive.training.channel import AgentChannel

REPORTS = 5_000  # of 5 KB each: far more than a loopback socket buffers unread


class Agent:
    """The agent's end of one rank's connection: it reads only when told to, `pace` seconds between
    reads of 64 KiB (a busy agent: the rank's socket fills and drains by turns)."""

    def __init__(self, pace: float = 0.0) -> None:
        self.pace = pace
        self.server = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.server.getsockname()[1]}"
        self.reading = threading.Event()
        self.lines: list[bytes] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        connection, _ = self.server.accept()
        with connection:
            connection.sendall(Challenge(nonce="0").model_dump_json().encode() + b"\n")
            self.reading.wait()
            chunks = []
            while chunk := connection.recv(1 << 16):
                chunks.append(chunk)
                time.sleep(self.pace)
            self.lines = b"".join(chunks).splitlines()

    def received(self) -> list[StepReport]:
        self._thread.join(timeout=30)
        return [StepReport.model_validate_json(line) for line in self.lines if line.startswith(b'{"t":"step"')]


@pytest.fixture
def agent(request: pytest.FixtureRequest) -> Iterator[Agent]:
    agent = Agent(getattr(request, "param", 0.0))
    yield agent
    agent.server.close()


def send_reports(channel: AgentChannel, steps: range) -> None:
    for step in steps:
        channel.send(report(step))


def report(step: int) -> StepReport:
    return StepReport(
        rank=0, generation=0, step=step, compute_s=0.01, step_s=0.02, loss=1.0, samples=list(range(1000)), at=0.0
    )


def test_reports_to_an_agent_that_is_not_reading_never_block_and_all_arrive_in_order(agent: Agent) -> None:
    channel = AgentChannel(agent.address, Hello(run_id="r", rank=0, generation=0, pid=1), token="")
    sent = threading.Thread(target=send_reports, args=(channel, range(1, REPORTS + 1)))
    sent.start()
    sent.join(timeout=60)
    assert not sent.is_alive(), "a report waited for an agent that was not reading"
    agent.reading.set()
    channel.close(timeout=30)
    assert [r.step for r in agent.received()] == list(range(1, REPORTS + 1))
    assert channel.dropped == 0


@pytest.mark.parametrize("agent", [0.0, 0.001], ids=["agent reading", "agent reading slowly"], indirect=True)
def test_reports_from_two_threads_arrive_whole(agent: Agent) -> None:
    """The training thread and the checkpoint writer both report, while the socket fills and drains:
    no line interleaves another."""
    channel = AgentChannel(agent.address, Hello(run_id="r", rank=0, generation=0, pid=1), token="")
    agent.reading.set()
    threads = [threading.Thread(target=send_reports, args=(channel, range(first, REPORTS, 2))) for first in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    channel.close(timeout=30)
    steps = [r.step for r in agent.received()]
    assert sorted(steps) == list(range(1, REPORTS))
    assert [s for s in steps if s % 2] == list(range(1, REPORTS, 2))  # each thread's reports in its order
