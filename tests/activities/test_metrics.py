"""The supervisor's /metrics: update the exporter, scrape it over HTTP, read the lines."""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any, cast

import pytest
from prometheus_client import REGISTRY
from temporalio import workflow
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from stayalive.activities.metrics import OPEN_RUNS, Exporter, refresh_once
from stayalive.core.book.health import Health
from stayalive.core.run.status import Progress
from stayalive.core.run.timeline import Cause
from stayalive.workers.devstack import temporal_binary
from tests.core.runs import at, checkpoint, interruption, status


def health(checkpoint_interval_s: float | None = 817.0, *, earlier: Sequence[Cause] = ()) -> Health:
    """A run 6 h old: 5 min startup, a crash at 3 h losing 200 steps of 2 s and restarting in 600 s,
    after interruptions of the `earlier` causes that cost nothing."""
    costless = [interruption(at(minutes=10 + n), cause, restart_seconds=0.0) for n, cause in enumerate(earlier)]
    run = status(
        first_step_at=at(minutes=5),
        progress=Progress(step=9000, step_seconds_p50=2.0, step_seconds_max=2.5),
        checkpoints=[checkpoint(at(hours=1), 30.0)],
        interruptions=[*costless, interruption(at(hours=3), lost_steps=200, restart_seconds=600.0)],
    )
    return Health.of(run, at(hours=6), checkpoint_interval_s)


@pytest.fixture
def exporter() -> Iterator[Exporter]:
    exporter = Exporter()
    yield exporter
    exporter.close()


