"""The workers a simulated run needs, in this process: RunWorkflow and FleetWorkflow with the real
fleet and paging activities and the simulated rest, all on `stayalive` (node agents are reached by
the supervisor's activities, not through queues of their own, so a simulated node costs no worker);
and the simulated nodes' registration with the real fleet."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from datetime import timedelta

from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest
from temporalio.client import Client
from temporalio.worker import Worker

from stayalive.activities.fleet import FleetActivities, FleetClient
from stayalive.core.fleet.requests import RegisterNode
from stayalive.sim.activities import SimulatedSupervisor
from stayalive.sim.cluster import SimulatedCluster
from stayalive.sim.monitor import HEARTBEAT_SECONDS
from stayalive.sim.server_clock import ServerClock
from stayalive.workers.devstack import SEARCH_ATTRIBUTES
from stayalive.workers.supervisor import ensure_fleet
from stayalive.workflows.fleet import FleetWorkflow, fleet_handle
from stayalive.workflows.run import TASK_QUEUE, RunWorkflow

# Heartbeats are how a cancel reaches a waiting activity; unthrottled, a cancelled one ends at once
# instead of holding a slot for up to 0.8 × its heartbeat timeout.
THROTTLE = timedelta(seconds=HEARTBEAT_SECONDS)


@contextlib.asynccontextmanager
async def simulated_workers(
    client: Client, cluster: SimulatedCluster, silent: Callable[[], set[str]] = set, server: ServerClock | None = None
) -> AsyncIterator[None]:
    fleet = FleetActivities(client)
    worker = Worker(
        client,
        task_queue=TASK_QUEUE,
        workflows=[RunWorkflow, FleetWorkflow],
        activities=[*SimulatedSupervisor(cluster, silent, server).activities(), *fleet.activities()],
        max_heartbeat_throttle_interval=THROTTLE,
        default_heartbeat_throttle_interval=THROTTLE,
        max_concurrent_activities=500,
    )
    async with worker:
        yield


async def register(client: Client, nodes: list[str], spares: list[str], racks: int = 16) -> None:
    """Every simulated node's agent tells the fleet it is up, all at once, as at a cluster's start."""
    await ensure_fleet(client)
    fleet = FleetClient(fleet_handle(client))
    await asyncio.gather(
        *(
            fleet.ask(RegisterNode(node=node, rack=f"rack-{i % racks}", spare=node in spares, hub=f"{node}:7000"))
            for i, node in enumerate([*nodes, *spares])
        )
    )


async def register_search_attributes(client: Client) -> None:
    """RunWorkflow upserts RunState, Step and Goodput; like the dev server, the test server fails the
    workflow task that upserts one it does not know ("search attribute RunState is not defined")."""
    kinds = {
        "Keyword": IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD,
        "Int": IndexedValueType.INDEXED_VALUE_TYPE_INT,
        "Double": IndexedValueType.INDEXED_VALUE_TYPE_DOUBLE,
    }
    wanted = dict(attribute.split("=") for attribute in SEARCH_ATTRIBUTES)
    await client.operator_service.add_search_attributes(
        AddSearchAttributesRequest(namespace="default", search_attributes={n: kinds[k] for n, k in wanted.items()})
    )
