"""A node partitioned for real: its agent in a network namespace of its own, joined to the host by a
veth pair (workers/netns.py); the server, the supervisor and the other agents on the host. The link
is cut from the namespace side mid-run, and restored once the run has moved on. Root only.

This module runs its own stack (the host's side of the veth is where everything listens), not the
session's: the session fixtures that settle the shared fleet are replaced here by ones that do nothing.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from temporalio.client import Client

from harness.records import RecordCollector, samples_once, step_reports
from harness.tiny import TINY_ENTRYPOINT
from stayalive.core.decisions.fencing import FENCE_FILE
from stayalive.core.run.lifecycle import RunState
from stayalive.core.run.spec import RunSpec
from stayalive.core.run.timeline import Cause
from stayalive.workers.devstack import DevStack, free_port
from stayalive.workers.netns import Partitionable, usable
from stayalive.workers.secret import create_secret
from stayalive.workers.temporal import connect, plain
from stayalive.workflows.run import RunWorkflow
from tests.helpers import ROOT, rank_pids, secret_named, start, tiny_spec, wait_for_step, wait_until

pytestmark = pytest.mark.skipif(usable() is not None, reason=f"a real partition: {usable()}")


@pytest.fixture(autouse=True)
def settled_fleet() -> None:
    """This module's own stack starts settled (replaces the shared fleet's fixture)."""


@pytest.fixture(autouse=True)
def no_run_outlives_its_test() -> None:
    """Its stack goes with the test (replaces the shared fleet's fixture)."""


@pytest.fixture
def net() -> Iterator[Partitionable]:
    with Partitionable.create(f"sap{os.getpid() % 10000}", index=100 + os.getpid() % 150) as made:
        yield made


@pytest.fixture
async def partitionable_stack(tmp_path: Path, net: Partitionable) -> AsyncIterator[tuple[DevStack, Client]]:
    """n1 and the spare n3 on the host, n2 in the namespace; everything listens on the host's veth."""
    dev = DevStack(
        state_dir=tmp_path / "stack",
        nodes=["n1", "n2", "n3"],
        spares=["n3"],
        port=free_port(),
        ui_port=None,
        metrics_port=free_port(),
        workdir=ROOT,
        ip=net.host_ip,
        interface=net.host_if,
    )
    try:
        create_secret(dev.secret_file)
        dev.start_temporal()
        dev.start_supervisor()
        dev.start_agent("n1")
        dev.start_agent("n2", netns=net)
        dev.start_agent("n3")
        with secret_named(dev.secret_file):
            await dev.ready()
            yield dev, await connect(plain(dev.address))
    finally:
        dev.stop()


def partition_spec(checkpoint_root: Path) -> RunSpec:
    return tiny_spec(
        checkpoint_root,
        target_step=TARGET,
        entrypoint=[*TINY_ENTRYPOINT[:-1], "40"],  # slower steps: the run outlasts the cut and the report
        # 8 s of silence before a node counts as lost: a loaded two-core host can starve an agent for
        # 5 s while its ranks start (the fence must outlast it by the monitor's 15 s handover).
        health={"node_heartbeat_timeout": "8s", "partition_fence": "25s"},
    )


TARGET = 700  # the partition is reported 25-30 s after the cut, near step 350: hundreds of steps to spare


def running(pid: int) -> bool:
    """Alive, and not a zombie its parent has yet to reap."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


async def test_a_partitioned_node_is_fenced_out_and_the_run_completes_without_it(
    partitionable_stack: tuple[DevStack, Client], net: Partitionable, checkpoint_root: Path
) -> None:
    stack, client = partitionable_stack
    spec = partition_spec(checkpoint_root)
    handle = await start(client, spec, "partition")
    collector = RecordCollector(client, handle, spec.nodes)
    await wait_for_step(client, handle, 25)
    cut_off = (await rank_pids(client, handle))["n2"]
    await collector.caught_up("n2", 25)

    net.cut()
    try:
        # The run takes n2 for lost, goes on on the spare, and n2's agent, unread, fences itself out
        # (its ranks stopped by the time it logs so).
        moved_on = await wait_until(handle, lambda s: s.generation >= 1 and s.state == RunState.RUNNING, timeout=120)
        assert moved_on.nodes == ["n1", "n3"]
        agent_log = stack.state_dir / "logs" / "agent-n2.log"
        for _ in range(300):
            if "fenced out of the run" in agent_log.read_text():
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("n2's agent did not fence itself out while cut off")
        assert not any(running(pid) for pid in cut_off.values()), "its ranks of generation 0 are stopped"
    finally:
        net.restore()

    # Back on the network: it reports the partition, and the run's entry for it says so.
    status = await wait_until(handle, lambda s: any(i.cause == Cause.PARTITION for i in s.interruptions), timeout=120)
    assert status.state == RunState.RUNNING, "the report came while the run still ran"
    result = await handle.result()
    assert result.state == RunState.COMPLETED and result.final_step == TARGET
    assert [(i.cause, i.node, i.generation) for i in result.interruptions] == [(Cause.PARTITION, "n2", 0)]
    partition = result.interruptions[0]
    assert "fenced itself out of generation 0" in partition.actions[-1]
    assert partition.resumed_from is not None

    # Fenced: it did not rejoin (no generation after 0 ran there), and nothing of generation 0 landed
    # as a checkpoint after the run moved on; the fence stands at the last generation launched.
    final = await handle.query(RunWorkflow.status_query)
    assert final.nodes == ["n1", "n3"]
    ran_on_n2 = sorted(p.name for p in (stack.state_dir / "nodes" / "n2" / "runs" / final.run_id).iterdir())
    assert ran_on_n2 == ["g0"]
    assert all(c.step <= partition.resumed_from for c in final.checkpoints if c.generation == 0 and c.validated)
    directory = Path(final.checkpoint_dir)
    assert int((directory / FENCE_FILE).read_text()) == final.generation
    assert not [p for p in directory.glob("step-*-g0") if int(p.name[5:13]) > partition.resumed_from]

    # Every sample of the final lineage read exactly once.
    reports = step_reports(await collector.stop())
    resumed = [i.resumed_from or 0 for i in result.interruptions]
    assert samples_once(reports, resumed, TARGET, global_batch=8), "a sample was lost or repeated"
