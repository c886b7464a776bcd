"""End-to-end tests share one dev stack and its fleet: each starts with the fleet settled."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
import torch
from temporalio.client import Client, WorkflowFailureError

from harness.tiny import REFERENCE_STEPS, final_state
from stayalive.core.run.lifecycle import RunState
from stayalive.workflows.run import RunWorkflow
from tests.helpers import free, start, tiny_spec, wait_for_fleet


@pytest.fixture(autouse=True)
async def settled_fleet(client: Client) -> None:
    """n1, n2, n3 usable and free: the self-tests and releases of earlier tests are over."""
    await wait_for_fleet(client, free(["n1", "n2", "n3"]))


@pytest.fixture(autouse=True)
async def no_run_outlives_its_test(client: Client) -> AsyncIterator[None]:
    """A test that fails mid-run leaves its run holding nodes: cancel it (a cancelled run gives its
    nodes back), so one failure stays one failure instead of failing every test after it."""
    yield
    async for execution in client.list_workflows("WorkflowType = 'RunWorkflow' AND ExecutionStatus = 'Running'"):
        handle = client.get_workflow_handle(execution.id)
        await handle.cancel()
        with contextlib.suppress(WorkflowFailureError, TimeoutError):
            await asyncio.wait_for(handle.result(), timeout=60)


@pytest.fixture(scope="session")
async def reference_run(
    client: Client, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[dict[str, torch.Tensor]]:
    """Parameters and optimizer state of an uninterrupted run of the tiny spec: what a run that was
    interrupted (and recovered) must end with, bit for bit."""
    spec = tiny_spec(tmp_path_factory.mktemp("reference"), target_step=REFERENCE_STEPS)
    handle = await start(client, spec, "reference")
    assert (await handle.result()).state == RunState.COMPLETED
    yield final_state(await handle.query(RunWorkflow.checkpoints))
