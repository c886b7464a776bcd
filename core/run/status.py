"""The run's state: one model, carried whole across continue-as-new, answered by the queries; and what
the run returns when it ends."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel

from stayalive.core.judgement.escalation import Escalation
from stayalive.core.judgement.eviction import Eviction
from stayalive.core.run.launch import Membership, node_of
from stayalive.core.run.lifecycle import RunState
from stayalive.core.run.spec import RunSpec
from stayalive.core.run.text import Text
from stayalive.core.run.timeline import Detection, EarlierInterruptions, Interruption, failures


class Outage(BaseModel):
    """Checkpoint storage the ranks cannot write to, from the first failure the run monitor heard of
    until a checkpoint commits again. Meanwhile checkpoints live in host memory only."""

    since: float  # seconds since the epoch
    error: str
    step: int  # the checkpoint whose write failed first
    paged: bool = False  # it lasted past paging's bound (core.decisions.paging.storage_outage) and a person was paged


class CheckpointRecord(BaseModel):
    step: int
    path: str
    generation: int
    blocking_seconds: float
    written_at: datetime
    validated: bool | None = None  # None: validation still running
    reason: Text = ""
    param_norm: float | None = None
    # SDC: the newest step at which a check had passed when it was written; `verified` once a check
    # passed at or after its step; `suspect` when a failed check puts it after the last passing one.
    last_verified_step: int = 0
    verified: bool = False
    suspect: bool = False

    @property
    def resumable(self) -> bool:
        return bool(self.validated) and not self.suspect


class DeletedCheckpoints(BaseModel):
    """What the run keeps of the checkpoints retention deleted: their records leave the state (a month
    writes tens of thousands), their history stays on storage and in these totals."""

    count: int = 0
    blocking_seconds: float = 0.0  # their blocking copies: the goodput ledger still counts them
    newest_step: int | None = None


class Sample(BaseModel):
    """One point of the run's progress series: one per checkpoint judged."""

    at: datetime
    step: int
    step_seconds_p50: float


class IntervalChoice(BaseModel):
    """A checkpoint interval the ranks were told to keep, and why (`auto` recomputes Daly's)."""

    at: datetime
    seconds: float
    cost_s: float | None = None  # C: the blocking seconds it was computed from (None: not measured yet)
    mtbf_s: float  # M: the run's MTBF at the time, with the fleet's prior
    optimum_s: float | None = None  # Daly's interval for that C and M, before the spec's bounds
    why: str


REJECTED_KEPT = 64
SERIES_POINTS = 512  # a series the run carries keeps at most this many points, spread over the run


def append_bounded(series: list[Any], item: Any, most: int = SERIES_POINTS) -> None:
    """Append `item`; a full series first drops every other point but the first, so it stays spread
    over the whole run at half the resolution (its size never passes `most`)."""
    if len(series) >= most:
        del series[1::2]
    series.append(item)


class Progress(BaseModel):
    """The live summary the run monitor heartbeats and returns with each event."""

    step: int = 0
    loss: float | None = None
    steps_per_second: float = 0.0
    step_seconds_p50: float = 0.0
    step_seconds_max: float = 0.0
    slowest_rank: int | None = None
    at: float = 0.0
    # Seconds the barrier waited on slowness since the monitor's last report (core.decisions.goodput.straggler_wait):
    # the workflow adds each report's share to RunStatus.straggler_seconds.
    straggler_s: float = 0.0


