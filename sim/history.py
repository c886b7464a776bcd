"""What a run cost Temporal, read from the histories of every execution it touched: its own chain of
runs (continue-as-new) and the fleet's. What tests/sim asserts and `python -m bench.scale` reports.

An interruption's cost is every event, in any of those executions, from the moment it happened (the
simulator marks it) until the ranks train again — the next generation's first step, and the workflow
task that takes it in — or the next interruption, if that comes first. Checkpoint verdicts after
that are what a generation costs anyway, interrupted or not.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from google.protobuf.message import Message
from temporalio.api.common.v1 import Payload
from temporalio.api.enums.v1 import EventType
from temporalio.api.history.v1 import HistoryEvent
from temporalio.client import Client

from stayalive.core.messages.events import MONITOR_REPORT

E = EventType
_OPENED = {E.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED}
_CLOSED = {
    E.EVENT_TYPE_ACTIVITY_TASK_COMPLETED,
    E.EVENT_TYPE_ACTIVITY_TASK_FAILED,
    E.EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT,
    E.EVENT_TYPE_ACTIVITY_TASK_CANCELED,
}


# A quiet monitor (core.messages.events.Quiet) costs the run's history a cycle: its completion and the
# workflow task for it, a timer started and fired, the workflow task for that, and the next monitor
# scheduled and started. The real monitor never goes quiet: for what the cycle brought it sends one
# signal each, and the workflow task for it (SIGNAL_EVENTS).
QUIET_CYCLE_EVENTS = 11
SIGNAL_EVENTS = 4


@dataclass
class Cost:
    what: str
    events: int
    bytes: int
    as_signalled: int = 0  # the events, each quiet monitor's cycle counted as the signals it stands for


async def chain(client: Client, workflow_id: str) -> list[list[HistoryEvent]]:
    """The history of every run of a continue-as-new chain, first to last."""
    segments: list[list[HistoryEvent]] = []
    run_id: str | None = (await client.get_workflow_handle(workflow_id).describe()).run_id
    while run_id:
        history = await client.get_workflow_handle(workflow_id, run_id=run_id).fetch_history()
        segments.insert(0, list(history.events))
        run_id = history.events[0].workflow_execution_started_event_attributes.continued_execution_run_id
    return segments


def seconds(event: HistoryEvent) -> float:
    return event.event_time.seconds + event.event_time.nanos / 1e9


def costs(
    marks: list[tuple[float, str]], run: list[HistoryEvent], others: list[HistoryEvent], empty_tasks: bool = True
) -> list[Cost]:
    """What each marked interruption cost, over the run's events and the other executions' events;
    without the test server's empty workflow tasks (is_empty_task) if `empty_tasks` is False."""
    ends = [_back_to_normal(run, at) for at, _ in marks]
    counted = [*run, *others] if empty_tasks else [*_own_events(run), *_own_events(others)]
    windows = []
    for i, (at, what) in enumerate(marks):
        end = min(ends[i], marks[i + 1][0]) if i + 1 < len(marks) else ends[i]
        touched = [e for e in counted if at <= seconds(e) < end]
        quiet = sum(QUIET_CYCLE_EVENTS - SIGNAL_EVENTS * news for e in touched if (news := _quiet_news(e)) is not None)
        windows.append(
            Cost(
                what=what,
                events=len(touched),
                bytes=sum(e.ByteSize() for e in touched),
                as_signalled=len(touched) - quiet,
            )
        )
    return windows


def _quiet_news(event: HistoryEvent) -> int | None:
    """For a quiet monitor's completion, how many signals the real monitor would have sent for what
    it brought (its first step and verdicts); None for any other event."""
    if event.event_type != E.EVENT_TYPE_ACTIVITY_TASK_COMPLETED:
        return None
    result = event.activity_task_completed_event_attributes.result
    payload = result.payloads[0].data if result.payloads else b""
    if b'"kind":"quiet"' not in payload:
        return None
    report = json.loads(payload)
    return (report.get("first_step") is not None) + len(report.get("verdicts", []))


def is_empty_task(before: HistoryEvent, event: HistoryEvent) -> bool:
    """A workflow task scheduled right as the last one completed: nothing happened that it could be
    for. The time-skipping test server schedules one after any task during which an activity started
    or heartbeated (sdk-java TestWorkflowMutableStateImpl.completeWorkflowTask); a real server does not."""
    return (
        event.event_type == E.EVENT_TYPE_WORKFLOW_TASK_SCHEDULED
        and before.event_type == E.EVENT_TYPE_WORKFLOW_TASK_COMPLETED
    )


def _own_events(events: list[HistoryEvent]) -> list[HistoryEvent]:
    """The events, less each empty workflow task's three (scheduled, started, completed)."""
    skip: set[int] = set()
    for i in range(1, len(events)):
        if is_empty_task(events[i - 1], events[i]):
            skip.update(range(i, min(i + 3, len(events))))
    return [e for i, e in enumerate(events) if i not in skip]


def _back_to_normal(run: list[HistoryEvent], at: float) -> float:
    """Just past the workflow task that takes in the first step after `at`: it comes by signal, or
    with the monitor's completion (MonitorReport.first_step)."""
    for i, event in enumerate(run):
        if seconds(event) >= at and _first_step(event):
            done = next((e for e in run[i:] if e.event_type == E.EVENT_TYPE_WORKFLOW_TASK_COMPLETED), run[-1])
            return seconds(done) + 1e-6
    return seconds(run[-1]) + 1e-6


def _first_step(event: HistoryEvent) -> bool:
    if event.event_type == E.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED:
        signal = event.workflow_execution_signaled_event_attributes
        payload = signal.input.payloads[0].data if signal.input.payloads else b""
        return signal.signal_name == MONITOR_REPORT and b'"kind":"first_step"' in payload
    if event.event_type == E.EVENT_TYPE_ACTIVITY_TASK_COMPLETED:
        result = event.activity_task_completed_event_attributes.result
        payload = result.payloads[0].data if result.payloads else b""
        return b'"first_step":{"kind":"first_step"' in payload
    return False


def largest_payload(events: Iterable[HistoryEvent]) -> int:
    """The largest single payload (an input, a result, a signal's, continue-as-new's) in the events."""
    return max((p.ByteSize() for e in events for p in _payloads(e)), default=0)


def _payloads(message: Message) -> Iterator[Payload]:
    for field, value in message.ListFields():
        values = value if field.is_repeated else [value]
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            values = list(value.values())
        for item in values:
            if isinstance(item, Payload):
                yield item
            elif isinstance(item, Message):
                yield from _payloads(item)


def most_pending_activities(events: Iterable[HistoryEvent]) -> int:
    """The most activities one execution had scheduled and not yet closed, at any point."""
    pending = most = 0
    for event in events:
        if event.event_type in _OPENED:
            pending += 1
            most = max(most, pending)
        elif event.event_type in _CLOSED:
            pending -= 1
    return most


def longest_workflow_task(events: list[HistoryEvent]) -> float:
    """Seconds from a workflow task's start to its completion, the longest in the execution."""
    started: float | None = None
    longest = 0.0
    for event in events:
        if event.event_type == E.EVENT_TYPE_WORKFLOW_TASK_STARTED:
            started = seconds(event)
        elif event.event_type == E.EVENT_TYPE_WORKFLOW_TASK_COMPLETED and started is not None:
            longest = max(longest, seconds(event) - started)
            started = None
    return longest
