"""Real ranks on more nodes than ranks per node: seven node agents (one rank each: six in the run, one
spare) on the session's dev stack, in the shape that holds at 2,048 nodes — one launch and one monitor
per generation, node agents reached over their hubs, no activity per node."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from temporalio.client import Client

from harness.records import RecordCollector, samples_once, step_reports
from stayalive.core.run.lifecycle import RunState
from stayalive.core.run.spec import RunSpec
from stayalive.core.run.timeline import Cause
from stayalive.workers.devstack import DevStack
from stayalive.workflows.run import DrainNode, RunWorkflow
from tests.helpers import activity_log, rank_pids, start, wait_for_fleet, wait_for_step, wait_until

NODES = [f"w{i}" for i in range(1, 8)]
GLOBAL_BATCH = 30  # shares evenly among 6 ranks and among 5
TARGET = 160  # long enough for a crash, the crashed node's self-test and a drain
# The drain must come while generation 1 still runs, and only once w5's self-test (the fleet
# workflow's) has passed. At 15 ms a step a loaded CI host once finished the run before that self-test
# did; at 50 ms generation 1 runs some 8 s past step 35.
DRAIN_DEVICE_MS = 50
# What a run's history may schedule, at any width: its monitor, a hang's stack dumps, a webhook page.
# Everything that touches nodes is one local activity for all of them.
SCHEDULED = {"monitor_run", "dump_stacks", "deliver_webhook"}
TRAINER = ["python", "-m", "stayalive.training.train", "--preset", "tiny"]


@pytest.fixture(scope="module")
def wide(stack: DevStack) -> Iterator[list[str]]:
    for node in NODES:
        stack.start_agent(node, spare=node == NODES[-1])
    yield NODES
    for node in NODES:
        stack.kill(f"agent-{node}", signal.SIGTERM)


@pytest.fixture(autouse=True)
async def settled(client: Client, wide: list[str]) -> None:
    await wait_for_fleet(client, lambda nodes: all(n in nodes and nodes[n].state.usable for n in wide), timeout=120)


def wide_spec(root: Path, nodes: list[str], spares: list[str], device_ms: int = 15, **overrides: object) -> RunSpec:
    spec: dict[str, object] = {
        "name": "wide",
        "world_size": len(nodes),
        "ranks_per_node": 1,
        "nodes": nodes,
        "spare_nodes": spares,
        "min_nodes": len(nodes) - 1,
        # By default paced as tiny_spec's runs are (tests/helpers.TINY_ENTRYPOINT), at this test's global batch.
        "entrypoint": [*TRAINER, "--global-batch", str(GLOBAL_BATCH), "--device-ms", str(device_ms)],
        "target_step": 80,
        "checkpoint": {"root": str(root), "interval": "10 steps"},
    }
    return RunSpec.model_validate(spec | overrides)


async def test_six_nodes_survive_a_killed_rank_and_a_drain(
    client: Client, checkpoint_root: Path, wide: list[str]
) -> None:
    handle = await start(
        client, wide_spec(checkpoint_root, wide[:6], wide[6:], DRAIN_DEVICE_MS, target_step=TARGET), "wide"
    )
    collector = RecordCollector(client, handle, wide[:6])
    await wait_for_step(client, handle, 23)
    await collector.caught_up("w5", 20)  # w5's agent forgets the run's records once w5 is quarantined
    os.kill((await rank_pids(client, handle))["w5"][4], signal.SIGKILL)
    await wait_until(handle, lambda s: s.generation == 1 and s.state == RunState.RUNNING and s.progress.step >= 35)
    # w5 lost a process, not its hardware: its self-test passes and it is back in the pool, the
    # first candidate for the next node the run loses (RunBook.spare_candidates).
    await wait_for_fleet(client, lambda nodes: nodes["w5"].state.usable, timeout=60)
    await collector.caught_up("w2", 35)  # w2 leaves the run, and its agent forgets the run's records
    outcome = await handle.execute_update(RunWorkflow.drain_node, DrainNode(node="w2", reason="fan failing"))
    assert "replaced w2 with spare w5" in outcome

    result = await handle.result()
    assert result.state == RunState.COMPLETED
    crash, drain = result.interruptions
    assert (crash.cause, crash.node, crash.rank) == (Cause.CRASH, "w5", 4)
    assert any("replaced w5 with spare w7" in action for action in crash.actions)
    assert (drain.cause, drain.node, drain.restored_from) == (Cause.DRAIN, "w2", "live")
    status = await handle.query(RunWorkflow.status_query)
    assert status.nodes == ["w1", "w5", "w3", "w4", "w7", "w6"] and status.world_size == 6
    reports = step_reports(await collector.stop())
    resumed = [crash.resumed_from or 0, drain.step or 0]
    assert samples_once(reports, resumed, TARGET, GLOBAL_BATCH), "a sample was lost or repeated"

    log = await activity_log(client, handle)
    assert {name for kind, name, _ in log if kind == "scheduled"} <= SCHEDULED
    assert [name for kind, name, _ in log if kind == "local"].count("launch") == 3  # one per generation


async def test_a_node_whose_agent_never_answers_is_replaced_not_fatal(
    client: Client, stack: DevStack, checkpoint_root: Path, wide: list[str]
) -> None:
    frozen = stack.processes[f"agent-{wide[1]}"]
    frozen.send_signal(signal.SIGSTOP)  # registered and reachable, but it answers nothing
    try:
        spec = wide_spec(
            checkpoint_root, wide[:3], [wide[3]], min_nodes=3, target_step=30, health={"node_heartbeat_timeout": "3s"}
        )
        result = await asyncio.wait_for((await start(client, spec, "frozen-node")).result(), timeout=180)
    finally:
        frozen.send_signal(signal.SIGCONT)
    assert result.state == RunState.COMPLETED, result.failure
    (lost,) = result.interruptions
    assert (lost.cause, lost.node) == (Cause.NODE_LOST, wide[1])
    assert lost.detected_by == "launch: the node agent did not answer"
    assert f"replaced {wide[1]} with spare {wide[3]}" in lost.actions
