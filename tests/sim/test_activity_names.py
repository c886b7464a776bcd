"""The simulator stands in for every real activity that touches nodes, telemetry or storage: the same
name, argument types and result type. (The fleet's and the pages' activities are the real ones in a
simulated run.) A real activity added or changed without its simulated twin fails here, not as a
simulated run that waits forever for an activity nobody serves."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

from temporalio import activity

from stayalive.activities import checkpoints, paging
from stayalive.activities.monitor import MonitorActivities
from stayalive.activities.nodes import NodeActivities
from stayalive.sim.activities import SimulatedSupervisor
from stayalive.sim.cluster import FailureSchedule, SimulatedCluster


def signatures(functions: Iterable[Callable[..., Any]]) -> dict[str, tuple[object, object]]:
    """Activity name → (argument types, result type), for the activity definitions among `functions`."""
    definitions = [activity._Definition.from_callable(f) for f in functions]
    return {d.name: (d.arg_types, d.ret_type) for d in definitions if d is not None and d.name is not None}


def declared(*owners: type | ModuleType) -> list[Callable[..., Any]]:
    return [f for owner in owners for f in vars(owner).values() if callable(f)]


def test_every_supervisor_activity_on_nodes_telemetry_or_storage_has_a_simulated_twin() -> None:
    simulated = SimulatedSupervisor(SimulatedCluster(["n1"], FailureSchedule()))
    real = declared(MonitorActivities, NodeActivities, checkpoints, paging)
    assert signatures(simulated.activities()) == signatures(real)
