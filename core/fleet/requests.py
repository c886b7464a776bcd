"""What runs, node agents and people ask the fleet, and what it answers.

Every change to the fleet is one `request` signal to FleetWorkflow carrying a `FleetRequest`: an id
the sender chooses (the same id for a retry, so nothing is applied twice) and one operation. The
fleet answers each request once, under its id, for the `answers` query (core.fleet.model.FleetAnswer);
activities/fleet.py's FleetClient sends one and waits for the answer. A signal, not an update: a workflow
takes at most 10 updates in flight, and a whole fleet's node agents register at once.

Each operation is a `FleetOp[R]`, R being the type of its result, so the sender's answer is typed.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import BaseModel, Field

from stayalive.core.fleet.model import EccTrend, EvictionOutcome, FailureRate, FleetNode, Quarantine

R = TypeVar("R")


def fleet_id(cluster: str = "default") -> str:
    """The workflow id of a cluster's fleet: one FleetWorkflow per cluster."""
    return f"fleet-{cluster}"


class FleetOp(BaseModel, Generic[R]):
    """One change a request asks of the fleet; R is what the fleet answers it with."""

    @classmethod
    def answer_type(cls) -> Any:
        """R, as the operation's class declares it (`class Acquire(FleetOp[Grant])` → Grant)."""
        for base in cls.__mro__:
            generic = getattr(base, "__pydantic_generic_metadata__", None)
            if generic and generic["origin"] is FleetOp:
                return generic["args"][0]
        raise TypeError(f"{cls.__name__} does not say what it is answered with: declare it as FleetOp[...]")


class Grant(BaseModel):
    granted: list[str]
    refused: dict[str, str]  # node → why, e.g. "n2 is quarantined: crash in rank 3 (run r1)"


class Replacement(BaseModel):
    quarantine: Quarantine
    spare: str | None


class RegisterNode(FleetOp[FleetNode]):
    """A node agent is up, and its hub listens at `hub`."""

    kind: Literal["register"] = "register"
    node: str
    rack: str
    hub: str  # host:port
    spare: bool = False


class Acquire(FleetOp[Grant]):
    kind: Literal["acquire"] = "acquire"
    run_id: str
    wanted: list[str]


class TakeSpare(FleetOp[str | None]):
    kind: Literal["take_spare"] = "take_spare"
    run_id: str
    candidates: list[str]


class Replace(FleetOp[Replacement]):
    """Quarantine a run's node (its self-test starts) and take a spare in its place, if one is free."""

    kind: Literal["replace"] = "replace"
    run_id: str
    node: str
    reason: str
    candidates: list[str]  # spares the run may take, in order of preference


class Release(FleetOp[list[str]]):
    kind: Literal["release"] = "release"
    run_id: str


class MarkSuspect(FleetOp[FleetNode]):
    kind: Literal["mark_suspect"] = "mark_suspect"
    node: str
    reason: str


class QuarantineNode(FleetOp[Quarantine]):
    kind: Literal["quarantine"] = "quarantine"
    node: str
    reason: str
    run_id: str | None = None  # None: an operator's decision, no run involved


class Retest(FleetOp[None]):
    """An operator asks for another self-test of a quarantined node (after a repair, say)."""

    kind: Literal["retest"] = "retest"
    node: str


class RecordEviction(FleetOp[EvictionOutcome]):
    kind: Literal["record_eviction"] = "record_eviction"
    node: str
    run_id: str
    resolved: bool


class RecordWindows(FleetOp[int]):
    """Healthy windows' median step times of one configuration, for its Baseline; answered with how
    many medians were recorded."""

    kind: Literal["record_baseline"] = "record_baseline"
    config_digest: str
    medians: list[float]


class RecordExposure(FleetOp[FailureRate]):
    """A run's GPU-hours exposed to failure since its last report, and the failures in them; answered
    with the fleet's failure rate after it."""

    kind: Literal["record_exposure"] = "record_exposure"
    run_id: str
    gpu_hours: float = Field(ge=0)
    failures: int = Field(ge=0)


class RecordCorrectedErrors(FleetOp[EccTrend | None]):
    """A node agent's reading of its GPUs' corrected ECC errors (summed; since the driver loaded), sent
    when the count rises: answered with the node's trend, None if the fleet does not keep it."""

    kind: Literal["record_corrected_errors"] = "record_corrected_errors"
    node: str
    at: datetime
    corrected: int = Field(ge=0)


FleetOperation = Annotated[
    RegisterNode
    | Acquire
    | TakeSpare
    | Replace
    | Release
    | MarkSuspect
    | QuarantineNode
    | Retest
    | RecordEviction
    | RecordWindows
    | RecordExposure
    | RecordCorrectedErrors,
    Field(discriminator="kind"),
]


class FleetRequest(BaseModel):
    id: str  # the sender's: a retry with the same id gets the first answer, and changes nothing
    op: FleetOperation


class SelfTestInput(BaseModel):
    """The fleet asks a quarantined node's agent, over its hub, to run the self-test."""

    node: str
    hub: str  # host:port of the node agent's hub, as it registered
    answer_within: float = 300.0  # seconds to reach the agent before the node counts as down
