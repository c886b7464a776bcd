"""The workers a simulated run needs, in this process: RunWorkflow and the supervisor's simulated
activities on `stayalive`, and each simulated node's activities on `node.<id>`."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from datetime import timedelta

from temporalio.client import Client
from temporalio.worker import Worker

from core.launch import node_queue
from sim.activities import HEARTBEAT_SECONDS, SimulatedNode, SimulatedSupervisor
from sim.cluster import SimulatedCluster
from workflows.run import TASK_QUEUE, RunWorkflow

# Heartbeats are how a cancel reaches a waiting activity; unthrottled, a cancelled one ends at once
# instead of holding a slot for up to 0.8 × its heartbeat timeout.
THROTTLE = timedelta(seconds=HEARTBEAT_SECONDS)


@contextlib.asynccontextmanager
async def simulated_workers(client: Client, cluster: SimulatedCluster) -> AsyncIterator[None]:
    workers = [
        Worker(
            client,
            task_queue=TASK_QUEUE,
            workflows=[RunWorkflow],
            activities=SimulatedSupervisor(cluster).activities(),
            max_heartbeat_throttle_interval=THROTTLE,
            default_heartbeat_throttle_interval=THROTTLE,
        ),
        *(
            Worker(
                client,
                task_queue=node_queue(node),
                activities=SimulatedNode(cluster, node).activities(),
                max_heartbeat_throttle_interval=THROTTLE,
                default_heartbeat_throttle_interval=THROTTLE,
            )
            for node in cluster.nodes
        ),
    ]
    async with contextlib.AsyncExitStack() as stack:
        for worker in workers:
            await stack.enter_async_context(worker)
        yield
