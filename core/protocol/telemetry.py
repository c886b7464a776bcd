"""What crosses the local channel: rank → node agent (reports), node agent → rank (commands),
and node agent → run monitor (batches). One JSON object per line; `t` names the message.

Per-step data lives here and never enters workflow history.

One exception to JSON, for width: a rank's steps (RankSteps batches, taken apart into StepReports)
stop at its node agent, which folds its ranks' reports into one `NodeSteps` per node per step, and
the hub sends those to the run monitor as fixed-size binary frames (`steps_frame`, `pack_steps`): at
16,384 ranks the monitor takes 2,048 records per step, and a JSON decode each (~3.5 µs even in
pydantic_core) would be most of its budget; a frame is kept as its bytes, and a whole batch of them
is decoded by one `np.frombuffer` (core.monitor.progress.StepIngest). On a subscription stream a
frame follows one 0x00 byte (`FRAME_MARK`) and is `steps_frame(R).itemsize` bytes long, R the run's
ranks per node; every other record is a JSON line, which starts with '{'. A frame's `seq` is its
record number, which the monitor's cursor acknowledges as it does a JSON record's.
"""

from __future__ import annotations

import functools
import math
from typing import Annotated, Any, Literal, Self, Union

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, model_validator

from stayalive.core.judgement.diagnosis import GpuHealth


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


class RankSteps(_Message):
    """A batch of one rank's completed steps (training/step_reports.py), column by column: entry i of
    each list is one step. One model and one JSON line for the batch, where a StepReport each cost
    the rank seven times the CPU; its node agent takes the batch apart (`reports()`)."""

    t: Literal["rank_steps"] = "rank_steps"
    rank: int
    generation: int
    step: list[int]
    compute_s: list[float]
    step_s: list[float]
    loss: list[float | None]
    samples: list[list[int]]
    at: list[float]

    @model_validator(mode="after")
    def _one_entry_per_step(self) -> Self:
        columns: list[list[Any]] = [self.compute_s, self.step_s, self.loss, self.samples, self.at]
        if any(len(column) != len(self.step) for column in columns):
            raise ValueError(f"rank {self.rank}'s step batch has columns of unequal length")
        return self

    def reports(self) -> list[StepReport]:
        rank, generation = self.rank, self.generation
        return [
            StepReport(
                rank=rank,
                generation=generation,
                step=step,
                compute_s=compute,
                step_s=took,
                loss=loss,
                samples=samples,
                at=at,
            )
            for step, compute, took, loss, samples, at in zip(
                self.step, self.compute_s, self.step_s, self.loss, self.samples, self.at, strict=True
            )
        ]


class NodeSteps(_Message):
    """One step of every rank of one node, folded by its agent (core.monitor.progress.StepBatcher): rank
    `first_rank + i` is entry i. A rank whose report never came has NaN seconds, loss None and no
    samples; `at` is the newest report's time."""

    model_config = ConfigDict(frozen=True, ser_json_inf_nan="constants")  # NaN survives a JSON line

    t: Literal["steps"] = "steps"
    generation: int
    step: int
    first_rank: int
    compute_s: list[float]
    step_s: list[float]
    loss: list[float | None]
    samples: list[list[int]]  # each rank's sample positions, as its StepReport had them
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
    at: float = 0.0  # when it was committed (seconds since the epoch)


class StorageUnavailable(_Message):
    """The rank's checkpoint write to storage fails (once per outage, at its first failure): the
    checkpoint is in host memory, on this node and its replica's, training goes on, and the write is
    retried; a newer checkpoint takes the place of one still waiting."""

    t: Literal["storage_unavailable"] = "storage_unavailable"
    rank: int
    generation: int
    step: int  # the checkpoint whose write failed
    since: float  # seconds since the epoch
    error: str


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
    rank: int  # who reports it: the replaying rank (self), rank 0 (cross, replicas)
    generation: int
    step: int
    method: Literal["self", "cross", "replicas"]
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
    # nonfinite: the reporting rank is the one whose numbers went non-finite. False: nobody can tell
    # (an FSDP2 loop's reduce-scatter spreads them), and rank 0 reports it.
    origin_known: bool = True


class RankExited(_Message):
    """Written by the node agent itself when it reaps a rank process: how it ended, how far it got,
    and the end of its log (a rank that died of a lost peer says so there: a witness, not a culprit)."""

    t: Literal["exited"] = "exited"
    rank: int
    generation: int
    exit_code: int
    at: float
    last_step: int | None = None
    log_tail: str = ""


class RankStarted(_Message):
    """Written by the node agent itself when a rank process takes its place in a generation (started
    cold, forked from the warm server, or carried over a resize): which process holds which rank. A script
    run with `hooks: false` never says Hello; this is how its processes are known."""

    t: Literal["started"] = "started"
    rank: int
    generation: int
    pid: int
    rejoined: bool = False
    at: float = 0.0  # time.time() when the agent had the process


RankMessage = Annotated[
    Union[  # noqa: UP007
        Hello,
        RankStarted,
        StepReport,
        RankSteps,
        NodeSteps,
        CheckpointCommitted,
        StorageUnavailable,
        Resumed,
        Held,
        GpuReport,
        Finished,
        RankExited,
        SdcCheck,
        Anomaly,
    ],
    Field(discriminator="t"),
]
rank_message = TypeAdapter(RankMessage)

