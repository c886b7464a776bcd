"""What a run cost Temporal, read from the histories of every execution it touched: its own chain of
runs (continue-as-new) and the fleet's. What tests/sim asserts and `python -m bench.scale` reports.

An interruption's cost is every event, in any of those executions, from the moment it happened (the
simulator marks it) until the run is back to normal — the first checkpoint verdict after the next
generation's first step, and the workflow task that files it — or the next interruption, if that
comes first. The one checkpoint verdict in that span is part of what a generation costs anyway.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from google.protobuf.message import Message
from temporalio.api.common.v1 import Payload
from temporalio.api.enums.v1 import EventType
from temporalio.api.history.v1 import HistoryEvent
from temporalio.client import Client

from core.events import CHECKPOINT_JUDGED, MONITOR_REPORT

E = EventType
_OPENED = {E.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED}
_CLOSED = {
    E.EVENT_TYPE_ACTIVITY_TASK_COMPLETED,
    E.EVENT_TYPE_ACTIVITY_TASK_FAILED,
    E.EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT,
    E.EVENT_TYPE_ACTIVITY_TASK_CANCELED,
}


@dataclass
class Cost:
    what: str
    events: int
    bytes: int


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


def costs(marks: list[tuple[float, str]], run: list[HistoryEvent], others: list[HistoryEvent]) -> list[Cost]:
    """What each marked interruption cost, over the run's events and the other executions' events."""
    ends = [_back_to_normal(run, at) for at, _ in marks]
    windows = []
    for i, (at, what) in enumerate(marks):
        end = min(ends[i], marks[i + 1][0]) if i + 1 < len(marks) else ends[i]
        touched = [e for e in [*run, *others] if at <= seconds(e) < end]
        windows.append(Cost(what=what, events=len(touched), bytes=sum(e.ByteSize() for e in touched)))
    return windows


def _back_to_normal(run: list[HistoryEvent], at: float) -> float:
    """Just past the workflow task that files the first checkpoint verdict after the first step that
    follows `at`: the run is checkpointing its new generation as it would with nothing wrong."""
    first_step = False
    for i, event in enumerate(run):
        if seconds(event) < at or event.event_type != E.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED:
            continue
        signal = event.workflow_execution_signaled_event_attributes
        payload = signal.input.payloads[0].data if signal.input.payloads else b""
        if signal.signal_name == MONITOR_REPORT and b'"kind":"first_step"' in payload:
            first_step = True
        elif signal.signal_name == CHECKPOINT_JUDGED and first_step:
            done = next((e for e in run[i:] if e.event_type == E.EVENT_TYPE_WORKFLOW_TASK_COMPLETED), run[-1])
            return seconds(done) + 1e-6
    return seconds(run[-1]) + 1e-6


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
