"""GPUs that fail without getting slow, seen by NVML (here its simulated source), cordon their node in a
real run: each kind once, on a chain of spares. A GPU that can no longer compute (lost, an uncorrectable
ECC error, a critical Xid) restarts the run without its node; one that still computes (a row that could
not be remapped, an NVLink down) is drained at a step every rank agrees on, the survivors keeping their
processes. Each is a failure on the timeline with its page class, and the fleet keeps the node
quarantined: its self-test reads NVML too, and the GPU still shows the failure. A GPU whose memory
only corrects errors interrupts nothing; the fleet records the node's count."""

from __future__ import annotations

import asyncio
import itertools
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from temporalio.client import Client

from stayalive.core.fleet.model import EccTrend, NodeState, Quarantine
from stayalive.core.run.lifecycle import RunState
from stayalive.core.run.spec import RunSpec
from stayalive.core.run.timeline import Cause, PagingClass
from stayalive.workers.devstack import DevStack
from stayalive.workflows.fleet import FleetWorkflow, fleet_handle
from stayalive.workflows.run import RunWorkflow
from tests.helpers import start, wait_for_fleet

NODES = [f"g{i}" for i in range(1, 8)]
TRAINER = ["python", "-m", "stayalive.training.train", "--preset", "tiny", "--global-batch", "8"]
# The run's second node, then each spare that takes its place, has one GPU failure; g7 is healthy.
FAULTS = {
    "g2": {"kind": "gpu_lost", "gpu": 3},
    "g3": {"kind": "ecc", "gpu": 3, "uncorrected": 2},
    "g4": {"kind": "xid", "gpu": 3, "xid": 79},
    "g5": {"kind": "row_remap", "gpu": 3},
    "g6": {"kind": "nvlink", "gpu": 3, "links_down": 2},
}
RESTARTS, DRAINS = ["g2", "g3", "g4"], ["g5", "g6"]
# g7's memory corrects errors: no failure, but the fleet records the node's count for its history.
WEARING = {"node": "g7", "kind": "ecc", "gpu": 0, "corrected": 40, "uncorrected": 0}


@pytest.fixture(scope="module")
async def gpu_nodes(stack: DevStack, client: Client) -> AsyncIterator[list[str]]:
    for node in NODES:
        stack.start_agent(node, spare=node != "g1")
    yield NODES
    # The faulty nodes stay quarantined in the fleet, as their GPUs left them: later tests wait only
    # for the nodes they run on.
    await asyncio.gather(*(asyncio.to_thread(stack.kill, f"agent-{node}", signal.SIGTERM) for node in NODES))


def chain_spec(root: Path) -> RunSpec:
    return RunSpec.model_validate(
        {
            "name": "gpu-faults",
            "world_size": 2,
            "ranks_per_node": 1,
            "nodes": ["g1", "g2"],
            "spare_nodes": NODES[2:],
            "min_nodes": 2,
            "entrypoint": [*TRAINER, "--device-ms", "20"],
            "target_step": 300,  # long enough for five interruptions, each seen within half a second
            "checkpoint": {"root": str(root), "interval": "10 steps"},
            "faults": [*({"node": node, **fault} for node, fault in FAULTS.items()), WEARING],
        }
    )


async def test_each_nvml_failure_cordons_its_node_with_its_cause_page_and_fleet_record(
    client: Client, checkpoint_root: Path, gpu_nodes: list[str]
) -> None:
    await wait_for_fleet(
        client, lambda nodes: all(n in nodes and nodes[n].state.usable for n in gpu_nodes), timeout=120
    )
    handle = await start(client, chain_spec(checkpoint_root), "gpu-faults")
    result = await handle.result()
    assert result.state == RunState.COMPLETED and result.final_step == 300
    assert (await handle.query(RunWorkflow.status_query)).nodes == ["g1", "g7"]

    timeline = result.interruptions
    assert [(i.cause, i.node) for i in timeline] == [(Cause.GPU_FAULT, n) for n in [*RESTARTS, *DRAINS]]
    kinds = ["fell off the bus", "uncorrectable ECC", "Xid 79", "could not be remapped", "NVLink 16/18"]
    for interruption, said in zip(timeline, kinds, strict=True):
        assert interruption.detected_by.startswith("NVML") and said in interruption.detail
        assert interruption.paging is not None and interruption.paging.rule != "planned", "a failure, paged"
    assert timeline[0].paging is not None and timeline[0].paging.paging == PagingClass.INDEPENDENT
    for before, after in itertools.pairwise(timeline):  # each at or after where the generation resumed
        assert before.resumed_from is not None and after.step is not None and after.step >= before.resumed_from
    assert all(i.restored_from != "live" for i in timeline[:3]), "restarted: the GPU could not compute"
    assert all(i.restored_from == "live" for i in timeline[3:]), "drained: the survivors kept their processes"

    trends = await ecc_trends(client, "g7")
    assert list(trends) == ["g7"] and trends["g7"].corrected == 40, "only g7's GPUs corrected errors"

    faulty = list(FAULTS)
    await wait_for_fleet(client, lambda nodes: all(nodes[n].state == NodeState.QUARANTINED for n in faulty))
    records = await self_tested(client, faulty)
    for node in faulty:
        record = records[node]
        assert "GPU failure" in record.reason and result.run_id in record.run_ids_affected
        test = record.self_tests[-1]
        assert not test.passed and test.checks["nvml"] is False and test.checks["gemm"] is True, test.detail


async def ecc_trends(client: Client, node: str, timeout: float = 30) -> dict[str, EccTrend]:
    """The fleet's corrected-ECC trends of this test's nodes, once `node` has one."""
    deadline = time.monotonic() + timeout
    while True:
        trends = {t.node: t for t in await fleet_handle(client).query(FleetWorkflow.ecc_trends) if t.node in NODES}
        if node in trends or time.monotonic() > deadline:
            return trends
        await asyncio.sleep(0.5)


async def self_tested(client: Client, nodes: list[str], timeout: float = 60) -> dict[str, Quarantine]:
    """Each node's open quarantine, once its self-test has answered."""
    deadline = time.monotonic() + timeout
    while True:
        open_ = {q.node: q for q in await fleet_handle(client).query(FleetWorkflow.quarantines) if q.open}
        if all(n in open_ and open_[n].self_tests for n in nodes) or time.monotonic() > deadline:
            return open_
        await asyncio.sleep(0.5)
