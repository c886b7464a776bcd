"""A node agent: one per host, on task queue `node.<id>`. It launches, watches, commands and stops
the ranks of this host, and serves their telemetry to the run monitor.

    python -m workers.node_agent --node n1 --address 127.0.0.1:7233

A dead agent is how the workflow learns its host is gone (heartbeat and schedule-to-start
timeouts), so the agent does nothing clever to stay up: its ranks die with it.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import structlog
from temporalio.worker import Worker

from activities.hub import NodeHub
from activities.node import NodeActivities
from training.logs import configure_logging
from workers.supervisor import connect
from workflows.run import node_queue

log = structlog.get_logger()


def default_memory_dir(node: str) -> Path:
    """Host memory: tmpfs where the host has one (every Linux host's /dev/shm)."""
    shm = Path("/dev/shm")
    return (shm if shm.is_dir() else Path("/tmp")) / "stayalive" / node


async def serve(
    node: str, address: str, namespace: str, host: str, advertise: str | None, state_dir: Path, memory_dir: Path
) -> None:
    hub = NodeHub(node, host, memory_dir, advertise)
    await hub.start()
    node_activities = NodeActivities(node, hub, state_dir / "nodes" / node)
    client = await connect(address, namespace)
    worker = Worker(
        client,
        task_queue=node_queue(node),
        activities=[
            node_activities.prepare_generation,
            node_activities.run_ranks,
            node_activities.release_run,
            node_activities.send_command,
        ],
        max_concurrent_activities=64,
    )
    log.info("node agent started", task_queue=node_queue(node), hub=str(hub.endpoint))
    try:
        await worker.run()
    finally:
        hub.close()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m workers.node_agent", description=__doc__)
    parser.add_argument("--node", required=True, help="this node's id, e.g. n1")
    parser.add_argument("--address", default="127.0.0.1:7233", help="Temporal frontend host:port")
    parser.add_argument("--namespace", default="default")
    parser.add_argument("--host", default="127.0.0.1", help="address the hub and rendezvous store listen on")
    parser.add_argument("--advertise", default=None, help="address other hosts reach this one at (default --host)")
    parser.add_argument("--state-dir", type=Path, default=Path(".stayalive"), help="where rank logs are kept")
    parser.add_argument("--memory-dir", type=Path, default=None, help="host-memory checkpoint tier (default /dev/shm)")
    args = parser.parse_args()
    configure_logging(node=args.node)
    memory_dir = args.memory_dir or default_memory_dir(args.node)
    asyncio.run(serve(args.node, args.address, args.namespace, args.host, args.advertise, args.state_dir, memory_dir))


if __name__ == "__main__":
    main()
