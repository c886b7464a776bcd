"""Continue-as-new in the middle of a generation, with real ranks: on a dev server of this module's own
that suggests continue-as-new at 60 history events, a healthy generation runs past the suggestion
(`health.reattach_after`: 2 s here, 10 minutes by default) and the run continues as new while its
ranks keep training. Each new workflow segment re-attaches to the running ranks, its monitor reading
each node's stream from the last one's acknowledged place: no restart, no step lost, no sample read
twice."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from temporalio.client import Client

from harness.records import RecordCollector, step_reports
from stayalive.core.run.lifecycle import RunState
from stayalive.workers.devstack import DevStack, free_port
from stayalive.workers.temporal import connect, plain
from tests.helpers import ROOT, secret_named, start, steps_judged, tiny_spec

SUGGESTED_AT = 60  # history events: a launch and a few checkpoints' verdicts
TARGET = 600
GLOBAL_BATCH = 8  # the tiny trainer's (harness/tiny.py)


@pytest.fixture(autouse=True)
def settled_fleet() -> None:
    """This module's own stack starts settled (replaces the shared fleet's fixture)."""


@pytest.fixture(autouse=True)
def no_run_outlives_its_test() -> None:
    """Its stack goes with the module (replaces the shared fleet's fixture)."""


@pytest.fixture(scope="module")
async def suggesting_stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[DevStack, Client]]:
    dev = DevStack(
        state_dir=tmp_path_factory.mktemp("reattach"),
        nodes=["n1", "n2", "n3"],
        spares=["n3"],
        port=free_port(),
        ui_port=None,
        metrics_port=free_port(),
        workdir=ROOT,
        temporal_flags=["--dynamic-config-value", f"limit.historyCount.suggestContinueAsNew={SUGGESTED_AT}"],
    )
    try:
        dev.start()
        with secret_named(dev.secret_file):  # the record collector reads the agents with it
            await dev.ready()
            yield dev, await connect(plain(dev.address))
    finally:
        dev.stop()


async def test_a_healthy_generation_continues_as_new_while_its_ranks_train_on(
    suggesting_stack: tuple[DevStack, Client], tmp_path: Path
) -> None:
    dev, client = suggesting_stack
    spec = tiny_spec(tmp_path / "checkpoints", target_step=TARGET, health={"reattach_after": "2s"})
    handle = await start(client, spec, "reattach")
    collector = RecordCollector(client, handle, spec.nodes)
    result = await handle.result()
    assert result.state == RunState.COMPLETED and result.final_step == TARGET, result.failure
    assert result.interruptions == [], "re-attached, never restarted"

    executions = [e async for e in client.list_workflows(f"WorkflowId = '{handle.id}'")]
    for _ in range(50):  # the dev server's visibility trails the runs by a moment
        if len(executions) >= 2:
            break
        await asyncio.sleep(0.1)
        executions = [e async for e in client.list_workflows(f"WorkflowId = '{handle.id}'")]
    assert len(executions) >= 2, "the run continued as new in the middle of its generation"

    reports = step_reports(await collector.stop())
    assert {r.generation for r in reports} == {0}, "the ranks of generation 0 trained to the end"
    counts = Counter((r.step, r.rank) for r in reports)
    assert sorted(counts) == [(step, rank) for step in range(1, TARGET + 1) for rank in range(4)]
    assert set(counts.values()) == {1}, "each step of each rank reported once"
    consumed = sorted(position for r in reports for position in r.samples)
    assert consumed == list(range(TARGET * GLOBAL_BATCH)), "a sample was lost or read twice"
    # Every segment's monitor took up where the last one's acknowledgement left each node's stream.
    judged = await asyncio.to_thread(steps_judged, dev.metrics_url, handle.id)
    assert judged >= TARGET, f"{judged:g} steps judged of {TARGET}"
