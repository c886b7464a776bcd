"""What runs, node agents and people ask the fleet (FleetWorkflow's updates), and what it answers."""

from __future__ import annotations

from pydantic import BaseModel


def fleet_id(cluster: str = "default") -> str:
    """The workflow id of a cluster's fleet: one FleetWorkflow per cluster."""
    return f"fleet-{cluster}"


class RegisterNode(BaseModel):
    node: str
    rack: str
    spare: bool = False


class Acquire(BaseModel):
    run_id: str
    wanted: list[str]


class Grant(BaseModel):
    granted: list[str]
    refused: dict[str, str]  # node → why, e.g. "n2 is quarantined: crash in rank 3 (run r1)"


class TakeSpare(BaseModel):
    run_id: str
    candidates: list[str]


class Release(BaseModel):
    run_id: str


class MarkSuspect(BaseModel):
    node: str
    reason: str


class QuarantineNode(BaseModel):
    node: str
    reason: str
    run_id: str | None = None  # None: an operator's decision, no run involved


class Retest(BaseModel):
    node: str


class RecordEviction(BaseModel):
    node: str
    run_id: str
    resolved: bool


class RecordBaseline(BaseModel):
    config_digest: str
    step_seconds: float  # the median step time of one healthy window


class SelfTestInput(BaseModel):
    """The fleet asks a quarantined node's agent, over its hub, to run the self-test."""

    node: str
    hub: str  # host:port of the node agent's hub, as it registered
    answer_within: float = 300.0  # seconds to reach the agent before the node counts as down