# ── NodeSteps as a binary frame (node hub → run monitor) ──────────────────────────────────────────

FRAME_MARK = b"\x00"  # precedes a frame on a subscription stream; a JSON line starts with '{'


@functools.cache
def steps_frame(ranks_per_node: int) -> np.dtype:
    """The frame of one NodeSteps: little-endian, unpadded, 32 + 12·`ranks_per_node` bytes. `seq` is
    the hub's number for the record (the monitor's cursor acknowledges it); seconds and losses are
    float32, NaN where a rank did not report or its loss was not finite. Samples stay on the node."""
    r = ranks_per_node
    return np.dtype(
        [
            ("seq", "<u8"),
            ("generation", "<u4"),
            ("first_rank", "<u4"),
            ("step", "<u8"),
            ("at", "<f8"),
            ("compute", "<f4", (r,)),
            ("step_s", "<f4", (r,)),
            ("loss", "<f4", (r,)),
        ]
    )


def pack_steps(seq: int, steps: NodeSteps, ranks_per_node: int) -> bytes:
    """`steps` as one frame of `steps_frame(ranks_per_node)`, NaN-padded when fewer ranks reported."""
    count = len(steps.compute_s)
    if count > ranks_per_node or not len(steps.step_s) == len(steps.loss) == count:
        raise ValueError(f"a frame holds {ranks_per_node} ranks of equal-length vectors, not {count}")
    frame = np.zeros((), dtype=steps_frame(ranks_per_node))
    frame["seq"], frame["generation"], frame["first_rank"] = seq, steps.generation, steps.first_rank
    frame["step"], frame["at"] = steps.step, steps.at
    losses = [x if x is not None and math.isfinite(x) else math.nan for x in steps.loss]
    for field, values in (("compute", steps.compute_s), ("step_s", steps.step_s), ("loss", losses)):
        frame[field] = math.nan
        frame[field][:count] = values
    return frame.tobytes()


def frame_seq(frame: bytes) -> int:
    """The hub's record number of a frame (its first field), without decoding the rest."""
    return int.from_bytes(frame[:8], "little")


CommandKind = Literal["checkpoint", "hold", "exit", "rebalance", "interval"]


class Command(_Message):
    """A control command for every rank of a run. Ranks agree on the step at which they act on it:
    `checkpoint` now; `hold` (finish the step, checkpoint, then wait for a Rejoin); `exit`;
    `rebalance` (split the global batch by `speeds`, one relative speed per rank: escalation S2);
    `interval` (checkpoint every `seconds` from now on: `auto` recomputed Daly's interval)."""

    t: Literal["command"] = "command"
    seq: int = Field(ge=1)
    kind: CommandKind
    speeds: list[float] = []
    seconds: float | None = Field(default=None, gt=0)


class Rejoin(_Message):
    """To a holding rank: join the next generation's group with this environment (the one a freshly
    launched rank of that generation gets), keeping the process and its in-memory state."""

    t: Literal["rejoin"] = "rejoin"
    env: dict[str, str]


ToRank = Annotated[Union[Command, Rejoin], Field(discriminator="t")]  # noqa: UP007
to_rank = TypeAdapter(ToRank)


class Record(_Message):
    """A rank message as the node agent received it, numbered per run so a reader can resume."""

    # A message inside a union is written with the outer model's setting: without this, a NodeSteps'
    # NaN would become null here and fail to read back.
    model_config = ConfigDict(frozen=True, ser_json_inf_nan="constants")

    seq: int
    node: str
    message: RankMessage


class Subscribe(_Message):
    """Sent by a reader (the run monitor) to a node agent: stream this run's records.

    A named `reader` resumes after the last record it acknowledged (`Ack`), which the agent keeps: a
    reader's place in each node's stream lives on that node, not in the workflow. A reader new to the
    node starts at the first record of `generation` (or after `after`). The agent writes a `Beat`
    every second, so a silent node is told from a quiet one."""

    t: Literal["subscribe"] = "subscribe"
    run_id: str
    after: int = 0
    only: list[str] | None = None  # message kinds (`t`) wanted; None: all
    reader: str | None = None
    generation: int | None = None
    # Step batches as binary frames of this many ranks each (one 0x00 byte, then the frame), not JSON.
    packed_ranks: int | None = None


class Ack(_Message):
    """From a reader to the agent: every record up to `seq` is dealt with; resume after it."""

    t: Literal["ack"] = "ack"
    seq: int


class Beat(_Message):
    """From the agent to a reader, every second: the agent is alive (not a record; not numbered)."""

    t: Literal["beat"] = "beat"
    at: float


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


class OpenStore(_Message):
    """From a node agent's relay, for a rank of the run: connect me to the generation's rendezvous
    store, which listens on this node's loopback only. Once answered StoreOpened, the connection
    carries the store's own protocol, both ways."""

    t: Literal["store"] = "store"
    run_id: str
    generation: int


class StoreOpened(_Message):
    t: Literal["store_opened"] = "store_opened"


Opening = Annotated[Union[Hello, Subscribe, PutFile, GetFile, OpenStore], Field(discriminator="t")]  # noqa: UP007
opening = TypeAdapter(Opening)  # the first line on a hub connection says who is calling and why
