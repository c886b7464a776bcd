"""Where stayalive's recovery time goes: one crash, from the fault to the first step after resume,
pieced together from what the run leaves behind.

  the rank's own log       "injected crash" (the fault), then each restarted rank's "restored"
  the node agents' logs    rank failed, generation prepared, rank forked / cold start,
                           ranks started
  the workflow history     every workflow task and activity (scheduled, started, completed,
                           cancelled), with the server's timestamps
  the run timeline         the first step every rank completed after resume (restart_seconds)

All on one host, so one clock. Every line is logfmt with an ISO `timestamp=` (training/logs.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from rich.table import Table
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowHandle

from stayalive.workflows.run import RunWorkflow

_PAIR = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)')
_AGENT_EVENTS = ("rank failed", "generation prepared", "rank forked", "ranks started")
_HISTORY = {
    EventType.EVENT_TYPE_WORKFLOW_TASK_SCHEDULED: "workflow task scheduled",
    EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED: "workflow task started",
    EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED: "workflow task completed",
    EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED: "scheduled",
    EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED: "started",
    EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED: "completed",
    EventType.EVENT_TYPE_ACTIVITY_TASK_CANCEL_REQUESTED: "cancel requested",
    EventType.EVENT_TYPE_ACTIVITY_TASK_CANCELED: "cancelled",
    EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED: "failed",
}


def logfmt(line: str) -> dict[str, str]:
    return {key: value.strip('"') for key, value in _PAIR.findall(line)}


def timestamp(fields: dict[str, str]) -> float | None:
    raw = fields.get("timestamp")
    return datetime.fromisoformat(raw).timestamp() if raw else None


@dataclass
class Milestones:
    """Moments of one recovery, in time order, as (seconds since the epoch, source, what)."""

    crash_at: float
    first_step_at: float
    moments: list[tuple[float, str, str]] = field(default_factory=list)

    def add(self, at: float | None, source: str, what: str) -> None:
        if at is not None and self.crash_at - 0.5 <= at <= self.first_step_at + 0.05:
            self.moments.append((at, source, what))

    def table(self) -> Table:
        out = Table()
        for column in ("+s", "Δs", "source", "what"):
            out.add_column(column, justify="right" if "s" in column[-1:] and column != "source" else "left")
        previous = self.crash_at
        for at, source, what in sorted(self.moments):
            out.add_row(f"{at - self.crash_at:+.3f}", f"{at - previous:.3f}", source, what)
            previous = at
        return out


def _log_lines(path: Path) -> list[dict[str, str]]:
    try:
        return [logfmt(line) for line in path.read_text(errors="replace").splitlines() if "timestamp=" in line]
    except OSError:
        return []


async def stayalive_milestones(client: Client, handle: WorkflowHandle, run_id: str, state_dir: Path) -> Milestones:
    """The first interruption of the run `handle`, taken apart."""
    crash_at = None
    for path in state_dir.glob(f"nodes/*/runs/{run_id}/g0/rank-*.log"):
        for fields in _log_lines(path):
            if fields.get("event") == "injected crash":
                crash_at = timestamp(fields)
    interruption = (await handle.query(RunWorkflow.timeline))[0]
    assert interruption.restart_seconds is not None
    exited_at = interruption.at.timestamp()
    first_step_at = exited_at + interruption.restart_seconds + interruption.idle_seconds
    milestones = Milestones(crash_at=crash_at or exited_at, first_step_at=first_step_at)
    milestones.add(crash_at, f"rank {interruption.rank}", "injected crash: os._exit")
    milestones.add(exited_at, f"agent {interruption.node}", "rank exit seen (the timeline's start of R)")
    milestones.add(first_step_at, "monitor", "first step every rank completed after resume (end of R)")

    for path in sorted(state_dir.glob("logs/agent-*.log")):
        for fields in _log_lines(path):
            if fields.get("event") in _AGENT_EVENTS or fields.get("event", "").startswith("cold start"):
                keys = ("rank", "generation", "pid", "reason", "error")
                detail = " ".join(f"{k}={fields[k]}" for k in keys if k in fields)
                milestones.add(timestamp(fields), f"agent {fields.get('node', '?')}", f"{fields['event']} {detail}")
    for path in sorted(state_dir.glob(f"nodes/*/runs/{run_id}/g1/rank-*.log")):
        for fields in _log_lines(path):
            if fields.get("event") == "restored":
                what = f"restored from {fields.get('source')} in {fields.get('seconds')}s"
                milestones.add(timestamp(fields), f"rank {fields.get('rank')}", what)

    names: dict[int, str] = {}
    async for event in handle.fetch_history_events():
        kind = _HISTORY.get(event.event_type)
        if kind is None:
            continue
        at = event.event_time.seconds + event.event_time.nanos / 1e9
        which = event.WhichOneof("attributes") or ""
        attributes: Any = getattr(event, which) if which else None
        if which == "activity_task_scheduled_event_attributes":
            names[event.event_id] = f"{attributes.activity_type.name} on {attributes.task_queue.name}"
            kind = f"{kind} {names[event.event_id]}"
        elif which.startswith("activity_task_"):
            kind = f"{kind} {names.get(attributes.scheduled_event_id, '?')}"
        milestones.add(at, "history", kind)
    return milestones


def restart_starts(milestones: Milestones) -> str:
    """How the restarted ranks started: "4 forked", "2 forked, 2 cold", …"""
    forked = sum(what.startswith("rank forked") for _, _, what in milestones.moments)
    cold = sum(what.startswith("cold start") for _, _, what in milestones.moments)
    if not forked and not cold:
        return "cold (no fork server)"
    parts = [f"{forked} forked"] if forked else []
    parts += [f"{cold} cold"] if cold else []
    return ", ".join(parts)
