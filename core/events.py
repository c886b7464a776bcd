"""Typed events that activities complete with, when the workflow has a decision to make."""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, Field

from core.launch import NodeEndpoint
from core.run import Progress


class RanksFinished(BaseModel):
    kind: Literal["finished"] = "finished"
    node: str
    generation: int
    last_step: int | None


# What a rank prints when a collective failed because a peer went away: it died of someone else's
# failure, so it is a witness, not the culprit.
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Read error", "Broken pipe", "Socket Timeout")


class RankFailed(BaseModel):
    kind: Literal["rank_failed"] = "rank_failed"
    node: str
    generation: int
    rank: int
    exit_code: int
    last_step: int | None
    at: float
    log_tail: str = ""

    @property
    def peer_lost(self) -> bool:
        return any(marker in self.log_tail for marker in _PEER_LOST)


class NodeLost(BaseModel):
    """The node's agent stopped answering (dead host, partition, killed agent): a heartbeat timeout."""

    node: str
    detail: str


NodeOutcome = Annotated[Union[RanksFinished, RankFailed], Field(discriminator="kind")]  # noqa: UP007


class MonitorInput(BaseModel):
    run_id: str
    generation: int
    world_size: int
    endpoints: list[NodeEndpoint]
    resume_step: int = 0
    await_first_step: bool = False
    after: dict[str, int] = {}  # per node: the last record already consumed


class FirstStep(BaseModel):
    kind: Literal["first_step"] = "first_step"
    step: int
    at: float
    restored_from: Literal["memory", "storage"] | None = None
    progress: Progress
    after: dict[str, int]


class CheckpointWritten(BaseModel):
    kind: Literal["checkpoint"] = "checkpoint"
    step: int
    path: str
    blocking_seconds: float
    at: float
    progress: Progress
    after: dict[str, int]


MonitorEvent = Annotated[Union[FirstStep, CheckpointWritten], Field(discriminator="kind")]  # noqa: UP007
