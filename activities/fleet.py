"""The run's side of the fleet: a workflow cannot send an update to another workflow, so these
activities do it with the supervisor's client (FleetWorkflow decides; this only asks)."""

from __future__ import annotations

from pydantic import BaseModel
from temporalio import activity
from temporalio.client import Client

from core.fleet import Quarantine
from workflows.fleet import Acquire, FleetWorkflow, Grant, QuarantineNode, Release, TakeSpare, fleet_id


class Replace(BaseModel):
    run_id: str
    node: str
    reason: str
    candidates: list[str]  # spares the run may take, in order of preference


class Replacement(BaseModel):
    quarantine: Quarantine
    spare: str | None


class FleetActivities:
    def __init__(self, client: Client, cluster: str = "default") -> None:
        self.fleet = client.get_workflow_handle_for(FleetWorkflow.run, fleet_id(cluster))

    @activity.defn
    async def acquire_nodes(self, request: Acquire) -> Grant:
        return await self.fleet.execute_update(FleetWorkflow.acquire, request)

    @activity.defn
    async def replace_node(self, request: Replace) -> Replacement:
        """Quarantine the node (its self-test starts) and take a spare in its place, if one is free."""
        record = await self.fleet.execute_update(
            FleetWorkflow.quarantine, QuarantineNode(node=request.node, reason=request.reason, run_id=request.run_id)
        )
        spare = await self.take_spare(TakeSpare(run_id=request.run_id, candidates=request.candidates))
        return Replacement(quarantine=record, spare=spare)

    @activity.defn
    async def take_spare(self, request: TakeSpare) -> str | None:
        return await self.fleet.execute_update(FleetWorkflow.take_spare, request)

    @activity.defn
    async def release_nodes(self, request: Release) -> list[str]:
        return await self.fleet.execute_update(FleetWorkflow.release, request)
