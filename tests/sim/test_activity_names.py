"""The simulator stands in for every real activity: the same name, argument types and result type on
the same task queue. A real activity added or changed without its simulated twin fails here, not as a
simulated run that waits forever for an activity nobody serves."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

from temporalio import activity

import activities.checkpoints
import activities.monitor
import activities.paging
from activities.fleet import FleetActivities
from agent.node import NodeActivities
from sim.activities import SimulatedNode, SimulatedSupervisor
from sim.cluster import FailureSchedule, SimulatedCluster


def signatures(functions: Iterable[Callable[..., Any]]) -> dict[str, tuple[object, object]]:
    """Activity name → (argument types, result type), for the activity definitions among `functions`."""
    definitions = [activity._Definition.from_callable(f) for f in functions]
    return {d.name: (d.arg_types, d.ret_type) for d in definitions if d is not None and d.name is not None}


def declared(*owners: type | ModuleType) -> list[Callable[..., Any]]:
    return [f for owner in owners for f in vars(owner).values() if callable(f)]


def test_every_node_activity_has_a_simulated_twin() -> None:
    simulated = SimulatedNode(SimulatedCluster(["n1"], FailureSchedule()), "n1")
    assert signatures(simulated.activities()) == signatures(declared(NodeActivities))


def test_every_supervisor_activity_has_a_simulated_twin() -> None:
    simulated = SimulatedSupervisor(SimulatedCluster(["n1"], FailureSchedule()))
    real = declared(activities.monitor, activities.checkpoints, activities.paging, FleetActivities)
    assert signatures(simulated.activities()) == signatures(real)
