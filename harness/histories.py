"""Record the workflow histories that the replay test (tests/workers/test_replay.py) holds the workflow
code to: real runs of the tiny GPT on a dev stack of this script's own, one for each kind of thing a
long run's history holds, and the fleet's history around them.

    crash      a rank crashes; the run restarts on the spare and completes
    drain      a node is drained mid-run; the run goes on at half the width
    operator   a pause and a resume, a forced checkpoint, a rollback to it (resume_from)
    chain      pauses until the run continues as new, twice (the server suggests it at 120 events)
    node-lost  a node agent killed mid-run: replaced by the spare, back, self-tested, returned
    gpu-fault  an Xid 79 on a GPU: the run restarts without its node, which the fleet quarantines
               (its self-test still sees the fault)
    fleet      the fleet's executions over all of the above

Every execution of a chain is a file of its own, gzipped JSON as the Temporal CLI exports it
(`temporal workflow show -o json`). A change to RunWorkflow or FleetWorkflow that would make a live
run's history fail to replay fails the test, naming the file: guard it with `workflow.patched`, or,
where every run on the old code has ended, record the corpus again:

    python -m harness.histories --out tests/histories
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from temporalio.client import Client, WorkflowHandle

from harness.tiny import tiny_spec
from stayalive.core.fleet.model import FleetNode, Quarantine
from stayalive.core.run.lifecycle import RunState
from stayalive.core.run.spec import RunSpec
from stayalive.core.run.status import RunResult, RunStatus
from stayalive.workers.devstack import DevStack, free_port
from stayalive.workers.temporal import connect, plain
from stayalive.workflows.fleet import FleetWorkflow, fleet_handle, fleet_id
from stayalive.workflows.run import TASK_QUEUE, DrainNode, ResumeFrom, RunWorkflow

SUGGEST_CONTINUE_AS_NEW_AT = 120  # events: the chain's pauses cross it twice


def spec(root: Path, **overrides: object) -> RunSpec:
    """The tests' tiny run (harness/tiny.py), 60 steps."""
    return tiny_spec(root, **({"name": "history", "target_step": 60} | overrides))


async def until(handle: WorkflowHandle, ready: Callable[[RunStatus], bool], timeout: float = 120.0) -> RunStatus:
    """Poll the run's status until `ready(status)` holds."""
    deadline = time.monotonic() + timeout
    while not ready(status := await handle.query(RunWorkflow.status_query)):
        if time.monotonic() > deadline:
            said = f"{status.state.value}, generation {status.generation}, step {status.progress.step}"
            raise TimeoutError(f"{handle.id}: not there within {timeout:g}s ({said}; {status.failure})")
        await asyncio.sleep(0.2)
    return status


def running(generation: int) -> Callable[[RunStatus], bool]:
    return lambda s: s.state == RunState.RUNNING and s.generation == generation


async def crash(client: Client, stack: DevStack, root: Path) -> WorkflowHandle:
    faults = [{"kind": "crash", "rank": 1, "at_step": 15}]
    return await client.start_workflow(RunWorkflow.run, spec(root, faults=faults), id="crash", task_queue=TASK_QUEUE)


async def drain(client: Client, stack: DevStack, root: Path) -> WorkflowHandle:
    run = spec(root, spare_nodes=[], min_nodes=1, target_step=200)
    handle = await client.start_workflow(RunWorkflow.run, run, id="drain", task_queue=TASK_QUEUE)
    await until(handle, lambda s: s.progress.step >= 20)
    await handle.execute_update(RunWorkflow.drain_node, DrainNode(node="n2", reason="fan failing"))
    return handle


async def operator(client: Client, stack: DevStack, root: Path) -> WorkflowHandle:
    run = spec(root, target_step=400, checkpoint={"root": str(root), "interval": "1000 steps"})
    handle = await client.start_workflow(RunWorkflow.run, run, id="operator", task_queue=TASK_QUEUE)
    await until(handle, running(0))
    await handle.signal(RunWorkflow.pause, "maintenance window")
    await until(handle, lambda s: s.state == RunState.STOPPED)
    await handle.signal(RunWorkflow.resume)
    await until(handle, running(1))
    await handle.signal(RunWorkflow.force_checkpoint)
    status = await until(handle, lambda s: any(c.validated and c.generation == 1 for c in s.checkpoints))
    forced = max(c.step for c in status.checkpoints if c.validated)
    await handle.execute_update(RunWorkflow.resume_from, ResumeFrom(step=forced))
    return handle


