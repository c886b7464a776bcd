"""The run lifecycle: auto-cordon with and without a spare, waiting below the minimum, quarantine and
self-test across runs, and what a person can do to a run (resume_from, force_checkpoint, pause)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from temporalio.client import Client, WorkflowHandle, WorkflowUpdateFailedError

from harness.records import RecordCollector, samples_once, step_reports
from stayalive.activities.fleet import FleetClient
from stayalive.core.fleet.model import NodeState
from stayalive.core.fleet.requests import Acquire, Release
from stayalive.core.run.lifecycle import RunState
from stayalive.core.run.timeline import Cause
from stayalive.workers.devstack import DevStack
from stayalive.workflows.fleet import FleetWorkflow, fleet_handle
from stayalive.workflows.run import DrainNode, ResumeFrom, RunWorkflow
from tests.helpers import (
    activity_log,
    fleet_nodes,
    rank_pids,
    start,
    tiny_spec,
    wait_for_fleet,
    wait_for_step,
    wait_until,
)

GLOBAL_BATCH = 8


async def running_past(client: Client, handle: WorkflowHandle, step: int) -> None:
    """A rank has reported `step` and the workflow is RUNNING, the state a drain is accepted in. On a
    loaded host a rank's step can show before the workflow has heard of the generation's first one."""
    await wait_for_step(client, handle, step)
    await wait_until(handle, lambda s: s.state == RunState.RUNNING)


async def test_drain_with_a_spare_runs_the_auto_cordon_sequence(client: Client, checkpoint_root: Path) -> None:
    handle = await start(client, tiny_spec(checkpoint_root, target_step=150), "drain-spare")
    collector = RecordCollector(client, handle)
    await running_past(client, handle, 30)
    await collector.caught_up("n2", 30)  # n2 leaves the run, and its agent forgets the run's records
    survivors = (await rank_pids(client, handle))["n1"]
    outcome = await handle.execute_update(RunWorkflow.drain_node, DrainNode(node="n2", reason="fan failing"))
    assert "replaced n2 with spare n3" in outcome
    assert (await rank_pids(client, handle))["n1"] == survivors, "the survivors kept their processes"

    result = await handle.result()
    assert result.state == RunState.COMPLETED
    (drain,) = result.interruptions
    assert (drain.cause, drain.node, drain.lost_steps, drain.restored_from) == (Cause.DRAIN, "n2", 0, "live")
    status = await handle.query(RunWorkflow.status_query)
    assert status.nodes == ["n1", "n3"] and status.world_size == 4
    assert any(c.step == drain.step and c.validated for c in status.checkpoints), "a checkpoint at the drained step"

    # The history reads as the auto-cordon sequence: drain → wait → checkpoint → resize → resume.
    log = await activity_log(client, handle)
    hold = log.index(("local", "command", "drain n2: finish the in-flight step, checkpoint it, hold"))
    after = log[hold:]
    wait = next(
        i
        for i, (kind, name, ended) in enumerate(after)
        if (kind, name) == ("completed", "monitor_run") and ended["event"]["kind"] == "held"  # type: ignore[index]
    )
    # The held step's verdict travels with the monitor's end; a keeper that judged it before every
    # rank held signals it on its own.
    held_verdict = (after[wait][2]["event"]["judged"] or {}).get("checkpoint", {})  # type: ignore[index]
    checkpoint = (
        wait
        if held_verdict.get("step") == drain.step
        else next(
            i
            for i, (kind, name, judged) in enumerate(after)
            if (kind, name) == ("signaled", "checkpoint_judged") and judged["checkpoint"]["step"] == drain.step  # type: ignore[index]
        )
    )
    resize = next(i for i, e in enumerate(after) if e[:2] == ("local", "replace_node"))
    relaunch = next(i for i, e in enumerate(after) if e[:2] == ("local", "launch"))
    resume = next(
        i
        for i, (kind, name, report) in enumerate(after)
        if (kind, name) == ("signaled", "monitor_report") and report["event"]["kind"] == "first_step"  # type: ignore[index]
    )
    # The group changes only once every rank holds and the held step's checkpoint is judged.
    assert min(wait, checkpoint) > 0 and max(wait, checkpoint) < resize < relaunch < resume
    reports = step_reports(await collector.stop())
    assert samples_once(reports, [drain.step or 0], 150, GLOBAL_BATCH), "no sample lost or repeated across the resize"


async def test_drain_without_a_spare_shrinks_and_keeps_the_global_batch(client: Client, checkpoint_root: Path) -> None:
    spec = tiny_spec(checkpoint_root, target_step=120, spare_nodes=[], min_nodes=1)
    handle = await start(client, spec, "drain-shrink")
    collector = RecordCollector(client, handle)
    await running_past(client, handle, 30)
    await collector.caught_up("n2", 30)  # n2 leaves the run, and its agent forgets the run's records
    survivors = (await rank_pids(client, handle))["n1"]
    outcome = await handle.execute_update(RunWorkflow.drain_node, DrainNode(node="n2", reason="shrink"))
    assert "continuing on 1 nodes" in outcome
    assert (await rank_pids(client, handle))["n1"] == survivors
    result = await handle.result()
    assert result.state == RunState.COMPLETED
    status = await handle.query(RunWorkflow.status_query)
    assert status.nodes == ["n1"] and status.world_size == 2
    reports = step_reports(await collector.stop())
    assert {len(r.samples) for r in reports if r.generation == 1} == {GLOBAL_BATCH // 2}
    assert samples_once(reports, [result.interruptions[0].step or 0], 120, GLOBAL_BATCH)


async def test_below_the_minimum_the_run_waits_for_a_node(client: Client, checkpoint_root: Path) -> None:
    fleet = fleet_handle(client)
    await FleetClient(fleet).ask(Acquire(run_id="blocker/00000000", wanted=["n3"]))
    handle = await start(client, tiny_spec(checkpoint_root, target_step=120), "wait-for-node")
    await running_past(client, handle, 30)
    drain = asyncio.ensure_future(handle.execute_update(RunWorkflow.drain_node, DrainNode(node="n2", reason="out")))
    await wait_until(handle, lambda s: s.state == RunState.STOPPED and "waiting for nodes" in s.failure)
    await asyncio.sleep(3)  # nobody trains while the run is below its minimum
    await FleetClient(fleet).ask(Release(run_id="blocker/00000000"))
    assert "held at step" in await drain
    result = await handle.result()
    assert result.state == RunState.COMPLETED
    assert (await handle.query(RunWorkflow.status_query)).nodes == ["n1", "n3"]
    assert result.interruptions[0].idle_seconds >= 3
    assert result.ledger.idle >= 3


async def test_a_failing_node_is_quarantined_across_runs_until_its_self_test_passes(
    client: Client, stack: DevStack, checkpoint_root: Path
) -> None:
    faults = [{"kind": "crash", "rank": 3, "at_step": 25}, {"kind": "broken_node", "node": "n2", "part": "gemm"}]
    first = await start(client, tiny_spec(checkpoint_root, target_step=60, faults=faults), "bad-node")
    assert (await first.result()).state == RunState.COMPLETED
    first_run = (await first.query(RunWorkflow.status_query)).run_id
    await wait_for_fleet(client, lambda nodes: nodes["n2"].state == NodeState.QUARANTINED)
    fleet = fleet_handle(client)
    record = next(q for q in await fleet.query(FleetWorkflow.quarantines) if q.node == "n2" and q.open)
    assert first_run in record.run_ids_affected
    assert record.self_tests and not record.self_tests[-1].passed and not record.self_tests[-1].checks["gemm"]

    # A later run asks for n2 and does not get it: no rank of it lands on n2.
    second = await start(client, tiny_spec(checkpoint_root, target_step=40), "after-bad-node")
    assert (await second.result()).state == RunState.COMPLETED
    assert "n2" not in (await second.query(RunWorkflow.status_query)).nodes

    # Repaired (a fresh agent has healthy hardware): it registers again, passes its self-test, returns.
    stack.kill("agent-n2")
    stack.start_agent("n2")
    await wait_for_fleet(client, lambda nodes: nodes["n2"].state == NodeState.HEALTHY)
    assert (await fleet_nodes(client))["n2"].run_id is None
    closed = next(q for q in await fleet.query(FleetWorkflow.quarantines) if q.node == "n2" and q.since == record.since)
    assert closed.released_at is not None and closed.self_tests[-1].passed


async def test_resume_from_rejects_unknown_steps_and_rolls_back_to_valid_ones(
    client: Client, checkpoint_root: Path
) -> None:
    handle = await start(client, tiny_spec(checkpoint_root, target_step=200), "resume-from")
    await wait_until(handle, lambda s: sum(1 for c in s.checkpoints if c.validated) >= 3)
    with pytest.raises(WorkflowUpdateFailedError) as rejected:
        await handle.execute_update(RunWorkflow.resume_from, ResumeFrom(step=15))
    assert "no resumable checkpoint at step 15" in str(rejected.value.cause)
    assert "resumable steps: 10, 20, 30" in str(rejected.value.cause)
    outcome = await handle.execute_update(RunWorkflow.resume_from, ResumeFrom(step=20))
    assert outcome.startswith("rolling back to step 20")
    result = await handle.result()
    assert result.state == RunState.COMPLETED
    (rollback,) = result.interruptions
    assert (rollback.cause, rollback.resumed_from) == (Cause.ROLLBACK, 20)
    checkpoints = await handle.query(RunWorkflow.checkpoints)
    abandoned = [c for c in checkpoints if c.generation == 0 and c.step > 20]
    assert abandoned and not any(c.resumable for c in abandoned)
    # Each was superseded, or was still being written when the ranks were stopped (torn, never committed).
    assert all(c.reason.startswith(("superseded", "never committed")) for c in abandoned), abandoned


async def test_force_checkpoint_checkpoints_at_the_next_agreed_step(client: Client, checkpoint_root: Path) -> None:
    spec = tiny_spec(
        checkpoint_root, target_step=400, checkpoint={"root": str(checkpoint_root), "interval": "1000 steps"}
    )
    handle = await start(client, spec, "force-checkpoint")
    before = await wait_for_step(client, handle, 20)
    await handle.signal(RunWorkflow.force_checkpoint)
    status = await wait_until(handle, lambda s: bool(s.checkpoints), timeout=30)
    (forced,) = status.checkpoints
    after = await wait_for_step(client, handle, forced.step)
    assert before <= forced.step <= after
    assert forced.validated
    await handle.cancel()


async def test_pause_holds_the_ranks_and_resume_goes_on(client: Client, checkpoint_root: Path) -> None:
    handle = await start(client, tiny_spec(checkpoint_root, target_step=120), "pause")
    await wait_for_step(client, handle, 30)
    pids = await rank_pids(client, handle)
    await handle.signal(RunWorkflow.pause, "maintenance window")
    await wait_until(handle, lambda s: s.state == RunState.STOPPED)
    await asyncio.sleep(2)
    await handle.signal(RunWorkflow.resume)
    await wait_until(handle, lambda s: s.state == RunState.RUNNING and s.generation == 1)
    assert await rank_pids(client, handle) == pids, "the same processes went on after the pause"
    result = await handle.result()
    assert result.state == RunState.COMPLETED
    (pause,) = result.interruptions
    assert (pause.cause, pause.lost_steps, pause.restored_from) == (Cause.PAUSE, 0, "live")
    assert pause.idle_seconds >= 2
