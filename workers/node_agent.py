"""A node agent: one per host, on task queue `node.<id>`. It launches, watches, commands and stops
the ranks of this host, serves their telemetry to the run monitor, keeps the host-memory checkpoint
tier, and runs the host's self-test when the fleet asks.

    python -m workers.node_agent --node n1 --rack rack-a --address 127.0.0.1:7233

A dead agent is how the workflow learns its host is gone (heartbeat and schedule-to-start
timeouts), so the agent does nothing clever to stay up: its ranks die with it.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import structlog
from temporalio.client import Client, WithStartWorkflowOperation
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.worker import Worker

from agent.gpu import gpu_telemetry
from agent.hub import NodeHub
from agent.node import NodeActivities
from agent.standby import StandbyPool
from core.fleet_requests import RegisterNode, fleet_id
from core.launch import node_queue
from training.logs import configure_logging
from workers.supervisor import connect
from workflows.fleet import FleetInput, FleetWorkflow
from workflows.run import TASK_QUEUE

log = structlog.get_logger()


def default_memory_dir(node: str) -> Path:
    """Host memory: tmpfs where the host has one (every Linux host's /dev/shm)."""
    shm = Path("/dev/shm")
    return (shm if shm.is_dir() else Path("/tmp")) / "stayalive" / node


async def register(client: Client, node: str, rack: str, spare: bool) -> None:
    """Tell the fleet this node is up (starting the fleet's workflow if this is its first node)."""
    start = WithStartWorkflowOperation(
        FleetWorkflow.run,
        FleetInput(),
        id=fleet_id(),
        task_queue=TASK_QUEUE,
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
    )
    while True:
        try:
            entry = await client.execute_update_with_start_workflow(
                FleetWorkflow.register, RegisterNode(node=node, rack=rack, spare=spare), start_workflow_operation=start
            )
            log.info("registered with the fleet", node=node, state=entry.state.value)
            return
        except Exception as exc:  # the supervisor may not be up yet: keep asking
            log.warning("fleet registration failed; retrying", node=node, error=str(exc))
            await asyncio.sleep(2.0)


async def serve(args: argparse.Namespace, memory_dir: Path) -> None:
    hub = NodeHub(args.node, args.host, memory_dir, args.advertise)
    await hub.start()
    node_dir = args.state_dir / "nodes" / args.node
    standby = StandbyPool(args.standby, node_dir) if args.standby > 0 else None
    if standby is not None:
        standby.start()
    node = NodeActivities(args.node, hub, node_dir, standby)
    telemetry = gpu_telemetry(args.node, args.rack, faults=node.telemetry_faults)
    client = await connect(args.address, args.namespace)
    worker = Worker(
        client,
        task_queue=node_queue(args.node),
        activities=[
            node.prepare_node,
            node.run_ranks,
            node.release_run,
            node.send_command,
            node.dump_stacks,
        ],
        max_concurrent_activities=64,
    )
    log.info("node agent started", node=args.node, task_queue=node_queue(args.node), hub=str(hub.endpoint))
    registration = asyncio.create_task(register(client, args.node, args.rack, args.spare))
    sampler = asyncio.create_task(node.sample_gpus(telemetry))
    try:
        await worker.run()
    finally:
        registration.cancel()
        sampler.cancel()
        hub.close()
        if standby is not None:
            await standby.close()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m workers.node_agent", description=__doc__)
    parser.add_argument("--node", required=True, help="this node's id, e.g. n1")
    parser.add_argument("--rack", default="rack-a", help="the failure domain this node shares with its neighbours")
    parser.add_argument("--spare", action="store_true", help="a hot spare: kept idle to replace a failed node")
    parser.add_argument("--address", default="127.0.0.1:7233", help="Temporal frontend host:port")
    parser.add_argument("--namespace", default="default")
    parser.add_argument("--host", default="127.0.0.1", help="address the hub and rendezvous store listen on")
    parser.add_argument("--advertise", default=None, help="address other hosts reach this one at (default --host)")
    parser.add_argument("--state-dir", type=Path, default=Path(".stayalive"), help="where rank logs are kept")
    parser.add_argument("--memory-dir", type=Path, default=None, help="host-memory checkpoint tier (default /dev/shm)")
    parser.add_argument(
        "--standby", type=int, default=2, metavar="N", help="warm processes kept for restarting ranks (0: none)"
    )
    args = parser.parse_args()
    configure_logging(node=args.node)
    asyncio.run(serve(args, args.memory_dir or default_memory_dir(args.node)))


if __name__ == "__main__":
    main()
