"""The run's side of the fleet: a workflow cannot send an update to another workflow, so these
activities do it with the supervisor's client (FleetWorkflow decides; this only asks)."""

from __future__ import annotations

from pydantic import BaseModel
from temporalio import activity
from temporalio.client import Client

from core.fleet import Baseline, EvictionOutcome, FleetState, Quarantine
from core.fleet_requests import (
    Acquire,
    Grant,
    MarkSuspect,
    QuarantineNode,
    RecordBaseline,
    RecordEviction,
    Release,
    TakeSpare,
    fleet_id,
)


class Replace(BaseModel):
    run_id: str
    node: str
    reason: str
    candidates: list[str]  # spares the run may take, in order of preference


class RecordWindows(BaseModel):
    config_digest: str
    medians: list[float]


class Replacement(BaseModel):
    quarantine: Quarantine
    spare: str | None


class FleetActivities:
    def __init__(self, client: Client, cluster: str = "default") -> None:
        self.fleet = client.get_workflow_handle(fleet_id(cluster))

    @activity.defn
    async def acquire_nodes(self, request: Acquire) -> Grant:
        return await self.fleet.execute_update("acquire", request, result_type=Grant)

    @activity.defn
    async def replace_node(self, request: Replace) -> Replacement:
        """Quarantine the node (its self-test starts) and take a spare in its place, if one is free."""
        quarantine = QuarantineNode(node=request.node, reason=request.reason, run_id=request.run_id)
        record = await self.fleet.execute_update("quarantine", quarantine, result_type=Quarantine)
        spare = await self.take_spare(TakeSpare(run_id=request.run_id, candidates=request.candidates))
        return Replacement(quarantine=record, spare=spare)

    @activity.defn
    async def take_spare(self, request: TakeSpare) -> str | None:
        spare: str | None = await self.fleet.execute_update("take_spare", request)  # a JSON string or null
        return spare

    @activity.defn
    async def release_nodes(self, request: Release) -> list[str]:
        released: list[str] = await self.fleet.execute_update("release", request)  # a JSON list of node ids
        return released

    @activity.defn
    async def baseline(self, config_digest: str) -> list[float]:
        """Healthy runs' window medians for this configuration: what the absolute slowdown check compares to."""
        known: Baseline | None = await self.fleet.query("baseline", config_digest, result_type=Baseline)
        return list(known.step_seconds) if known else []

    @activity.defn
    async def record_baseline(self, request: RecordWindows) -> int:
        for median in request.medians:
            await self.fleet.execute_update(
                "record_baseline", RecordBaseline(config_digest=request.config_digest, step_seconds=median)
            )
        return len(request.medians)

    @activity.defn
    async def mark_suspect(self, request: MarkSuspect) -> None:
        await self.fleet.execute_update("mark_suspect", request)

    @activity.defn
    async def eviction_outcomes(self) -> list[EvictionOutcome]:
        """What the fleet's past straggler evictions did: P(healthy) of the eviction payback."""
        state: FleetState = await self.fleet.query("state", result_type=FleetState)
        return list(state.evictions)

    @activity.defn
    async def record_eviction(self, request: RecordEviction) -> EvictionOutcome:
        outcome: EvictionOutcome = await self.fleet.execute_update(
            "record_eviction", request, result_type=EvictionOutcome
        )
        return outcome
