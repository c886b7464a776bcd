"""Helpers for the end-to-end tests: specs, waiting on a run, reading what its processes report."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import itertools
import json
import math
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import torch
from temporalio.client import Client, WorkflowHandle

from stayalive.activities.hubs import open_hub
from stayalive.core.fleet import FleetNode
from stayalive.core.run import CheckpointRecord, RunState, RunStatus
from stayalive.core.spec import RunSpec
from stayalive.core.telemetry import Beat, NodeSteps, RankStarted, Record, StepReport, Subscribe
from stayalive.training.dcp_format import DCP_METADATA, load_dcp_metadata, load_dcp_tensors, read_dcp_manifest
from stayalive.workers.secret import SECRET_ENV, load_secret
from stayalive.workflows.fleet import FleetWorkflow, fleet_handle
from stayalive.workflows.run import RunWorkflow

ROOT = Path(__file__).resolve().parent.parent
NODES = ["n1", "n2", "n3"]
_ids = itertools.count()


# Ranks forked from a warm server take their first step within a second, and the tiny GPT's step is a
# few milliseconds of host work: 15 ms of simulated device time keeps a run long enough that a test
# acting "mid-run" (a kill at step 23, a drain, a pause) acts before the run has finished.
TINY_ENTRYPOINT = [
    "python",
    "-m",
    "stayalive.training.train",
    "--preset",
    "tiny",
    "--global-batch",
    "8",
    "--device-ms",
    "15",
]


@contextlib.contextmanager
def holding_the_host(lock: Path, alone: bool) -> Iterator[None]:
    """A share of the host, or all of it (`alone`) once no other worker's test holds a share
    (tests/conftest.py)."""
    with lock.open("a") as file:  # closing it releases the lock
        fcntl.flock(file, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        yield


def tiny_spec(checkpoint_root: Path, **overrides: object) -> RunSpec:
    """4 ranks of the tiny GPT on n1 and n2: a real run that finishes in seconds on two cores."""
    spec: dict[str, object] = {
        "name": "tiny",
        "world_size": 4,
        "ranks_per_node": 2,
        "nodes": ["n1", "n2"],
        "spare_nodes": ["n3"],
        "min_nodes": 2,  # keep the width: results compare bitwise with a run of the same world size
        "entrypoint": TINY_ENTRYPOINT,
        "target_step": 40,
        "checkpoint": {"root": str(checkpoint_root), "interval": "10 steps"},
    }
    return RunSpec.model_validate(spec | overrides)


def workflow_id(prefix: str) -> str:
    return f"{prefix}-{int(time.time())}-{next(_ids)}"


async def start(client: Client, spec: RunSpec, prefix: str) -> WorkflowHandle:
    return await client.start_workflow(RunWorkflow.run, spec, id=workflow_id(prefix), task_queue="stayalive")


async def wait_until(
    handle: WorkflowHandle, predicate: Callable[[RunStatus], bool], timeout: float = 120.0, every: float = 0.3
) -> RunStatus:
    """Poll the run's status query every `every` seconds until `predicate(status)` holds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            status = await handle.query(RunWorkflow.status_query)
            if predicate(status):
                return status
        except Exception:  # between tasks, or the supervisor is being restarted
            pass
        await asyncio.sleep(every)
    raise TimeoutError(f"{handle.id}: condition not reached in {timeout}s")


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


async def rank_pids(client: Client, handle: WorkflowHandle) -> dict[str, dict[int, int]]:
    """node → {rank: pid} of the run's current generation, from what each node agent filed as it
    started its ranks or carried them into the generation (RankStarted)."""
    deadline = time.monotonic() + 30
    while True:
        status = await handle.query(RunWorkflow.status_query)
        where = await hubs(client, status.nodes)
        read = await asyncio.gather(
            *(read_records(where[n], status.run_id, ["started"], quiet=0.1) for n in status.nodes)
        )
        pids = {
            node: {
                m.rank: m.pid
                for r in records
                if isinstance(m := r.message, RankStarted) and m.generation == status.generation
            }
            for node, records in zip(status.nodes, read, strict=True)
        }
        if all(len(p) == status.spec.ranks_per_node for p in pids.values()) or time.monotonic() > deadline:
            return pids
        await asyncio.sleep(0.1)


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

    async def caught_up(self, node: str, step: int, timeout: float = 30.0) -> None:
        """Until this collector holds `node`'s step reports up to `step`: a node released from the run
        forgets its records, so a test that releases one waits for them first."""
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


