"""Helpers for the end-to-end tests: specs, waiting on a run, reading what its processes report."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import itertools
import json
import os
import time
import urllib.request
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import torch
from prometheus_client.parser import text_string_to_metric_families
from temporalio.client import Client, WorkflowHandle

from harness.records import RecordCollector, hubs, read_records, step_reports
from harness.tiny import tiny_spec as tiny_spec  # the tests' spec, shared with harness/histories.py
from stayalive.core.fleet.model import FleetNode
from stayalive.core.protocol.telemetry import RankStarted
from stayalive.core.run.lifecycle import RunState
from stayalive.core.run.spec import RunSpec
from stayalive.core.run.status import RunStatus
from stayalive.workers.secret import SECRET_ENV
from stayalive.workflows.fleet import FleetWorkflow, fleet_handle
from stayalive.workflows.run import RunWorkflow

ROOT = Path(__file__).resolve().parent.parent
NODES = ["n1", "n2", "n3"]
_ids = itertools.count()


@contextlib.contextmanager
def holding_the_host(lock: Path, alone: bool) -> Iterator[None]:
    """A share of the host, or all of it (`alone`) once no other worker's test holds a share
    (tests/conftest.py)."""
    with lock.open("a") as file:  # closing it releases the lock
        fcntl.flock(file, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        yield


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
    except TimeoutError as exc:  # say where the run went instead
        now = await handle.query(RunWorkflow.status_query)
        said = [(i.cause.value, i.node, i.generation, i.detail) for i in now.interruptions]
        where = f"the run is {now.state.value} in generation {now.generation} on {now.nodes}"
        raise TimeoutError(f"{exc}; {where}, interrupted by {said}") from exc
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


def free(names: list[str]) -> Callable[[dict[str, FleetNode]], bool]:
    """For `wait_for_fleet`: each of these nodes usable and in no run (the fleet's others may be
    quarantined or busy: earlier tests leave them so)."""
    return lambda nodes: all(nodes[n].state.usable and nodes[n].run_id is None for n in names)


async def wait_for_fleet(
    client: Client, predicate: Callable[[dict[str, FleetNode]], bool], timeout: float = 60
) -> None:
    deadline = time.monotonic() + timeout
    while not predicate(await fleet_nodes(client)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"fleet condition not reached in {timeout}s: {await fleet_nodes(client)}")
        await asyncio.sleep(0.3)


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


def steps_judged(metrics_url: str, run: str) -> float:
    """How many steps a supervisor worker's monitors judged for the run, from its /metrics."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "stayalive_monitor_judging_lag_seconds"
        for sample in family.samples
        if sample.name.endswith("_count") and sample.labels["run_id"] == run
    )


@contextlib.contextmanager
def secret_named(path: Path) -> Iterator[None]:
    """The environment names `path` as the fleet's secret while a module's own stack runs: the
    helpers that read its agents' records find it there, as with the session's stack."""
    before = os.environ.get(SECRET_ENV)
    os.environ[SECRET_ENV] = str(path)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(SECRET_ENV, None)
        else:
            os.environ[SECRET_ENV] = before
