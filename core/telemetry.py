"""What crosses the local channel: rank → node agent (reports), node agent → rank (commands),
and node agent → run monitor (batches). One JSON object per line; `t` names the message.

Per-step data lives here and never enters workflow history.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from core.diagnosis import GpuHealth


class _Message(BaseModel):
    model_config = ConfigDict(frozen=True)


class Hello(_Message):
    t: Literal["hello"] = "hello"
    run_id: str
    rank: int
    generation: int
    pid: int


class StepReport(_Message):
    """One completed step of one rank. `compute_s` ends where the gradient all-reduce begins."""

    t: Literal["step"] = "step"
    rank: int
    generation: int
    step: int
    compute_s: float
    step_s: float
    loss: float | None  # None: not finite (the step's update was skipped)
    samples: list[int]
    at: float


class CheckpointCommitted(_Message):
    """Every shard of the checkpoint is on storage and the manifest is in place (sent by the rank that
    wrote the manifest). `blocking_s` is the longest any rank's step was held up staging its share."""

    t: Literal["committed"] = "committed"
    rank: int
    generation: int
    step: int
    path: str
    blocking_s: float
    last_verified_step: int = 0  # the newest step at which an SDC check had passed (the watermark)


class Resumed(_Message):
    """The rank loaded a checkpoint: from the host-memory tier or from storage, and how long it took."""

    t: Literal["resumed"] = "resumed"
    rank: int
    generation: int
    step: int
    source: Literal["memory", "storage"]
    seconds: float


class Held(_Message):
    """The rank finished the agreed step, its checkpoint is on storage, and it holds, touching no collective."""

    t: Literal["held"] = "held"
    rank: int
    generation: int
    step: int


class GpuReport(_Message):
    """The node agent's reading of its GPUs (NVML, or the simulated source), every few seconds."""

    t: Literal["gpu"] = "gpu"
    node: str
    readings: list[GpuHealth]
    at: float


class Finished(_Message):
    t: Literal["finished"] = "finished"
    rank: int
    generation: int
    step: int


class SdcCheck(_Message):
    """The outcome of one silent-data-corruption check (training/sdc.py). A failed one names the
    culprit rank and the newest step at which a check had passed: the rollback's watermark."""

    t: Literal["sdc"] = "sdc"
    rank: int  # who reports it: the replaying rank (self), rank 0 (cross)
    generation: int
    step: int
    method: Literal["self", "cross"]
    passed: bool
    culprit: int | None = None
    difference: float | None = None  # cross: ‖g_a − g_b‖ / ‖g_a‖ for the same micro-batch
    tolerance: float | None = None
    last_verified: int = 0  # the newest step before this one at which a check passed
    detail: str = ""


class Anomaly(_Message):
    """A step whose update was skipped: a non-finite loss or gradient on this rank, or a gradient
    norm far above the run's running p99."""

    t: Literal["anomaly"] = "anomaly"
    rank: int
    generation: int
    step: int
    kind: Literal["nonfinite", "grad_spike"]
    detail: str


class RankExited(_Message):
    """Written by the node agent itself when it reaps a rank process."""

    t: Literal["exited"] = "exited"
    rank: int
    generation: int
    exit_code: int
    at: float


RankMessage = Annotated[
    Union[  # noqa: UP007
        Hello, StepReport, CheckpointCommitted, Resumed, Held, GpuReport, Finished, RankExited, SdcCheck, Anomaly
    ],
    Field(discriminator="t"),
]
rank_message = TypeAdapter(RankMessage)


class Command(_Message):
    """A control command for every rank of a run. Ranks agree on the step at which they act on it:
    `checkpoint` now; `hold` (finish the step, checkpoint, then wait for a Rejoin); `exit`;
    `rebalance` (split the global batch by `speeds`, one relative speed per rank: escalation S2)."""

    t: Literal["command"] = "command"
    seq: int = Field(ge=1)
    kind: Literal["checkpoint", "hold", "exit", "rebalance"]
    speeds: list[float] = []


class Rejoin(_Message):
    """To a holding rank: join the next generation's group with this environment (the one a freshly
    launched rank of that generation gets), keeping the process and its in-memory state."""

    t: Literal["rejoin"] = "rejoin"
    env: dict[str, str]


ToRank = Annotated[Union[Command, Rejoin], Field(discriminator="t")]  # noqa: UP007
to_rank = TypeAdapter(ToRank)


class Record(_Message):
    """A rank message as the node agent received it, numbered per run so a reader can resume."""

    seq: int
    node: str
    message: RankMessage


class Subscribe(_Message):
    """Sent by the run monitor to a node agent: stream this run's records after `after`."""

    t: Literal["subscribe"] = "subscribe"
    run_id: str
    after: int = 0
    only: list[str] | None = None  # message kinds (`t`) wanted; None: all


class PutFile(_Message):
    """A checkpoint file for this node's host-memory tier; `size` raw bytes follow the line."""

    t: Literal["put"] = "put"
    run_id: str
    checkpoint: str
    file: str
    size: int


class GetFile(_Message):
    """Ask a node for a file of its host-memory tier; it answers a FileHeader, then the bytes."""

    t: Literal["get"] = "get"
    run_id: str
    checkpoint: str
    file: str


class FileHeader(_Message):
    t: Literal["file"] = "file"
    size: int  # -1: this node does not hold the file


Opening = Annotated[Union[Hello, Subscribe, PutFile, GetFile], Field(discriminator="t")]  # noqa: UP007
opening = TypeAdapter(Opening)  # the first line on a hub connection says who is calling and why
