"""A run driven through 160 interruptions: the real RunWorkflow, simulated activities (sim/), on
`temporal server start-dev`, recording the history a production server would. One run, shared by the
tests below, each checking one promise:

- docs/architecture.md §4: history grows with decisions, not with steps (at most 50 events per
  interruption), and the run continues-as-new when the server suggests it (4,096 events by default;
  here the server's `limit.historyCount.suggestContinueAsNew` is 1,024, so that the run crosses it
  twice in half the interruptions and half the time);
- at the end the run is complete, and so are its timeline and its goodput ledger.

The time-skipping test server ran the same run beside it until the suite outgrew its 20 minutes on two
cores: that server schedules an empty workflow task after any task in which an activity started or
heartbeated (sdk-java TestWorkflowMutableStateImpl.completeWorkflowTask), events a real server never
writes, so it measured the budget less exactly, and tests/sim/test_month.py runs on it anyway.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.api.history.v1 import HistoryEvent
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowHandle
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

from stayalive.core.run.lifecycle import RunState
from stayalive.core.run.status import RunResult
from stayalive.core.run.timeline import INTERRUPTIONS_KEPT, Cause, PagingClass
from stayalive.sim.cluster import FailureSchedule, SimulatedCluster
from stayalive.sim.workers import register, simulated_workers
from stayalive.workers.devstack import SEARCH_ATTRIBUTES, temporal_binary
from stayalive.workflows.run import TASK_QUEUE, RunWorkflow
from tests.helpers import tiny_spec

# Half a minute (the dev server persists every event). A crash costs its history 15 to 26 events
# (fewer when a busy worker answers several in one workflow task), so 160 pass the 1,024 at which this
# server suggests continue-as-new twice, and the timeline's INTERRUPTIONS_KEPT (128) once.
INTERRUPTIONS = 160
CHECKPOINT_EVERY = 100
CRASH_AFTER = 150  # steps past the resume step: one checkpoint, then 50 steps lost, every generation
EVENTS_PER_INTERRUPTION = 50  # the budget of docs/architecture.md §4
SUGGESTED_AT = 1024  # the server suggests continue-as-new once history passes this many events
STALL_S = 180  # half a minute here, alone; a loaded CI host has taken twice that


@dataclass
class FinishedRun:
    result: RunResult
    segments: list[list[HistoryEvent]]  # the history of every run of the continue-as-new chain


@pytest.fixture(scope="module")
async def run(tmp_path_factory: pytest.TempPathFactory) -> FinishedRun:
    """The run, against `temporal server start-dev`; `root` is named in the spec, the simulator writes nothing."""
    async with await WorkflowEnvironment.start_local(
        dev_server_existing_path=str(temporal_binary()),
        data_converter=pydantic_data_converter,
        dev_server_extra_args=[
            *(arg for attribute in SEARCH_ATTRIBUTES for arg in ("--search-attribute", attribute)),
            *("--dynamic-config-value", f"limit.historyCount.suggestContinueAsNew={SUGGESTED_AT}"),
        ],
    ) as env:
        return await simulate(env.client, tmp_path_factory.mktemp("checkpoints"), INTERRUPTIONS)


async def simulate(client: Client, root: Path, interruptions: int) -> FinishedRun:
    spec = tiny_spec(
        root,
        target_step=CHECKPOINT_EVERY * (interruptions + 1),
        failure_limit={"failures": interruptions},  # 160 crashes in half a minute: far above any real rate
        checkpoint={"root": str(root), "interval": f"{CHECKPOINT_EVERY} steps"},
    )
    schedule = FailureSchedule.crash_every_generation(interruptions, CRASH_AFTER, world_size=spec.world_size)
    cluster = SimulatedCluster([*spec.nodes, *spec.spare_nodes], schedule, step_seconds=0.0002)
    began = time.monotonic()
    async with asyncio.timeout(STALL_S), simulated_workers(client, cluster):
        await register(client, spec.nodes, spec.spare_nodes)
        handle = await client.start_workflow(RunWorkflow.run, spec, id="many-interruptions", task_queue=TASK_QUEUE)
        await closed(client.get_workflow_handle(handle.id))
    segments = await history_segments(client, handle.id)
    completed = segments[-1][-1].workflow_execution_completed_event_attributes.result
    [result] = await client.data_converter.decode(completed.payloads, [RunResult])
    gaps = events_between_interruptions(segments)
    print(
        f"\n{interruptions} interruptions in {time.monotonic() - began:.0f}s; segments of "
        f"{[len(s) for s in segments]} events; events between interruptions: mean {sum(gaps) / len(gaps):.1f}, "
        f"max {max(gaps)}; "
        f"{result.ledger}"
    )
    return FinishedRun(result=result, segments=segments)


def test_the_run_completes_through_every_interruption(run: FinishedRun) -> None:
    assert run.result.state == RunState.COMPLETED, run.result.failure
    assert run.result.final_step == CHECKPOINT_EVERY * (INTERRUPTIONS + 1)
    assert sum(count_interruptions(s) for s in run.segments) == INTERRUPTIONS
    assert len(run.segments) > 1, "the run never continued-as-new"


def test_every_interruption_is_on_the_timeline_in_full(run: FinishedRun) -> None:
    # The timeline keeps the newest INTERRUPTIONS_KEPT whole; the others are counted.
    earlier = run.result.earlier_interruptions
    assert len(run.result.interruptions) == INTERRUPTIONS_KEPT
    assert earlier.count == earlier.failures == earlier.by_cause["crash"] == INTERRUPTIONS - INTERRUPTIONS_KEPT
    for generation, interruption in enumerate(run.result.interruptions, start=earlier.count):
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


def test_the_goodput_ledger_accounts_for_the_whole_run(run: FinishedRun) -> None:
    book = run.result.ledger
    costs = [book.startup, book.checkpoint, book.lost, book.recovery, book.idle]
    assert book.wall > 0 and all(c >= 0 for c in costs)
    assert book.checkpoint > 0 and book.lost > 0 and book.recovery > 0
    # Every second of the run is in exactly one category: productive is what the others leave.
    assert sum(costs) <= book.wall
    assert book.productive + sum(costs) == pytest.approx(book.wall)
    assert 0 < book.goodput < 1


def test_every_segment_ends_near_the_continue_as_new_suggestion(run: FinishedRun) -> None:
    """The workflow acts on the suggestion at its next decision, so a segment passes the threshold by
    at most one interruption's events."""
    lengths = [len(s) for s in run.segments]
    assert max(lengths) <= SUGGESTED_AT + EVENTS_PER_INTERRUPTION, lengths


