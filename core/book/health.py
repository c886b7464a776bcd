"""What the `health` query answers and the web UI shows as the run's current details."""

from __future__ import annotations

from datetime import UTC, datetime

from pydantic import BaseModel

from stayalive.core.decisions.goodput import ledger
from stayalive.core.decisions.interval import measured_cost, run_mtbf
from stayalive.core.run.status import CheckpointRecord, Ledger, RunStatus


class Health(BaseModel):
    """What the `health` query answers (docs/architecture.md §4): progress, step times, the slowest rank,
    goodput, interruptions, the SDC watermark, and where the checkpoint interval comes from."""

    state: str
    generation: int
    step: int
    target_step: int | None
    # When the step's loss, the step times and the slowest rank were measured (the newest step the
    # monitor reported): while the ranks step, never older than `fresh_within_s` plus a signal's delivery.
    as_of: datetime | None
    fresh_within_s: float  # the spec's health.progress_refresh
    loss: float | None
    step_time_p50: float
    step_time_max: float
    slowest_rank: int | None
    goodput: float
    ledger: Ledger
    nodes: list[str]
    world_size: int
    interruptions: int
    interruptions_by_cause: dict[str, int]  # the timeline's counts, read in the same state as the ledger
    last_checkpoint: CheckpointRecord | None
    checkpoint_interval_s: float | None  # the interval in force (None: the spec fixes it in steps)
    checkpoint_interval_why: str  # where it comes from: the spec, or `auto`'s last choice and its C and M
    checkpoint_cost_s: float | None  # C, as the interval uses it (core.decisions.interval.measured_cost)
    mtbf_s: float  # M: the run's MTBF so far, with the fleet's prior (core.decisions.interval.run_mtbf)
    verified_step: int  # the SDC watermark: the newest step at which a check passed
    skipped_updates: int  # steps whose update was skipped (a non-finite loss or gradient, a gradient spike)
    # Checkpoint storage away since then (None: it is not): checkpoints are in host memory only.
    storage_unavailable_since: datetime | None

    @classmethod
    def of(cls, status: RunStatus, now: datetime, checkpoint_interval_s: float | None) -> Health:
        book = ledger(status, now)
        return cls(
            state=status.state.value,
            generation=status.generation,
            step=status.progress.step,
            target_step=status.spec.target_step,
            as_of=datetime.fromtimestamp(status.progress.at, UTC) if status.progress.at else None,
            fresh_within_s=status.spec.health.progress_refresh,
            loss=status.progress.loss,
            step_time_p50=status.progress.step_seconds_p50,
            step_time_max=status.progress.step_seconds_max,
            slowest_rank=status.progress.slowest_rank,
            goodput=book.goodput,
            ledger=book,
            nodes=status.nodes,
            world_size=status.world_size,
            interruptions=status.interruption_count(),
            interruptions_by_cause=status.interruptions_by_cause(),
            last_checkpoint=status.latest_valid_checkpoint(),
            checkpoint_interval_s=checkpoint_interval_s,
            checkpoint_interval_why=status.intervals[-1].why
            if status.intervals
            else f"the spec: checkpoint.interval {status.spec.checkpoint.interval}",
            checkpoint_cost_s=measured_cost(status),
            mtbf_s=run_mtbf(status, now),
            verified_step=status.verified_step,
            skipped_updates=sum(status.detection_counts.get(kind, 0) for kind in ("nonfinite", "grad_spike")),
            storage_unavailable_since=datetime.fromtimestamp(outage.since, UTC)
            if (outage := status.storage_outage)
            else None,
        )


def health_table(status: RunStatus, note: str = "") -> str:
    """A short Markdown table for the web UI's current details."""
    progress = status.progress
    last = status.latest_valid_checkpoint()
    interruption = status.interruptions[-1] if status.interruptions else None
    count = f"{status.interruption_count()}" + (f" (last: {interruption.line()})" if interruption else "")
    rows = [
        ("state", f"**{status.state.value}**" + (f" — {note}" if note else "")),
        ("step", f"{progress.step} / {status.spec.target_step or '?'} (generation {status.generation})"),
        ("loss", "-" if progress.loss is None else f"{progress.loss:.4f}"),
        ("measured at", _as_of(status)),
        ("nodes", f"{listing(status.nodes)} ({status.world_size} ranks)"),
        ("step time", f"p50 {progress.step_seconds_p50 * 1000:.0f} ms, max {progress.step_seconds_max * 1000:.0f} ms"),
        ("last valid checkpoint", f"step {last.step}" if last else "none yet"),
        ("verified (SDC checks)", f"to step {status.verified_step}"),
        ("checkpoint storage", _storage(status)),
        ("interruptions", count),
    ]
    return "| | |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows)


def _as_of(status: RunStatus) -> str:
    """When the step's loss and step times were measured, and how fresh they are kept."""
    if not status.progress.at:
        return "no step yet"
    at = datetime.fromtimestamp(status.progress.at, UTC).strftime("%H:%M:%S UTC")
    return f"{at} (refreshed every {status.spec.health.progress_refresh:g} s while the ranks step)"


def _storage(status: RunStatus) -> str:
    if (outage := status.storage_outage) is None:
        return "ok"
    since = datetime.fromtimestamp(outage.since, UTC).strftime("%H:%M:%S UTC")
    return f"**unavailable** since {since} ({outage.error}): checkpoints are in host memory only"


def listing(names: list[str], most: int = 8) -> str:
    """`names` for a person to read: the first `most`, and how many there are in all."""
    shown = ", ".join(names[:most])
    return f"{shown}, … ({len(names)} in all)" if len(names) > most else shown or "none"
