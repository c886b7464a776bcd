"""The run's timeline: every interruption that stopped the whole job, how it was classified for
paging, and what was detected without stopping anything. The failure history every decision reads
(the MTBF, paging's rules, the failure limit) is `failures` of it."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, Field

from stayalive.core.protocol.telemetry import SdcCheck
from stayalive.core.run.text import Text


class Cause(StrEnum):
    CRASH = "crash"
    NODE_LOST = "node_lost"
    # A node cut off from the run, not dead: its agent, alive all along, fenced itself out of the
    # generation and said so when it could talk again (core/fencing.py). Amends a node_lost entry.
    PARTITION = "partition"
    CHECKPOINT_INVALID = "checkpoint_invalid"
    HANG = "hang"  # alive, no progress: the progress watchdog fired
    DRAIN = "drain"  # planned: a node taken out by a person or a detector
    PAUSE = "pause"
    ROLLBACK = "rollback"  # resume_from: a person sent the run back to an earlier checkpoint
    SDC = "sdc"  # a silent-data-corruption check failed: the run rolls back to a verified checkpoint
    GPU_FAULT = "gpu_fault"  # NVML saw a GPU fail (core/judgement/gpu_faults.py): its node is cordoned


class PagingClass(StrEnum):
    INDEPENDENT = "independent"
    CORRELATED = "correlated"
    DETERMINISTIC = "deterministic"


class Classification(BaseModel):
    paging: PagingClass
    rule: str
    evidence: Text
    action: Text


# A drain, a pause or a rollback: a person or a detector asked for it; nothing to page about.
PLANNED = Classification(paging=PagingClass.INDEPENDENT, rule="planned", evidence="asked for", action="none")
PLANNED_CAUSES = frozenset({Cause.DRAIN, Cause.PAUSE, Cause.ROLLBACK})


def is_planned(interruption: Interruption) -> bool:
    return interruption.cause in PLANNED_CAUSES


def failures(interruptions: list[Interruption]) -> list[Interruption]:
    """The interruptions nobody asked for: what the MTBF and every paging rule count."""
    return [i for i in interruptions if not is_planned(i)]


class Interruption(BaseModel):
    """One event that stopped the whole job (docs/architecture.md §6), with its cost."""

    at: datetime
    generation: int
    detected_by: str
    cause: Cause
    node: str | None = None
    rank: int | None = None
    step: int | None = Field(default=None, description="Last step completed before it happened.")
    resumed_from: int | None = Field(default=None, description="Checkpoint step the next generation loaded.")
    lost_steps: int | None = None
    detected_after_s: float | None = Field(default=None, description="From the failure to its detection.")
    restart_seconds: float | None = Field(default=None, description="From the failure to the first step after it.")
    restored_from: str | None = Field(
        default=None, description="'memory' (host-memory tier), 'storage', or 'live' (survivors kept their state)."
    )
    detail: Text = ""
    actions: list[Text] = []
    artifacts: list[str] = []  # files to read: the stack dumps of a hang
    paging: Classification | None = None
    idle_seconds: float = 0.0  # waiting for a person or for nodes (in goodput: idle, not recovery)
    sdc_check: SdcCheck | None = None  # the failed check: method, culprit, measured difference, tolerance

    def resumed_at(self, step: int) -> None:
        self.resumed_from = step
        if self.step is not None:
            self.lost_steps = max(0, self.step - step)

    def line(self) -> str:
        where = f"node {self.node}" + (f" rank {self.rank}" if self.rank is not None else "")
        return f"{self.cause.value} on {where} at step {self.step}"


class Detection(BaseModel):
    """Something that interrupted nothing: a straggler (relative), a slowdown (absolute), a step
    whose update was skipped (a non-finite loss or gradient, a gradient spike), checkpoint storage
    that went away, or ranks that lingered at exit after the run's work was done (stopped)."""

    at: datetime
    generation: int
    kind: Literal["straggler", "slowdown", "nonfinite", "grad_spike", "storage_outage", "lingered"]
    step: int
    ratio: float | None = None  # how much slower (stragglers and slowdowns)
    node: str | None = None
    rank: int | None = None
    diagnosis: str | None = None
    evidence: Text = ""
    actions: list[Text] = []
    paging: Classification | None = None


class EarlierInterruptions(BaseModel):
    """What the run keeps of the interruptions older than its newest INTERRUPTIONS_KEPT: a month at
    16,384 GPUs has hundreds, each a row of the timeline. Their costs stay in the goodput ledger and
    their count in the run's MTBF, by these totals."""

    count: int = 0
    failures: int = 0  # of them, the ones nobody asked for
    by_cause: dict[str, int] = {}
    lost_seconds: float = 0.0  # at the step time when each left the timeline
    idle_seconds: float = 0.0
    recovery_seconds: float = 0.0
    planned_recovery_seconds: float = 0.0  # of that, after drains, pauses and rollbacks
    newest_at: datetime | None = None


# The newest interruptions the timeline keeps whole; older ones live on as totals (EarlierInterruptions).
# 128 is more than a failure limit's window holds and than paging's rules look back over, and at 16,384
# GPUs about two weeks.
INTERRUPTIONS_KEPT = 128
DETECTIONS_KEPT = 256  # a month of stragglers and skipped updates must not grow the state without end
