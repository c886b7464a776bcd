"""One run's traffic on one node: the records its ranks and its agent produce, numbered, and where
each reader of them (the run monitor's loops) has got to.

A rank's step reports are folded into one NodeSteps per step for the whole node (core.monitor.progress's
StepBatcher), so the monitor reads one record per node per step, not one per rank. A reader's place
is kept here, on the node that produced the records: a monitor that restarts (a retried attempt,
the next workflow segment) resumes after the last record it acknowledged, and the workflow carries
no cursor for any node.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from dataclasses import dataclass, field

from stayalive.core.monitor.progress import StepBatcher
from stayalive.core.protocol.telemetry import Held, Hello, RankExited, RankMessage, RankSteps, Record, StepReport

# Records a node keeps per run for a reader that reconnects: minutes of steps at thousands of steps/s.
RETAINED = 200_000


@dataclass
class RunChannel:
    run_id: str
    node: str
    records: deque[Record] = field(default_factory=lambda: deque(maxlen=RETAINED))
    seq: int = 0
    last_step: dict[int, int] = field(default_factory=dict)  # rank → the newest step it reported
    ranks: dict[int, asyncio.StreamWriter] = field(default_factory=dict)  # connected ranks, by rank
    starts: dict[int, int] = field(default_factory=dict)  # generation → the seq before its first record
    acked: dict[str, int] = field(default_factory=dict)  # reader → the last seq it acknowledged
    batchers: dict[int, StepBatcher] = field(default_factory=dict)  # generation → this node's steps
    # When a named reader (the run monitor) last said anything here, or the last launch: an agent
    # whose ranks run unread for long is cut off from the run (core.decisions.fencing.cut_off).
    read_at: float = field(default_factory=time.monotonic)
    holding: set[int] = field(default_factory=set)  # ranks that hold (a pause, a drain): they write nothing
    _arrival: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    def begin(self, generation: int, ranks: list[int]) -> None:
        """This node's ranks of `generation` are about to start: readers of it start here."""
        self.starts.setdefault(generation, self.seq)
        self.read_at = time.monotonic()
        if ranks and generation not in self.batchers:
            self.batchers = {generation: StepBatcher(generation, range(ranks[0], ranks[-1] + 1))}

    def append(self, message: RankMessage) -> None:
        """File a message from a rank or from the agent. Step reports go out batched per node."""
        if isinstance(message, RankSteps):  # a rank's batch: its steps one by one
            for report in message.reports():
                self.append(report)
            return
        if isinstance(message, Held):
            self.holding.add(message.rank)
        elif isinstance(message, StepReport | Hello):
            self.holding.discard(message.rank)
        if isinstance(message, StepReport):
            self.last_step[message.rank] = message.step
            batcher = self.batchers.get(message.generation)
            if batcher is not None:
                for steps in batcher.add(message):
                    self._file(steps)
                return
        elif isinstance(message, Hello):
            self.last_step.pop(message.rank, None)  # a new generation starts counting again
        elif isinstance(message, RankExited) and (batcher := self.batchers.get(message.generation)) is not None:
            for steps in batcher.flush():  # it will not report again: what it did report goes out now
                self._file(steps)
        self._file(message)

    def _file(self, message: RankMessage) -> None:
        self.seq += 1
        self.records.append(Record(seq=self.seq, node=self.node, message=message))
        arrived, self._arrival = self._arrival, asyncio.get_running_loop().create_future()
        arrived.set_result(None)

    def next_arrival(self) -> asyncio.Future[None]:
        return self._arrival

    def start_for(self, reader: str | None, generation: int | None, after: int) -> int:
        """Where a reader's stream starts: after what it acknowledged, else at its generation's first
        record (the end of the channel for a generation not started here yet), else after `after`."""
        if reader is not None and reader in self.acked:
            return self.acked[reader]
        if generation is not None:
            return self.starts.get(generation, self.seq)
        return after

    def ack(self, reader: str, seq: int) -> None:
        self.acked[reader] = max(seq, self.acked.get(reader, 0))

    def after(self, cursor: int) -> list[Record]:
        if not self.records or self.records[-1].seq <= cursor:
            return []
        return list(itertools.islice(self.records, max(0, cursor + 1 - self.records[0].seq), None))
