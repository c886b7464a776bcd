"""What an interruption was, from what the activities reported: pure, for the workflow to record."""

from __future__ import annotations

from datetime import UTC, datetime

from stayalive.core.messages.events import NodeLost, RankFailed
from stayalive.core.run.launch import EXIT_CHECKPOINT_UNUSABLE, EXIT_SDC
from stayalive.core.run.status import CheckpointRecord, RunStatus
from stayalive.core.run.timeline import Cause, Interruption


def interruption_from(failure: RankFailed | NodeLost, status: RunStatus, now: datetime) -> Interruption:
    """A rank that exited or a node that went silent, as a timeline entry. A rank that refused its
    resume checkpoint also marks that checkpoint unusable: it is not resumable after all."""
    if isinstance(failure, NodeLost):
        # It died after the last step every rank completed (the monitor's summary): the silence that
        # gave it away is recovery, and the steps since the checkpoint the next generation loads are lost.
        last = failure.progress
        died = datetime.fromtimestamp(last.at, UTC) if last.at > 0 else now
        return Interruption(
            at=min(died, now),
            generation=status.generation,
            detected_by="node agent heartbeat timeout",
            cause=Cause.NODE_LOST,
            node=failure.node,
            step=max(last.step, status.progress.step),
            detected_after_s=max(0.0, (now - died).total_seconds()),
            detail=failure.detail,
        )
    if failure.exit_code == EXIT_SDC:  # its check's report never reached the monitor: trust only what checkpoints said
        marked = mark_suspect(status.checkpoints, status.generation, status.verified_step)
        return Interruption(
            at=datetime.fromtimestamp(failure.at, UTC),
            generation=status.generation,
            detected_by="rank halted at a failed SDC check (its report was lost)",
            cause=Cause.SDC,
            node=failure.node,
            rank=failure.rank,
            step=failure.last_step,
            detail=f"exit code {failure.exit_code}" + last_line(failure.log_tail),
            actions=[f"marked {len(marked)} checkpoints after step {status.verified_step} suspect"],
        )
    # A rank with hooks that failed before reporting a step of this generation had completed the
    # step it resumed from: the same step failing again is then seen (a batch that kills the first
    # step after a checkpoint), and the entry costs no steps. A plain script reports no steps at all.
    step = failure.last_step if failure.last_step is not None or not status.spec.hooks else resumed_step(status)
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
        step=step,
        detail=f"exit code {failure.exit_code}" + last_line(failure.log_tail),
    )


def resumed_step(status: RunStatus) -> int | None:
    """The step the current generation started from: 0 for the first, else what the interruption
    before it resumed from (None while that is not known)."""
    if status.generation == 0:
        return 0
    before = status.interruptions[-1] if status.interruptions else None
    return before.resumed_from if before is not None and before.generation == status.generation - 1 else None


def supersede(checkpoints: list[CheckpointRecord], step: int) -> list[CheckpointRecord]:
    """A rollback to `step` abandons every later checkpoint: none of them may be resumed from again."""
    later = [c for c in checkpoints if c.step > step and c.validated]
    for record in later:
        record.validated = False
        record.reason = f"superseded: the run was sent back to step {step}"
    return later


def mark_suspect(checkpoints: list[CheckpointRecord], generation: int, watermark: int) -> list[CheckpointRecord]:
    """A failed SDC check in `generation`: what that generation and earlier ones wrote after the last
    passing check (`watermark`) may hold corrupted state. None of it may be resumed from."""
    later = [c for c in checkpoints if c.generation <= generation and c.step > watermark and not c.suspect]
    for record in later:
        record.suspect, record.verified = True, False
        record.reason = f"suspect: written after step {watermark}, the last passing SDC check before a failed one"
    return later


def file_judged(checkpoints: list[CheckpointRecord], watermark: int, judged: CheckpointRecord) -> int:
    """Add a judged checkpoint; the SDC watermark after it (the newest step at which a check had passed
    when it was written). Every resumable checkpoint up to the watermark is verified."""
    checkpoints.append(judged)
    watermark = max(watermark, judged.last_verified_step)
    for record in checkpoints:
        if record.step <= watermark and record.validated and not record.suspect:
            record.verified = True
    return watermark


def last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return f": {lines[-1][-200:]}" if lines else ""
