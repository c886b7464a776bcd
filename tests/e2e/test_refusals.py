"""What a node cannot run is refused at launch, with the reason, and costs the fleet nothing."""

from __future__ import annotations

import json
from pathlib import Path

from temporalio.client import Client

from stayalive.core.run.lifecycle import RunState
from stayalive.core.run.spec import RunSpec
from stayalive.workers.devstack import DevStack
from stayalive.workflows.run import RunWorkflow
from tests.helpers import ROOT, free, wait_for_fleet, workflow_id


async def test_nccl_on_nodes_without_cuda_fails_at_launch_and_starts_no_rank(
    client: Client, stack: DevStack, tmp_path: Path
) -> None:
    spec = json.loads((ROOT / "examples" / "plain-ddp.json").read_text())
    spec |= {"backend": "nccl", "checkpoint": {"root": str(tmp_path)}}
    handle = await client.start_workflow(
        RunWorkflow.run, RunSpec.model_validate(spec), id=workflow_id("nccl"), task_queue="stayalive"
    )
    result = await handle.result()

    assert result.state == RunState.FAILED
    assert result.failure is not None
    for node in ("n1", "n2"):
        assert f"{node} cannot run backend nccl" in result.failure, result.failure
    assert "use backend gloo" in result.failure
    assert result.interruptions == [], "a refusal is not a node failure: nothing to restart, nobody quarantined"
    assert not list(stack.state_dir.glob(f"nodes/*/runs/{result.run_id}/*/rank-*.log")), "no rank was started"
    await wait_for_fleet(client, free(["n1", "n2"]))


async def test_a_workdir_missing_on_the_nodes_fails_at_launch_with_the_reason(
    client: Client, stack: DevStack, tmp_path: Path
) -> None:
    spec = json.loads((ROOT / "examples" / "plain-ddp.json").read_text())
    spec |= {"workdir": str(tmp_path / "not-here"), "checkpoint": {"root": str(tmp_path)}}
    handle = await client.start_workflow(
        RunWorkflow.run, RunSpec.model_validate(spec), id=workflow_id("workdir"), task_queue="stayalive"
    )
    result = await handle.result()

    assert result.state == RunState.FAILED and result.failure is not None
    for node in ("n1", "n2"):
        assert f"{node} has no directory {tmp_path / 'not-here'}: fix the run spec's workdir" in result.failure
    assert result.interruptions == []
    assert not list(stack.state_dir.glob(f"nodes/*/runs/{result.run_id}/*/rank-*.log")), "no rank was started"