def scrape(port: int) -> dict[str, float]:
    """The exposition's samples, 'name{labels}' → value (comments dropped)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    samples = (line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    return {name: float(value) for name, value in samples}


def test_update_then_scrape(exporter: Exporter) -> None:
    port = exporter.serve(0)
    exporter.update("run-a", health(earlier=[Cause.CRASH, Cause.CRASH, Cause.HANG]))
    metrics = scrape(port)
    assert metrics['stayalive_goodput_ratio{run_id="run-a"}'] == pytest.approx((21600 - 1330) / 21600)
    assert metrics['stayalive_ledger_seconds{category="recovery",run_id="run-a"}'] == 600.0
    assert metrics['stayalive_ledger_seconds{category="lost",run_id="run-a"}'] == 400.0
    assert metrics['stayalive_ledger_seconds{category="productive",run_id="run-a"}'] == 21600 - 1330
    assert metrics['stayalive_step_time_p50_seconds{run_id="run-a"}'] == 2.0
    assert metrics['stayalive_step_time_max_seconds{run_id="run-a"}'] == 2.5
    assert metrics['stayalive_checkpoint_interval_seconds{run_id="run-a"}'] == 817.0
    assert metrics['stayalive_interruptions{cause="crash",run_id="run-a"}'] == 3
    assert metrics['stayalive_interruptions{cause="hang",run_id="run-a"}'] == 1
    assert metrics['stayalive_interruptions{cause="node_lost",run_id="run-a"}'] == 0  # every cause, from zero
    ledger = [v for k, v in metrics.items() if k.startswith("stayalive_ledger_seconds{")]
    assert sum(ledger) == pytest.approx(21600)  # the categories partition wall-clock


def test_runs_are_labelled_apart_and_forgotten_whole(exporter: Exporter) -> None:
    port = exporter.serve(0)
    exporter.update("run-a", health())
    exporter.update("run-b", health(checkpoint_interval_s=None))
    metrics = scrape(port)
    assert 'stayalive_checkpoint_interval_seconds{run_id="run-b"}' not in metrics  # fixed in steps: no value
    assert metrics['stayalive_interruptions{cause="hang",run_id="run-b"}'] == 0
    exporter.forget("run-a")
    assert not [k for k in scrape(port) if 'run_id="run-a"' in k]
    assert exporter.runs == {"run-b"}


def test_the_registry_is_its_own(exporter: Exporter) -> None:
    exporter.update("run-a", health())
    assert REGISTRY.get_sample_value("stayalive_goodput_ratio", {"run_id": "run-a"}) is None
    assert exporter.registry.get_sample_value("stayalive_goodput_ratio", {"run_id": "run-a"}) is not None
    assert "python_gc_objects_collected_total" not in str(list(exporter.registry.collect()))


class FakeHandle:
    def __init__(self, answers: dict[str, Any], asked: list[tuple[str, object]]) -> None:
        self.answers = answers
        self.asked = asked

    async def query(self, name: str, *, result_type: object, **_: object) -> Any:
        self.asked.append((name, result_type))
        answer = self.answers[name]
        if isinstance(answer, Exception):
            raise answer
        return answer


class FakeClient:
    """What refresh_once uses of a temporalio Client: the listing and query handles by workflow id."""

    def __init__(self, runs: dict[str, dict[str, Any]]) -> None:
        self.runs = runs
        self.queries: list[str] = []
        self.asked: list[tuple[str, object]] = []

    async def list_workflows(self, query: str) -> AsyncIterator[Any]:
        self.queries.append(query)
        for workflow_id in self.runs:
            yield type("Execution", (), {"id": workflow_id})()

    def get_workflow_handle(self, workflow_id: str) -> FakeHandle:
        return FakeHandle(self.runs[workflow_id], self.asked)


async def test_refresh_reads_each_open_run_by_query_name_and_forgets_closed_ones(exporter: Exporter) -> None:
    client = FakeClient(
        {
            "run-a": {"health": health(earlier=[Cause.CRASH])},
            "run-b": {"health": health()},
            "run-c": {"health": RuntimeError("query timed out")},
        }
    )
    exporter.update("run-c", health(earlier=[Cause.CRASH] * 4))  # from an earlier pass
    exporter.update("run-old", health())  # closed since
    assert await refresh_once(cast(Client, client), exporter) == {"run-a", "run-b", "run-c"}
    assert client.queries == [OPEN_RUNS]
    assert client.asked == [("health", Health)] * 3, "one query per run: ledger and counts from one state"
    value = exporter.registry.get_sample_value
    assert value("stayalive_interruptions", {"run_id": "run-a", "cause": "crash"}) == 2
    assert value("stayalive_interruptions", {"run_id": "run-a", "cause": "hang"}) == 0
    assert value("stayalive_interruptions", {"run_id": "run-c", "cause": "crash"}) == 5  # kept: query failed
    assert exporter.runs == {"run-a", "run-b", "run-c"}
    assert value("stayalive_goodput_ratio", {"run_id": "run-old"}) is None


# -- against a real Temporal dev server ------------------------------------------------------------------

HEALTH = health(earlier=[Cause.NODE_LOST])


@workflow.defn(name="RunWorkflow")
class StandIn:
    """Answers RunWorkflow's `health` query and does nothing else."""

    @workflow.run
    async def run(self) -> None:
        await workflow.wait_condition(lambda: False)

    @workflow.query
    def health(self) -> Health:
        return HEALTH


async def test_refresh_against_a_dev_server(exporter: Exporter) -> None:
    """The listing's query syntax, query by name, and decoding the answers with the pydantic converter."""
    async with (
        await WorkflowEnvironment.start_local(
            dev_server_existing_path=temporal_binary(), data_converter=pydantic_data_converter
        ) as env,
        Worker(env.client, task_queue="metrics", workflows=[StandIn], workflow_runner=UnsandboxedWorkflowRunner()),
    ):
        handle = await env.client.start_workflow(StandIn.run, id="run-metrics", task_queue="metrics")
        deadline = time.monotonic() + 20
        while await refresh_once(env.client, exporter) != {"run-metrics"}:  # visibility lags a little
            assert time.monotonic() < deadline, "the run never showed up in the listing"
            await asyncio.sleep(0.2)
        value = exporter.registry.get_sample_value
        assert value("stayalive_interruptions", {"run_id": "run-metrics", "cause": "node_lost"}) == 1
        assert value("stayalive_goodput_ratio", {"run_id": "run-metrics"}) == pytest.approx(HEALTH.goodput)
        await handle.terminate("done")
        while await refresh_once(env.client, exporter):
            assert time.monotonic() < deadline + 20, "the closed run stayed in the listing"
            await asyncio.sleep(0.2)
        assert exporter.runs == set()
