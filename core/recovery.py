"""What an interruption was, from what the activities reported: pure, for the workflow to record."""

from __future__ import annotations

from datetime import UTC, datetime

from core.events import NodeLost, RankFailed
from core.launch import EXIT_CHECKPOINT_UNUSABLE
from core.run import Cause, CheckpointRecord, Interruption, RunStatus


def interruption_from(failure: RankFailed | NodeLost, status: RunStatus, now: datetime) -> Interruption:
    """A rank that exited or a node that went silent, as a timeline entry. A rank that refused its
    resume checkpoint also marks that checkpoint unusable: it is not resumable after all."""
    if isinstance(failure, NodeLost):
        return Interruption(
            at=now,
            generation=status.generation,
            detected_by="node agent heartbeat timeout",
            cause=Cause.NODE_LOST,
            node=failure.node,
            step=status.progress.step,
            detail=failure.detail,
        )
    unusable = failure.exit_code == EXIT_CHECKPOINT_UNUSABLE and status.generation > 0
    if unusable and (resume := status.latest_valid_checkpoint()) is not None:
        resume.validated = False
        resume.reason = f"could not be loaded at resume{last_line(failure.log_tail)}"
    return Interruption(
        at=datetime.fromtimestamp(failure.at, UTC),
        generation=status.generation,
        detected_by="rank refused its resume checkpoint" if unusable else "node agent: rank process exited",
        cause=Cause.CHECKPOINT_INVALID if unusable else Cause.CRASH,
        node=failure.node,
        rank=failure.rank,
        step=failure.last_step,
        detail=f"exit code {failure.exit_code}" + last_line(failure.log_tail),
    )


def supersede(checkpoints: list[CheckpointRecord], step: int) -> list[CheckpointRecord]:
    """A rollback to `step` abandons every later checkpoint: none of them may be resumed from again."""
    later = [c for c in checkpoints if c.step > step and c.validated]
    for record in later:
        record.validated = False
        record.reason = f"superseded: the run was sent back to step {step}"
    return later


def last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return f": {lines[-1][-200:]}" if lines else ""
