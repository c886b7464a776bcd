"""Failures that do not announce themselves: a hang, a straggler (and every rank slow at once, in
tests/e2e/test_fleet_baseline.py). Each is told apart from the others and from a crash or a lost
node (tests/e2e/test_durability.py)."""

from __future__ import annotations

import re
from pathlib import Path

from temporalio.client import Client, WorkflowHandle

from stayalive.core.judgement.detectors import SMOOTH_STEPS
from stayalive.core.run.lifecycle import RunState
from stayalive.core.run.timeline import Cause
from stayalive.workflows.fleet import FleetWorkflow, fleet_handle
from stayalive.workflows.run import RunWorkflow
from tests.e2e.detection_runs import HEALTH, detection_spec
from tests.helpers import start, wait_for_fleet

# A hang at step 60 resumes from the checkpoint of step 50: 50 steps more make the run complete.
HANG_TARGET = 100
# Where a test asserts how a hang is named, not when: a step timeout of 5 s (a hundred of these ~50 ms
# steps) instead of auto's 10 s floor, which the first hang test holds the run to.
NAMED_HANG_HEALTH = HEALTH | {"step_timeout": "5s"}
SLOW_FROM = 20  # the straggler's first slow step


async def test_a_hang_inside_the_collective_names_the_rank_and_quarantines_its_node(
    client: Client, checkpoint_root: Path
) -> None:
    spec = detection_spec(checkpoint_root, target_step=HANG_TARGET, faults=[{"kind": "hang", "rank": 3, "at_step": 60}])
    handle = await start(client, spec, "hang")
    result = await handle.result()
    assert result.state == RunState.COMPLETED
    (hang,) = result.interruptions
    assert (hang.cause, hang.node, hang.rank) == (Cause.HANG, "n2", 3), "a hang, not a crash, and its culprit"
    assert hang.detected_after_s is not None and hang.detected_after_s <= 10 + 5  # auto timeout: its 10 s floor
    (artifact,) = hang.artifacts  # one file for the hang, however many ranks
    text = Path(artifact).read_text()
    assert "4 ranks dumped their stacks" in text, "every rank's stacks were kept"
    stacks = stack_groups(text)
    assert "barrier" in stacks["3"] and "barrier" not in stacks["0, 1, 2"]
    await assert_quarantined_for_the_hang(client, handle, "n2")
    assert not await handle.query(RunWorkflow.detections)


def stack_groups(artifact: str) -> dict[str, str]:
    """The hang artifact's distinct stacks, by the ranks that share each ("0, 1, 2")."""
    return {header.split("  <-")[0]: body for header, body in re.findall(r"== ranks (.*)\n([^=]*)", artifact)}


async def assert_quarantined_for_the_hang(client: Client, handle: WorkflowHandle, node: str) -> None:
    status = await handle.query(RunWorkflow.status_query)
    assert node not in status.nodes
    records = [q for q in await fleet_handle(client).query(FleetWorkflow.quarantines) if q.node == node]
    assert any(status.run_id in q.run_ids_affected and "hang" in q.reason for q in records)


async def test_a_hang_with_the_same_stack_on_every_rank_is_named_by_collective_counts(
    client: Client, checkpoint_root: Path
) -> None:
    """Rank 3 stalls at the very call site of the gradient all-reduce and never issues it: every
    rank's stack is the same, and only the counts of collectives entered tell it apart."""
    faults = [{"kind": "collective_hang", "rank": 3, "at_step": 60}]
    spec = detection_spec(checkpoint_root, target_step=HANG_TARGET, faults=faults, health=NAMED_HANG_HEALTH)
    handle = await start(client, spec, "same-stack")
    result = await handle.result()
    assert result.state == RunState.COMPLETED
    (hang,) = result.interruptions
    assert (hang.cause, hang.node, hang.rank) == (Cause.HANG, "n2", 3)
    assert re.search(r"rank 3 never entered collective #\d+ \(the gradient all-reduce of step 60\)", hang.detail)
    assert "every rank's main-thread stack is the same" in hang.detail
    (artifact,) = hang.artifacts
    text = Path(artifact).read_text()
    assert "4 ranks dumped their stacks; one main-thread stack, the same on every rank" in text
    assert re.search(r"step 60, newest: the gradient all-reduce: rank 3  <- behind", text)
    (stack,) = stack_groups(text).values()  # one group: 0, 1, 2, 3
    assert "in all_reduce" in stack and "collectives.py" in stack
    await assert_quarantined_for_the_hang(client, handle, "n2")


async def test_a_hang_where_every_rank_is_inside_the_collective_blames_nobody(
    client: Client, checkpoint_root: Path
) -> None:
    """Rank 3 enters the gradient all-reduce and its data is lost on the way: every rank waits in
    the same collective with the same stack. Nothing names a rank, the timeline says so, and the
    run restarts on the same nodes with nobody quarantined."""
    faults = [{"kind": "collective_hang", "rank": 3, "at_step": 60, "where": "inside"}]
    spec = detection_spec(checkpoint_root, target_step=HANG_TARGET, faults=faults, health=NAMED_HANG_HEALTH)
    handle = await start(client, spec, "all-inside")
    result = await handle.result()
    assert result.state == RunState.COMPLETED
    (hang,) = result.interruptions
    assert (hang.cause, hang.node, hang.rank) == (Cause.HANG, None, None)
    assert re.search(
        r"every rank waits in collective #\d+ \(the gradient all-reduce of step 60\); no rank differs", hang.detail
    )
    assert any("no culprit named" in action for action in hang.actions)
    status = await handle.query(RunWorkflow.status_query)
    assert status.nodes == ["n1", "n2"], "nobody was taken out"
    quarantines = await fleet_handle(client).query(FleetWorkflow.quarantines)
    assert not [q for q in quarantines if status.run_id in q.run_ids_affected]


async def test_a_rank_slowed_to_1_2x_is_flagged_within_k_steps_on_its_node(
    client: Client, checkpoint_root: Path
) -> None:
    faults = [{"kind": "straggler", "rank": 1, "factor": 1.2, "from_step": SLOW_FROM}]
    # Eight ranks of 300 ms device steps: a robust median needs peers, and a 20% excess needs a step
    # long enough that scheduling jitter on two cores is a few percent of it. The jitter is absolute:
    # with the other test worker's ranks on the same cores the peers' MAD reached 8.5 ms, which at
    # 150 ms steps pulled the slow rank to z = 3.0 and broke its streak of k steps (flagged at step
    # 72 of one CI run, not by 65). The k steps fall between two checkpoints (every 50 steps).
    spec = detection_spec(checkpoint_root, device_ms=300, target_step=70, world_size=8, ranks_per_node=4, faults=faults)
    handle = await start(client, spec, "straggler")
    result = await handle.result()
    assert result.state == RunState.COMPLETED
    assert result.interruptions == [], "slow is not failed: nothing was interrupted"
    (found,) = await handle.query(RunWorkflow.detections)
    assert (found.kind, found.rank, found.node) == ("straggler", 1, "n1")
    # k = 20 consecutive slow steps, after the rolling median (SMOOTH_STEPS) has caught the change.
    assert SLOW_FROM + 20 - 1 <= found.step <= SLOW_FROM + 20 + SMOOTH_STEPS, "flagged within k steps"
    assert found.ratio is not None and 1.1 < found.ratio < 1.35
    await wait_for_fleet(client, lambda nodes: nodes["n1"].note.startswith("straggler"))
