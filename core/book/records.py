"""How the run's book files what it hears without changing the run's state: checkpoint verdicts and
what retention deleted, what a dead generation left on storage, suspect checkpoints after an SDC
check, checkpoint storage going away and coming back, and detections. Functions over RunStatus,
called only by RunBook (core/book/runbook.py)."""

from __future__ import annotations

from datetime import UTC, datetime

from stayalive.core.decisions.recovery import file_judged, mark_suspect, supersede
from stayalive.core.messages.events import CheckpointJudged, StorageOutage
from stayalive.core.protocol.telemetry import SdcCheck
from stayalive.core.run.status import REJECTED_KEPT, CheckpointRecord, RunStatus, Sample, append_bounded
from stayalive.core.run.timeline import DETECTIONS_KEPT, Cause, Classification, Detection, Interruption, is_planned


def detect(status: RunStatus, detection: Detection) -> None:
    """The newest DETECTIONS_KEPT stay listed; every one is counted."""
    status.detection_counts[detection.kind] = status.detection_counts.get(detection.kind, 0) + 1
    status.detections.append(detection)
    del status.detections[:-DETECTIONS_KEPT]


def fold(status: RunStatus, interruption: Interruption) -> None:
    """An old interruption leaves the timeline for the totals (long since restarted from)."""
    earlier = status.earlier_interruptions
    earlier.count += 1
    earlier.failures += not is_planned(interruption)
    earlier.by_cause[interruption.cause.value] = earlier.by_cause.get(interruption.cause.value, 0) + 1
    earlier.lost_seconds += (interruption.lost_steps or 0) * status.progress.step_seconds_p50
    earlier.idle_seconds += interruption.idle_seconds
    earlier.recovery_seconds += interruption.restart_seconds or 0.0
    if is_planned(interruption):
        earlier.planned_recovery_seconds += interruption.restart_seconds or 0.0
    earlier.newest_at = interruption.at


def file_verdict(status: RunStatus, judged: CheckpointJudged) -> bool:
    """One keeper verdict. True when it was news about the current generation's checkpoints. One
    that arrives after its generation ended is news only if it refused a checkpoint: that record is
    kept (it cannot change where the run resumes), since retention may already have deleted the
    checkpoint the restart's storage scan would have judged again; a late valid one was judged
    there. One a restarted keeper judged again is known already."""
    checkpoint = judged.checkpoint
    known = any(c.path == checkpoint.path for c in (*status.checkpoints, *status.rejected_checkpoints))
    late = judged.generation != status.generation
    if late and not known and (checkpoint.validated is False or checkpoint.suspect):
        status.checkpoints.append(checkpoint)  # retention's list (below) moves it to the rejected ones
    deleted(status, judged.deleted)
    if late or known:
        return False
    status.verified_step = file_judged(status.checkpoints, status.verified_step, checkpoint)
    status.progress.step = max(status.progress.step, checkpoint.step)
    sample = Sample(at=checkpoint.written_at, step=checkpoint.step, step_seconds_p50=status.progress.step_seconds_p50)
    append_bounded(status.samples, sample)
    return True


def deleted(status: RunStatus, paths: list[str]) -> None:
    """Retention deleted these: their records leave the state, their totals stay, and so does
    the record of one refused (invalid or suspect), among the newest REJECTED_KEPT."""
    if not paths:
        return
    gone = set(paths)
    summary = status.deleted_checkpoints
    for record in status.checkpoints:
        if record.path in gone:
            summary.count += 1
            summary.blocking_seconds += record.blocking_seconds
            summary.newest_step = max(summary.newest_step or 0, record.step)
            if record.validated is False or record.suspect:
                status.rejected_checkpoints.append(record)
    del status.rejected_checkpoints[:-REJECTED_KEPT]
    status.checkpoints = [c for c in status.checkpoints if c.path not in gone]


def file_leftovers(status: RunStatus, found: list[CheckpointRecord]) -> None:
    """What the last generation committed that nobody had judged, judged before a restart: what
    ranks halted by an SDC check or sent back by a rollback left is marked as such."""
    status.checkpoints.extend(found)
    for interruption in status.interruptions:
        earlier = [c for c in found if c.generation <= interruption.generation]
        if (check := interruption.sdc_check) is not None:
            mark_suspect(earlier, interruption.generation, check.last_verified)
        if interruption.cause == Cause.ROLLBACK and interruption.resumed_from is not None:
            supersede(earlier, interruption.resumed_from)


def corrupted(status: RunStatus, check: SdcCheck) -> list[CheckpointRecord]:
    """A failed SDC check: what was written after the last passing check may hold corrupted state and
    becomes suspect; the timeline that restarts is verified up to where it starts."""
    suspect = mark_suspect(status.checkpoints, status.generation, check.last_verified)
    resume = status.latest_valid_checkpoint()
    status.verified_step = resume.step if resume else 0
    return suspect


def storage(status: RunStatus, event: StorageOutage) -> Classification | None:
    """Checkpoint storage went away, stayed away, or came back: one detection per outage, however
    many generations it spans. Returns the page to send when it has outlasted paging's bound."""
    if event.phase == "began":
        if status.storage_outage is None:
            status.storage_outage = event.outage
            detect(
                status,
                Detection(
                    at=datetime.fromtimestamp(event.outage.since, UTC),
                    generation=status.generation,
                    kind="storage_outage",
                    step=event.outage.step,
                    evidence=event.outage.error,
                    actions=["training goes on: checkpoints stay in host memory (this node's and a replica's)"],
                ),
            )
        return None
    if event.phase == "lasting":
        if status.storage_outage is None or status.storage_outage.paged:
            return None  # over already, or a monitor restarted from an older place found it again
        status.storage_outage = event.outage
        if (ongoing := _storage_detection(status)) is not None:
            ongoing.paging = event.paging
            ongoing.actions.append(f"paged after {event.lasted_s:.0f}s")
        return event.paging
    storage_back(status, event.landed_step, event.at)
    return None


def storage_back(status: RunStatus, landed_step: int | None, at: float) -> None:
    """A checkpoint landed on storage: the outage, if one is open, is over."""
    if (outage := status.storage_outage) is None:
        return
    status.storage_outage = None
    if (ongoing := _storage_detection(status)) is not None:
        lasted = max(0.0, at - outage.since)
        ongoing.actions.append(f"storage back after {lasted:.0f}s: the checkpoint of step {landed_step} landed")


def _storage_detection(status: RunStatus) -> Detection | None:
    """The open outage's detection (None once the newest detections have pushed it out)."""
    return next((d for d in reversed(status.detections) if d.kind == "storage_outage"), None)


def supersede_after(status: RunStatus, step: int) -> int:
    """A rollback to `step`: every later checkpoint is superseded; the SDC watermark goes back with it."""
    superseded = supersede(status.checkpoints, step)
    status.verified_step = min(status.verified_step, step)
    return len(superseded)