def test_history_grows_at_most_50_events_per_interruption(run: FinishedRun) -> None:
    """Every event counts: a real server schedules no workflow task without an event for it."""
    gaps = events_between_interruptions(run.segments)
    assert max(gaps) <= EVENTS_PER_INTERRUPTION, f"mean {sum(gaps) / len(gaps):.1f}, max {max(gaps)}"


async def closed(handle: WorkflowHandle) -> None:
    """Wait until the latest run of the chain has closed."""
    # Between two runs of the chain the latest one can still read as CONTINUED_AS_NEW.
    running = (WorkflowExecutionStatus.RUNNING, WorkflowExecutionStatus.CONTINUED_AS_NEW)
    while (await handle.describe()).status in running:
        await asyncio.sleep(0.5)


async def history_segments(client: Client, workflow_id: str) -> list[list[HistoryEvent]]:
    """The history of every run of the chain, first to last, each found from the run it continues."""
    segments: list[list[HistoryEvent]] = []
    run_id: str | None = (await client.get_workflow_handle(workflow_id).describe()).run_id
    while run_id:
        history = await client.get_workflow_handle(workflow_id, run_id=run_id).fetch_history()
        segments.insert(0, list(history.events))
        run_id = history.events[0].workflow_execution_started_event_attributes.continued_execution_run_id
    assert segments[-1][-1].event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED
    return segments


def is_interruption(event: HistoryEvent) -> bool:
    """The event that tells the workflow of a crash: the generation's monitor completed with RankFailed."""
    if event.event_type != EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED:
        return False
    payloads = event.activity_task_completed_event_attributes.result.payloads
    return any(b'"kind":"rank_failed"' in p.data for p in payloads)


def count_interruptions(events: list[HistoryEvent]) -> int:
    return sum(is_interruption(e) for e in events)


def events_between_interruptions(segments: list[list[HistoryEvent]]) -> list[int]:
    """Events from one crash report to the next, across continue-as-new (whose own events count)."""
    events = [e for segment in segments for e in segment]
    marks = [i for i, e in enumerate(events) if is_interruption(e)]
    return [b - a for a, b in itertools.pairwise(marks)]