async def chain(client: Client, stack: DevStack, root: Path) -> WorkflowHandle:
    run = spec(root, target_step=1_000_000, world_size=2, ranks_per_node=1)
    await client.start_workflow(RunWorkflow.run, run, id="chain", task_queue=TASK_QUEUE)
    handle: WorkflowHandle[RunWorkflow, RunResult] = client.get_workflow_handle("chain")  # its newest execution
    for generation in range(1, 100):
        await until(handle, running(generation - 1))
        if len(await executions(client, "chain")) > 2:
            break
        await handle.signal(RunWorkflow.pause, f"pause {generation}")
        await until(handle, lambda s: s.state == RunState.STOPPED)
        await handle.signal(RunWorkflow.resume)
    await handle.cancel()
    return handle


async def node_lost(client: Client, stack: DevStack, root: Path) -> WorkflowHandle:
    run = spec(root, target_step=150, health={"node_heartbeat_timeout": "5s"})
    handle = await client.start_workflow(RunWorkflow.run, run, id="node-lost", task_queue=TASK_QUEUE)
    await until(handle, lambda s: s.progress.step >= 30)
    stack.kill("agent-n2")
    await until(handle, running(1))
    stack.start_agent("n2")
    return handle


async def gpu_fault(client: Client, stack: DevStack, root: Path) -> WorkflowHandle:
    faults = [{"node": "n2", "kind": "xid", "gpu": 3, "xid": 79}]
    run = spec(root, faults=faults, target_step=100)
    return await client.start_workflow(RunWorkflow.run, run, id="gpu-fault", task_queue=TASK_QUEUE)


def every_node_free(nodes: list[FleetNode], quarantines: list[Quarantine]) -> bool:
    """Self-tests and releases done: the next scenario has every node."""
    return all(n.state.usable and n.run_id is None for n in nodes)


def quarantined_and_tested(nodes: list[FleetNode], quarantines: list[Quarantine]) -> bool:
    """The faulty node is in quarantine, its self-test answered."""
    return any(q.open and q.node == "n2" and q.self_tests for q in quarantines)


SCENARIOS = [
    (crash, every_node_free),
    (drain, every_node_free),
    (operator, every_node_free),
    (chain, every_node_free),
    (node_lost, every_node_free),
    (gpu_fault, quarantined_and_tested),
]


async def settled(client: Client, ready: Callable[[list[FleetNode], list[Quarantine]], bool]) -> None:
    fleet = fleet_handle(client)
    async with asyncio.timeout(120):
        while not ready(await fleet.query(FleetWorkflow.nodes), await fleet.query(FleetWorkflow.quarantines)):
            await asyncio.sleep(0.5)


async def executions(client: Client, workflow_id: str) -> list[str]:
    """The run ids of a workflow id's executions, oldest first."""
    found = [e async for e in client.list_workflows(f"WorkflowId = '{workflow_id}'")]
    return [e.run_id for e in sorted(found, key=lambda e: e.start_time)]


async def save(client: Client, workflow_id: str, out: Path) -> int:
    """Every execution of `workflow_id` to `out/<id>-<n>.json.gz`; how many."""
    run_ids = await executions(client, workflow_id)
    for n, run_id in enumerate(run_ids):
        history = await client.get_workflow_handle(workflow_id, run_id=run_id).fetch_history()
        with gzip.open(out / f"{workflow_id}-{n}.json.gz", "wt") as f:
            f.write(history.to_json())
    return len(run_ids)


async def record(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.json.gz"):
        old.unlink()
    with tempfile.TemporaryDirectory(prefix="histories-") as state:
        stack = DevStack(
            state_dir=Path(state),
            nodes=["n1", "n2", "n3"],
            spares=["n3"],
            racks={"n1": "rack-a", "n2": "rack-a", "n3": "rack-b"},
            port=free_port(),
            ui_port=None,
            metrics_port=free_port(),
            temporal_flags=[
                "--dynamic-config-value",
                f"limit.historyCount.suggestContinueAsNew={SUGGEST_CONTINUE_AS_NEW_AT}",
            ],
        )
        stack.start()
        try:
            await stack.ready()
            client = await connect(plain(stack.address))
            for scenario, ready in SCENARIOS:
                handle = await scenario(client, stack, Path(state) / "checkpoints" / scenario.__name__)
                try:
                    await asyncio.wait_for(handle.result(), timeout=180)
                except Exception as exc:  # a cancelled chain ends so; anything else is in the history
                    print(f"{handle.id}: {type(exc).__name__}")
                await settled(client, ready)
                print(f"{handle.id}: {await save(client, handle.id, out)} executions")
            fleet = fleet_id("default")
            print(f"{fleet}: {await save(client, fleet, out)} executions")
        finally:
            stack.stop()


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m harness.histories", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("tests/histories"))
    asyncio.run(record(parser.parse_args().out))


if __name__ == "__main__":
    main()