async def wait_for_step(client: Client, handle: WorkflowHandle, step: int, timeout: float = 120.0) -> int:
    """Wait until the run's first node reports `step` (its ranks' steps, batched per node), reading
    its agent's live telemetry as the run monitor does; the newest step it reported. Its records are
    followed from the run's start (RecordCollector), so a run that got there before this looked is
    seen there all the same."""
    status = await wait_until(handle, lambda s: s.generation == 0 and s.state != RunState.PENDING, timeout=timeout)
    node = status.nodes[0]
    collector = RecordCollector(client, handle, [node])
    try:
        await collector.caught_up(node, step, timeout)
    finally:
        records = await collector.stop()
    return max(r.step for r in step_reports([r for r in records if r.node == node]))


async def activity_log(client: Client, handle: WorkflowHandle) -> list[tuple[str, str, object]]:
    """The run's activities in history order: ("scheduled", type, summary) and ("completed", type,
    result); a local activity, recorded once when it is done, as ("local", type, summary); a signal
    (the run monitor's reports) as ("signaled", name, input)."""
    types: dict[int, str] = {}
    log: list[tuple[str, str, object]] = []
    async for event in handle.fetch_history_events():
        if event.marker_recorded_event_attributes.marker_name == "core_local_activity":
            details = event.marker_recorded_event_attributes.details
            marker = json.loads(details["data"].payloads[0].data)
            summary = await client.data_converter.decode([event.user_metadata.summary])
            log.append(("local", marker["activity_type"], summary[0]))
        elif event.HasField("activity_task_scheduled_event_attributes"):
            name = event.activity_task_scheduled_event_attributes.activity_type.name
            types[event.event_id] = name
            summary = await client.data_converter.decode([event.user_metadata.summary])
            log.append(("scheduled", name, summary[0]))
        elif event.HasField("activity_task_completed_event_attributes"):
            attributes = event.activity_task_completed_event_attributes
            result = (
                await client.data_converter.decode(attributes.result.payloads) if attributes.result.payloads else [None]
            )
            log.append(("completed", types[attributes.scheduled_event_id], result[0]))
        elif event.HasField("workflow_execution_signaled_event_attributes"):
            signal = event.workflow_execution_signaled_event_attributes
            result = await client.data_converter.decode(signal.input.payloads)
            log.append(("signaled", signal.signal_name, result[0] if result else None))
    return log


async def fleet_nodes(client: Client) -> dict[str, FleetNode]:
    fleet = fleet_handle(client)
    return {n.id: n for n in await fleet.query(FleetWorkflow.nodes)}


async def wait_for_fleet(
    client: Client, predicate: Callable[[dict[str, FleetNode]], bool], timeout: float = 60
) -> None:
    deadline = time.monotonic() + timeout
    while not predicate(await fleet_nodes(client)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"fleet condition not reached in {timeout}s: {await fleet_nodes(client)}")
        await asyncio.sleep(0.3)


REFERENCE_STEPS = 60  # the length of the reference run (tests/e2e/conftest.py) that interrupted runs compare with


def final_state(checkpoints: list[CheckpointRecord], step: int = REFERENCE_STEPS) -> dict[str, torch.Tensor]:
    """Model and optimizer tensors of the run's validated checkpoint of `step`, whole."""
    final = next(c for c in checkpoints if c.step == step and c.validated)
    return checkpoint_state(Path(final.path), step)


def checkpoint_state(directory: Path, step: int) -> dict[str, torch.Tensor]:
    """Model and optimizer tensors of the checkpoint of `step` at `directory` (DCP's files), whole."""
    assert read_dcp_manifest(directory).step == step
    tensors = load_dcp_tensors(directory, load_dcp_metadata((directory / DCP_METADATA).read_bytes()))
    return {name: t for name, t in tensors.items() if name.startswith(("model.", "optim."))}


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = [name for name in a if not torch.equal(a[name], b[name])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


class Webhook:
    """A real HTTP receiver on 127.0.0.1: records each POST and answers with `status`."""

    def __init__(self) -> None:
        self.received: list[tuple[dict[str, str], bytes]] = []
        self.status = 200
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                hook.received.append((dict(self.headers), body))
                self.send_response(hook.status)
                self.end_headers()

            def log_message(self, format: str, *args: object) -> None:  # quiet
                pass

        self.server = HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks/page"
