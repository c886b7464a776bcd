"""A run that ends leaves nothing running: the web UI lists no pending activity for a closed run,
however it ended."""

from __future__ import annotations

from pathlib import Path

import pytest
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowFailureError, WorkflowHandle

from stayalive.core.run.lifecycle import RunState
from tests.helpers import start, tiny_spec, wait_for_step


async def pending(handle: WorkflowHandle) -> list[str]:
    """What the web UI lists under Pending Activities, by type."""
    described = await handle.describe()
    return [a.activity_type.name for a in described.raw_description.pending_activities]


async def test_a_completed_run_leaves_no_activity_pending(client: Client, checkpoint_root: Path) -> None:
    handle = await start(client, tiny_spec(checkpoint_root, target_step=20), "closing-completed")
    assert (await handle.result()).state == RunState.COMPLETED
    assert await pending(handle) == []
    # Once every rank finished, the monitor ended by itself with the final checkpoint's verdict: a
    # cancel would have waited for its next heartbeat (about a second of every completed run).
    history = [e async for e in handle.fetch_history_events()]
    monitors = {
        e.event_id for e in history if e.activity_task_scheduled_event_attributes.activity_type.name == "monitor_run"
    }
    completed = {e.activity_task_completed_event_attributes.scheduled_event_id for e in history}
    assert monitors and monitors <= completed, "every monitor completed"
    assert not [e for e in history if e.HasField("activity_task_cancel_requested_event_attributes")]


async def test_a_cancelled_run_leaves_no_activity_pending(client: Client, checkpoint_root: Path) -> None:
    handle = await start(client, tiny_spec(checkpoint_root, target_step=5000), "closing-cancelled")
    await wait_for_step(client, handle, 5)  # the first generation's monitor is watching
    await handle.cancel()
    with pytest.raises(WorkflowFailureError):
        await handle.result()
    assert (await handle.describe()).status == WorkflowExecutionStatus.CANCELED
    assert await pending(handle) == []
    # Stopped by the run, not ended by the release killing the ranks it watched (a race it may win).
    closed = [e async for e in handle.fetch_history_events() if e.HasField("activity_task_canceled_event_attributes")]
    assert len(closed) == 1, "the monitor was cancelled, and acknowledged it, before the run closed"
