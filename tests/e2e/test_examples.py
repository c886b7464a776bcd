"""Two published training scripts under the real workflow, 4 ranks over 2 nodes: nanoGPT's train.py
(DDP; karpathy/nanoGPT) and PyTorch's FSDP2 example (pytorch/examples), each with its CPU patch and
stayalive's lines (examples/*/stayalive.patch). Each survives what a run at scale meets."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest
from temporalio.client import Client

from harness.records import RecordCollector, step_reports
from harness.tiny import final_state
from stayalive.core.run.lifecycle import RunState
from stayalive.core.run.timeline import Cause
from stayalive.training.checkpoint import read_dcp_manifest
from stayalive.workflows.run import DrainNode, ResumeFrom, RunWorkflow
from tests.e2e.examples import FSDP2, NANOGPT, Example, losses_as_they_stand
from tests.helpers import assert_bitwise_equal, rank_pids, start, wait_until

pytestmark = pytest.mark.parametrize("example", [NANOGPT, FSDP2], ids=lambda e: e.name)


async def test_a_killed_rank_a_forced_checkpoint_and_a_rollback_to_it_end_bitwise_equal_to_an_uninterrupted_run(
    client: Client, tmp_path: Path, example: Example
) -> None:
    """Checkpoints only when asked (interval 1000): a rank dies once the forced one is validated, the
    run resumes from it in host memory, then rolls back to it when told. Every rank's loss at
    every step, as the final lineage trained it, equals the uninterrupted run's: the same batches
    (both draw them from the RNG; nanoGPT's batch drawn ahead is saved with it)."""
    target = example.steps
    checkpoint = {"root": str(tmp_path / "checkpoints"), "interval": "1000 steps"}
    spec = example.spec(example.workdir(tmp_path / "run"), tmp_path, target, checkpoint=checkpoint)
    handle = await start(client, spec, example.name)
    collector = RecordCollector(client, handle, ["n1", "n2", "n3"])
    await collector.caught_up("n1", 5)
    await handle.signal(RunWorkflow.force_checkpoint)
    status = await wait_until(handle, lambda s: any(c.validated for c in s.checkpoints), timeout=60)
    (forced,) = status.checkpoints
    for node in ("n1", "n2"):  # the killed rank's reports up to the checkpoint are in before it dies
        await collector.caught_up(node, forced.step)
    os.kill((await rank_pids(client, handle))["n2"][3], signal.SIGKILL)

    await wait_until(handle, lambda s: s.generation == 1 and s.state == RunState.RUNNING, timeout=60)
    outcome = await handle.execute_update(RunWorkflow.resume_from, ResumeFrom(step=forced.step))
    assert outcome.startswith(f"rolling back to step {forced.step}")

    result = await handle.result()
    assert result.state == RunState.COMPLETED, result.failure
    crash, rollback = result.interruptions
    assert (crash.cause, crash.rank, crash.restored_from) == (Cause.CRASH, 3, "memory")
    assert (crash.resumed_from, rollback.cause, rollback.resumed_from) == (forced.step, Cause.ROLLBACK, forced.step)
    losses = losses_as_they_stand(step_reports(await collector.stop()))
    weights = final_state(await handle.query(RunWorkflow.checkpoints), target)

    spec = example.spec(example.workdir(tmp_path / "reference-run"), tmp_path / "reference", target)
    reference = await start(client, spec, f"{example.name}-ref")
    reference_collector = RecordCollector(client, reference, ["n1", "n2"])
    assert (await reference.result()).state == RunState.COMPLETED
    reference_losses = losses_as_they_stand(step_reports(await reference_collector.stop()))
    assert len(reference_losses) == 4 * target
    assert losses == reference_losses, "a step trained on other batches than the uninterrupted run's"
    assert_bitwise_equal(weights, final_state(await reference.query(RunWorkflow.checkpoints), target))


async def test_a_hang_in_one_ranks_collective_is_blamed_on_that_rank(
    client: Client, tmp_path: Path, example: Example
) -> None:
    # A step timeout of the run's own (10 s, as a user who knows the step time would set it): the
    # watchdog does not need to learn the step time first.
    faults = [{"kind": "collective_hang", "rank": 3, "at_step": 8}]
    health = {"step_timeout": 10}
    spec = example.spec(example.workdir(tmp_path / "run"), tmp_path, 15, faults=faults, health=health)
    result = await (await start(client, spec, f"{example.name}-hang")).result()
    assert result.state == RunState.COMPLETED, result.failure
    (hang,) = result.interruptions
    assert (hang.cause, hang.node, hang.rank) == (Cause.HANG, "n2", 3)
    assert re.search(rf"rank 3 never entered collective #\d+ \({example.hang_in} of step 8\)", hang.detail)


async def test_a_drain_goes_on_at_two_ranks_resharded_from_the_agreed_step(
    client: Client, tmp_path: Path, example: Example
) -> None:
    """The survivors re-execute in place and resume from the checkpoint of the agreed step at world
    size 2: FSDP2's shards of 4 resharded to 2; nanoGPT accumulating 2 micro-batches per rank where
    it took 1 (the same global batch, as its own code works it out from the world size)."""
    target = example.steps
    spec = example.spec(example.workdir(tmp_path / "run"), tmp_path, target, spare_nodes=[], min_nodes=1)
    handle = await start(client, spec, f"{example.name}-drain")
    collector = RecordCollector(client, handle, ["n1", "n2"])
    await collector.caught_up("n1", 10)
    survivors = (await rank_pids(client, handle))["n1"]
    outcome = await handle.execute_update(RunWorkflow.drain_node, DrainNode(node="n2", reason="fan failing"))
    assert "continuing on 1 nodes" in outcome
    assert (await rank_pids(client, handle))["n1"] == survivors, "the survivors re-executed in place"

    result = await handle.result()
    assert result.state == RunState.COMPLETED, result.failure
    (drain,) = result.interruptions
    assert drain.cause == Cause.DRAIN and drain.step is not None and drain.resumed_from == drain.step
    status = await handle.query(RunWorkflow.status_query)
    assert status.nodes == ["n1"] and status.world_size == 2
    reports = step_reports(await collector.stop())
    assert {r.rank for r in reports if r.step > drain.step} == {0, 1}
    assert max(r.step for r in reports) == target
    final = next(c for c in await handle.query(RunWorkflow.checkpoints) if c.step == target and c.validated)
    assert read_dcp_manifest(Path(final.path)).world_size == 2
