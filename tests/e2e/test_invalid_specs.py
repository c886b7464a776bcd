"""Invalid specs are rejected with a clear message and start nothing, whichever client submits them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowFailureError
from temporalio.service import RPCError

from stayalive.workers.devstack import DevStack, temporal_binary
from tests.helpers import ROOT, workflow_id

BASE = json.loads((ROOT / "examples" / "gpt-small.json").read_text())

CASES = {
    "missing field": (
        {k: v for k, v in BASE.items() if k != "entrypoint"},
        "entrypoint: required field is missing",
    ),
    "world size": (BASE | {"world_size": 6}, "set world_size to 4"),
    "entrypoint string": (BASE | {"entrypoint": "python -m stayalive.training.train"}, "must be an argv list"),
    "unknown fault": (BASE | {"faults": [{"kind": "meteor", "rank": 1}]}, "unknown kind 'meteor'"),
}


@pytest.mark.parametrize(("raw", "message"), CASES.values(), ids=CASES.keys())
async def test_stayalive_cli_rejects_and_starts_nothing(
    raw: dict[str, object], message: str, client: Client, stack: DevStack, tmp_path: Path
) -> None:
    name = workflow_id("bad")
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(raw | {"name": name}))
    for command in (["check", str(path)], ["--address", stack.address, "run", str(path)]):
        done = subprocess.run(
            [sys.executable, "-m", "stayalive.workers.cli", *command],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=60,
        )
        assert done.returncode == 2, done.stdout + done.stderr
        assert message in done.stderr, done.stderr
        assert "not a valid run spec" in done.stderr
    with pytest.raises(RPCError, match="not found"):
        await client.get_workflow_handle(name).describe()


async def test_temporal_cli_start_fails_fast_and_launches_nothing(client: Client, stack: DevStack) -> None:
    raw, message = CASES["world size"]
    run_id = workflow_id("bad-spec")
    subprocess.run(
        [
            *(temporal_binary(), "workflow", "start", "--type", "RunWorkflow", "--task-queue", "stayalive"),
            *("--workflow-id", run_id, "--input", json.dumps(raw), "--address", stack.address),
        ],
        check=True,
        capture_output=True,
    )
    handle = client.get_workflow_handle(run_id)
    with pytest.raises(WorkflowFailureError) as failure:
        await handle.result()
    assert message in str(failure.value.cause)
    events = [event.event_type async for event in handle.fetch_history_events()]
    assert EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED not in events
