"""How the run monitor talks back while it runs: one heartbeat its two loops share, and signals to the
workflow run that started it."""

from __future__ import annotations

import copy
from typing import Any

from pydantic import BaseModel
from temporalio import activity
from temporalio.service import RPCError, RPCStatusCode


class Heartbeat:
    """The activity's heartbeat details, as one dict. Each beat replaces the last one's details whole,
    so every loop keeps its own keys here and each beat sends them all; `resumed` is what the last
    attempt sent, for a retry to pick up from. A beat copies its keys: what a loop changes afterwards
    (a cursor past a finding not yet signalled) goes out only with that loop's next beat."""

    def __init__(self) -> None:
        details = activity.info().heartbeat_details
        self.resumed: dict[str, Any] = dict(details[0]) if details and isinstance(details[0], dict) else {}
        self.details: dict[str, Any] = dict(self.resumed)

    def __call__(self, **update: Any) -> None:
        self.details.update(copy.deepcopy(update))
        activity.heartbeat(self.details)


async def signal_run(name: str, payload: BaseModel) -> bool:
    """Signal this attempt's own workflow run (the segment that started it); False when that run is
    closed (continued as new, or ended): a signal to it is refused as not found, and nobody listens."""
    info = activity.info()
    assert info.workflow_id is not None, "only an activity of a workflow reports to one"
    workflow = activity.client().get_workflow_handle(info.workflow_id, run_id=info.workflow_run_id)
    try:
        await workflow.signal(name, payload)
    except RPCError as exc:
        if exc.status == RPCStatusCode.NOT_FOUND:
            return False
        raise
    return True
