"""A run's records, read from its node agents the way the run monitor reads them: where each node's
agent listens, one stream per node and generation, and what the step reports say about the samples
the run read."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from temporalio.client import Client, WorkflowHandle

from stayalive.activities.hubs import open_hub
from stayalive.core.protocol.telemetry import Beat, NodeSteps, Record, StepReport, Subscribe
from stayalive.workers.secret import SECRET_ENV, load_secret
from stayalive.workflows.fleet import FleetWorkflow, fleet_handle
from stayalive.workflows.run import RunWorkflow


async def hubs(client: Client, nodes: list[str]) -> dict[str, str]:
    """Where each node's agent listens, as it told the fleet."""
    return await fleet_handle(client).query(FleetWorkflow.hubs, nodes)


async def subscribe(hub: str, subscription: Subscribe) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A stream of a node agent's records, opened as the run monitor opens one: with the fleet's
    secret, the session's dev stack's (tests/conftest.py names its file in the environment)."""
    return await open_hub(hub, subscription, load_secret(Path(os.environ[SECRET_ENV])))


async def read_records(hub: str, run_id: str, only: list[str] | None = None, quiet: float = 0.5) -> list[Record]:
    """Every record (of the kinds in `only`) a node agent holds for the run, read the way the run
    monitor reads them, until nothing more comes for `quiet` seconds."""
    reader, writer = await subscribe(hub, Subscribe(run_id=run_id, only=only))
    records: list[Record] = []
    try:
        while True:
            try:
                async with asyncio.timeout(quiet):
                    line = await reader.readline()
            except TimeoutError:
                return records
            if not line:
                return records
            if not line.startswith(b'{"t":"beat"'):
                records.append(Record.model_validate_json(line))
    finally:
        writer.close()


class RecordCollector:
    """Everything a run's node agents receive, read live the way the run monitor reads it: one stream
    per node and generation, for every node the run may use (its nodes, its spares, any node its
    status has shown) and every generation up to the one after the current one.

    A node released from the run (quarantined, lost) forgets its records, and its agent gives the
    run a new channel if the node joins it again: a stream opened on the old one would wait there
    forever. So a stream whose generation has not begun on it is opened again every RESTART_S,
    until it has: a fresh stream of a generation that has begun replays it from its first record."""

    RESTART_S = 0.5

    def __init__(self, client: Client, handle: WorkflowHandle, nodes: list[str] | None = None) -> None:
        self.records: list[Record] = []
        self._known = list(nodes or [])
        self._streams: dict[tuple[str, int], _Stream] = {}  # (node, generation) → its stream
        self._watch = asyncio.create_task(self._watch_nodes(client, handle))

    async def _watch_nodes(self, client: Client, handle: WorkflowHandle) -> None:
        run_id = f"{handle.id}/{handle.first_execution_run_id[:8]}" if handle.first_execution_run_id else None
        generation = 0
        while True:
            with contextlib.suppress(Exception):
                # The status may stall for seconds during a launch: the known nodes are followed
                # one generation ahead of the newest status, from the run's start on. (Not
                # asyncio.wait_for: on Python 3.11 it can swallow the cancel that stop() sends,
                # and this loop then outlives its test, polling a server that is gone.)
                async with asyncio.timeout(5):
                    status = await handle.query(RunWorkflow.status_query)
                run_id, generation = status.run_id, status.generation
                self._known += [n for n in status.nodes if n not in self._known]
            with contextlib.suppress(Exception):
                if run_id is not None and self._known:
                    where = await hubs(client, self._known)
                    for node, hub in where.items():
                        for g in range(generation + 2):
                            self._keep(node, hub, run_id, g)
            await asyncio.sleep(0.2)

    def _keep(self, node: str, hub: str, run_id: str, generation: int) -> None:
        stream = self._streams.get((node, generation))
        if stream is not None and (stream.begun or time.monotonic() - stream.opened < self.RESTART_S):
            return
        if stream is not None:
            stream.task.cancel()
        fresh = _Stream(opened=time.monotonic())
        fresh.task = asyncio.create_task(self._follow(fresh, hub, run_id, generation))
        self._streams[(node, generation)] = fresh

    async def _follow(self, stream: _Stream, hub: str, run_id: str, generation: int) -> None:
        """One generation's records on one node (a record of no generation, such as a GPU reading,
        comes with the stream that was first to see it). Only a stream that has begun files records:
        one opened again replays what an earlier one of the same generation had not."""
        reader, writer = await subscribe(hub, Subscribe(run_id=run_id, generation=generation))
        try:
            while line := await reader.readline():
                if line.startswith(b'{"t":"beat"'):
                    stream.beat_at = Beat.model_validate_json(line).at
                    continue
                record = Record.model_validate_json(line)
                of = getattr(record.message, "generation", None)
                stream.begun = stream.begun or of == generation
                if of == generation or (of is None and stream.begun):
                    self.records.append(record)
        finally:
            writer.close()

    async def caught_up(self, node: str, step: int, timeout: float = 90.0) -> None:
        """Until this collector holds `node`'s step reports up to `step`: a node released from the run
        forgets its records, so a test that releases one waits for them first. A generation's start-up
        alone took half a minute on a loaded two-core CI host."""
        deadline = time.monotonic() + timeout
        while max((r.step for r in step_reports([r for r in self.records if r.node == node])), default=0) < step:
            if time.monotonic() > deadline:
                begun = sorted(g for (n, g), s in self._streams.items() if n == node and s.begun)
                raise TimeoutError(f"no step {step} from {node} in {timeout}s (generations begun there: {begun})")
            await asyncio.sleep(0.05)

    async def stop(self, timeout: float = 5.0) -> list[Record]:
        """Everything collected, once each stream that has begun has delivered what its hub held when
        asked: a stream is in order, and its hub beats within a second of having nothing to send. A run
        that has just completed has released its nodes, which read nothing to a stream opened later."""
        asked, deadline = time.time(), time.monotonic() + timeout
        while any(s.begun and s.beat_at < asked and not s.task.done() for s in self._streams.values()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"a node's stream delivered nothing for {timeout}s")
            await asyncio.sleep(0.05)
        tasks = [self._watch, *(s.task for s in self._streams.values())]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # none outlives its test
        return self.records


@dataclass
class _Stream:
    opened: float
    begun: bool = False  # its generation's records came: kept open from then on
    beat_at: float = 0.0  # when its hub sent the newest beat: everything before it has been read
    task: asyncio.Task[None] = field(init=False)


def step_reports(records: list[Record]) -> list[StepReport]:
    """The ranks' step reports, out of the batches their agents made of them (one per node and step);
    a rank whose report never came is left out."""
    return [
        StepReport(
            rank=steps.first_rank + i,
            generation=steps.generation,
            step=steps.step,
            compute_s=steps.compute_s[i],
            step_s=steps.step_s[i],
            loss=steps.loss[i],
            samples=samples,
            at=steps.at,
        )
        for record in records
        if isinstance(steps := record.message, NodeSteps)
        for i, samples in enumerate(steps.samples)
        if samples or not math.isnan(steps.compute_s[i])
    ]


def sample_tally(reports: list[StepReport], resumed: list[int], target: int, global_batch: int) -> tuple[int, int, int]:
    """(lost, repeated, out of order) sample positions up to the target along the run's final
    lineage: generation g's steps after where it resumed and up to where the next one resumed. Out
    of order: read at another step than the one the data order gives it."""
    starts, ends = [0, *resumed], [*resumed, target]
    lineage = [
        r
        for generation, (first, last) in enumerate(zip(starts, ends, strict=True))
        for r in reports
        if r.generation == generation and first < r.step <= last
    ]
    consumed = Counter(p for r in lineage for p in r.samples)
    lost = sum(1 for p in range(target * global_batch) if p not in consumed)
    repeated = sum(n - 1 for n in consumed.values())
    out_of_order = sum(1 for r in lineage for p in r.samples if p // global_batch + 1 != r.step)
    return lost, repeated, out_of_order


def samples_once(reports: list[StepReport], resumed: list[int], target: int, global_batch: int) -> bool:
    """Every sample position up to the target read exactly once, in order, along the run's final lineage."""
    return sample_tally(reports, resumed, target, global_batch) == (0, 0, 0)