class RunStatus(BaseModel):
    spec: RunSpec
    # `<workflow id>/<first run id, 8 chars>`: unique even when a workflow id is reused, and stable
    # across continue-as-new. Names the run to node agents, in logs and under the checkpoint root.
    run_id: str = ""
    state: RunState = RunState.PENDING
    generation: int = 0
    started_at: datetime | None = None
    first_step_at: datetime | None = None
    finished_at: datetime | None = None
    progress: Progress = Progress()
    nodes: list[str] = []  # the current group's nodes, in rank order
    spares_used: list[str] = []
    # Set when the next generation keeps the survivors' processes (after a hold); None: fresh ranks.
    membership: Membership | None = None
    # Set before continue-as-new in the middle of a generation: the next segment re-attaches to the
    # ranks, which never noticed.
    reattach: bool = False
    interruptions: list[Interruption] = []  # the newest INTERRUPTIONS_KEPT
    earlier_interruptions: EarlierInterruptions = EarlierInterruptions()
    detections: list[Detection] = []  # the newest DETECTIONS_KEPT
    detection_counts: dict[str, int] = {}  # every detection of the run, by kind
    baseline: list[float] = []  # the fleet's healthy window medians for this configuration, at start
    checkpoints: list[CheckpointRecord] = []  # every checkpoint retention has not deleted
    deleted_checkpoints: DeletedCheckpoints = DeletedCheckpoints()
    # The newest REJECTED_KEPT of those retention deleted as invalid or suspect: why each was refused
    # stays readable after its files are gone.
    rejected_checkpoints: list[CheckpointRecord] = []
    samples: list[Sample] = []  # step and step time over the run (bounded: append_bounded)
    intervals: list[IntervalChoice] = []  # every checkpoint interval in force, newest last (bounded)
    straggler_seconds: float = 0.0  # the ledger's straggler loss, summed over the run monitor's reports
    escalation: Escalation | None = None  # the straggler being escalated S1 → S4, if any
    evictions: list[Eviction] = []  # this run's straggler evictions (spacing, one per rack without a person)
    # The fleet's measured MTBF at this run's width, as last heard (core.fleet.model.FailureRate), and how
    # far this run's own exposure to failure has been reported to it.
    fleet_mtbf_s: float | None = None
    exposure_reported_at: datetime | None = None
    idle_reported_s: float = 0.0
    verified_step: int = 0  # the SDC watermark: the newest step at which a check passed, as checkpoints reported
    storage_outage: Outage | None = None  # checkpoint storage is away (across generations, until a commit)
    command_seq: int = 0
    failure: str = ""

    @property
    def checkpoint_dir(self) -> str:
        return f"{self.spec.checkpoint.root.rstrip('/')}/{self.run_id}"

    @property
    def world_size(self) -> int:
        return len(self.nodes) * self.spec.ranks_per_node

    def node_of(self, rank: int) -> str | None:
        return node_of(self.nodes, self.spec.ranks_per_node, rank)

    def known_stragglers(self) -> list[int]:
        """The ranks this generation already found slow (a resize renumbers ranks, so only its own count)."""
        return [
            d.rank
            for d in self.detections
            if d.generation == self.generation and d.kind == "straggler" and d.rank is not None
        ]

    def slowdown_known(self) -> bool:
        """This generation already found every rank slow together."""
        return any(d.generation == self.generation and d.kind == "slowdown" for d in self.detections)

    def interruption_count(self) -> int:
        return self.earlier_interruptions.count + len(self.interruptions)

    def failure_count(self) -> int:
        """The run's failures over its whole timeline, those folded into its totals included."""
        return self.earlier_interruptions.failures + len(failures(self.interruptions))

    def interruptions_by_cause(self) -> dict[str, int]:
        counts = dict(self.earlier_interruptions.by_cause)
        for interruption in self.interruptions:
            counts[interruption.cause.value] = counts.get(interruption.cause.value, 0) + 1
        return counts

    def idle_seconds(self) -> float:
        """Seconds the run sat waiting for a person or for nodes, over its whole timeline."""
        return self.earlier_interruptions.idle_seconds + sum(i.idle_seconds for i in self.interruptions)

    def latest_valid_checkpoint(self) -> CheckpointRecord | None:
        return max((c for c in self.checkpoints if c.resumable), key=lambda c: c.step, default=None)


class Ledger(BaseModel):
    """Where the run's wall-clock went, in seconds by category (core/decisions/goodput.py computes it)."""

    wall: float
    startup: float
    checkpoint: float
    lost: float
    recovery: float
    idle: float = 0.0  # waiting for a person or for nodes
    straggler: float = 0.0  # steps slower than healthy: what the barrier waited for the slowest rank

    @property
    def productive(self) -> float:
        costs = self.startup + self.checkpoint + self.lost + self.recovery + self.idle + self.straggler
        return max(0.0, self.wall - costs)

    @property
    def goodput(self) -> float:
        return self.productive / self.wall if self.wall > 0 else 0.0


class RunResult(BaseModel):
    run_id: str
    state: RunState
    final_step: int
    interruptions: list[Interruption]  # the newest INTERRUPTIONS_KEPT
    earlier_interruptions: EarlierInterruptions = EarlierInterruptions()
    ledger: Ledger
    failure: str = ""
