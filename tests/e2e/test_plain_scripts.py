"""Plain torchrun scripts (`hooks: false`) under stayalive finish the way they do under torchrun."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import torch
from temporalio.client import Client

from stayalive.core.run.lifecycle import RunState
from stayalive.core.run.spec import RunSpec
from stayalive.core.run.timeline import Cause
from stayalive.workers.devstack import process_alive
from stayalive.workflows.run import RunWorkflow
from tests.helpers import ROOT, free, rank_pids, wait_for_fleet, wait_until, workflow_id

# Runs in a row, each killing a rank on the other node than the last: the hang at exit this guards
# against (torch._dynamo imported ahead of the script) struck cold and forked runs alike. Ten in a row
# took three minutes of a two-core suite; where a script's exit is in doubt, raise it.
RUNS = 3
# An epoch of the tutorial script takes a tenth to a quarter of a second here: a kill after epoch 3 has
# nine epochs (one to two seconds) to land mid-run, where it lands within a few tenths of a second.
EPOCHS = 12
KILL_AFTER = 3


def plain_spec(entrypoint: list[str], checkpoint_root: Path, **health: object) -> RunSpec:
    spec = json.loads((ROOT / "examples" / "plain-ddp.json").read_text())
    spec |= {"entrypoint": entrypoint, "checkpoint": {"root": str(checkpoint_root)}, "health": health}
    return RunSpec.model_validate(spec)


def epochs_run(snapshot: Path) -> int:
    try:
        return int(torch.load(snapshot, weights_only=True)["epochs_run"])
    except (FileNotFoundError, RuntimeError, EOFError):  # not written yet, or being replaced
        return 0


async def test_a_tutorial_shaped_ddp_script_completes_run_after_run_with_a_rank_killed(
    client: Client, tmp_path: Path
) -> None:
    """examples/tutorial_ddp.py frees its DDP model after destroy_process_group, as the tutorials do.
    Forked from the warm server, with a rank killed mid-run, every rank must still exit by itself:
    a run that needed the exit grace would record its lingering ranks."""
    for i in range(RUNS):
        snapshot = tmp_path / f"snapshot-{i}.pt"
        entrypoint = ["python", "examples/tutorial_ddp.py", "--epochs", str(EPOCHS), "--snapshot", str(snapshot)]
        spec = plain_spec(entrypoint, tmp_path, exit_grace="60s")
        await wait_for_fleet(client, free(spec.nodes))
        handle = await client.start_workflow(RunWorkflow.run, spec, id=workflow_id("tutorial"), task_queue="stayalive")
        deadline = time.monotonic() + 60
        while epochs_run(snapshot) < KILL_AFTER:
            assert time.monotonic() < deadline, f"run {i}: no snapshot past epoch {KILL_AFTER}"
            await asyncio.sleep(0.05)
        victim = ("n1", 1) if i % 2 == 0 else ("n2", 2)
        os.kill((await rank_pids(client, handle))[victim[0]][victim[1]], signal.SIGKILL)

        result = await handle.result()
        assert result.state == RunState.COMPLETED, f"run {i}: {result.state} {result.failure}"
        assert [(x.cause, x.node, x.rank) for x in result.interruptions] == [(Cause.CRASH, *victim)], f"run {i}"
        assert epochs_run(snapshot) == EPOCHS
        status = await handle.query(RunWorkflow.status_query)
        assert status.detection_counts.get("lingered", 0) == 0, f"run {i}: ranks lingered at exit"


async def test_a_rank_lingering_after_its_work_is_stopped_and_the_run_completes(client: Client, tmp_path: Path) -> None:
    spec = plain_spec(["python", "tests/e2e/linger.py"], tmp_path, exit_grace="3s")
    handle = await client.start_workflow(RunWorkflow.run, spec, id=workflow_id("linger"), task_queue="stayalive")
    running = await wait_until(handle, lambda s: s.state == RunState.RUNNING, timeout=60)
    assert running.first_step_at is not None, "a plain run is RUNNING once its ranks are up"
    lingering = (await rank_pids(client, handle))["n1"][1]

    result = await handle.result()
    assert result.state == RunState.COMPLETED
    assert result.ledger.goodput > 0, "a plain run's time after its ranks are up is productive"
    status = await handle.query(RunWorkflow.status_query)
    (lingered,) = [d for d in status.detections if d.kind == "lingered"]
    assert (lingered.rank, lingered.node) == (1, "n1")
    assert "3s after the first rank finished" in lingered.evidence
    deadline = time.monotonic() + 30
    while process_alive(lingering):
        assert time.monotonic() < deadline, "the lingering rank was not stopped"
        await asyncio.sleep(0.2)
    attributes = (await handle.describe()).search_attributes
    assert attributes["RunState"] == ["COMPLETED"] and attributes["Goodput"][0] > 0  # type: ignore[operator]
