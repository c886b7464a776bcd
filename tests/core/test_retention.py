"""Retention by the rule of docs/architecture.md §8, never a bare constant."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from stayalive.core.book import records
from stayalive.core.book.findings import Judged
from stayalive.core.book.runbook import RunBook
from stayalive.core.decisions.goodput import ledger
from stayalive.core.decisions.retention import keep_count, to_delete
from stayalive.core.messages.events import CheckpointJudged
from stayalive.core.run.status import SERIES_POINTS, CheckpointRecord
from tests.core.runs import spec, status

START = datetime(2026, 1, 1, tzinfo=UTC)


@pytest.mark.parametrize(
    ("sdc_check", "checkpoint", "keep"),
    [
        (33.0, 13.6, 10),  # 3 × (33 min / 13.6 min) + 2 ≈ 9.3, so at least 10 are kept
        (100, 50, 8),
        (1000, 1000, 5),
        (100, 1000, 3),  # checks more often than checkpoints: the newest checkpoints are enough
    ],
)
def test_keep_count_follows_the_detection_window(sdc_check: float, checkpoint: float, keep: int) -> None:
    assert keep_count(sdc_check, checkpoint) == keep


def record(step: int, hours: float, validated: bool | None = True) -> CheckpointRecord:
    return CheckpointRecord(
        step=step,
        path=f"/ckpt/step-{step:08d}-g0",
        generation=0,
        blocking_seconds=0.1,
        written_at=START + timedelta(hours=hours),
        validated=validated,
    )


def test_old_checkpoints_go_but_milestones_and_pending_ones_stay() -> None:
    # One checkpoint an hour for 14 hours; checks every 100 steps, checkpoints every 100 steps: keep 5.
    history = [record(100 * (h + 1), h + 0.5) for h in range(14)]
    history.append(record(1500, 14.5, validated=None))  # still being validated
    history.append(record(1600, 14.7, validated=False))  # failed validation
    dropped = {c.step for c in to_delete(history, START, sdc_check_steps=100, checkpoint_steps=100)}
    newest_five = {1000, 1100, 1200, 1300, 1400}
    milestones = {100, 700, 1300}  # the first valid checkpoint of hours 0-6, 6-12, 12-18
    assert dropped == {c.step for c in history} - newest_five - milestones - {1500}
    assert 1600 in dropped


def test_a_month_of_checkpoints_keeps_the_state_small() -> None:
    """A checkpoint every five minutes for 30 days, retention applied to each as the keeper does: the state keeps
    the records retention keeps (the newest few, a milestone per six hours), and the ledger still
    counts every blocking second."""
    book = RunBook(status(spec=spec(interval="5m"), started_at=START, first_step_at=START))
    written = 30 * 24 * 12
    for n in range(written):
        checkpoint = record(10 * (n + 1), (n + 1) / 12)
        deleted = to_delete([*book.status.checkpoints, checkpoint], START, sdc_check_steps=100, checkpoint_steps=10)
        book.apply(Judged([CheckpointJudged(generation=0, checkpoint=checkpoint, deleted=[d.path for d in deleted])]))
    kept = book.status.checkpoints
    assert len(kept) == keep_count(100, 10) + 30 * 4  # the newest 32, and a milestone per six hours
    summary = book.status.deleted_checkpoints
    assert summary.count + len(kept) == written
    assert summary.newest_step is not None and summary.newest_step < kept[-1].step
    book.status.progress.step_seconds_p50 = 6.0
    end = START + timedelta(days=30)
    assert ledger(book.status, end).checkpoint == pytest.approx(0.1 * written)
    assert len(book.status.samples) <= SERIES_POINTS
    assert len(book.status.model_dump_json()) < 64 * 1024


def test_the_newest_verified_checkpoint_survives_and_suspect_ones_go() -> None:
    # Checkpoints every 10 steps, checks every 100: keep 32 by count; the last check passed at step 30,
    # so step 30 is the only clean ancestor an SDC rollback could use, however many come after it.
    history = [record(10 * (i + 1), 0.01 * i) for i in range(40)]
    for c in history:
        c.verified = c.step <= 30
    history[-1].suspect = True
    dropped = {c.step for c in to_delete(history, START, sdc_check_steps=100, checkpoint_steps=10)}
    assert 30 not in dropped
    assert 400 in dropped  # suspect: never resumed from, so not kept
    assert dropped == {20, 40, 50, 60, 70, 400}  # 10: the first six-hour milestone; 80-390: the newest 32


def test_a_refused_checkpoint_deleted_by_retention_stays_readable() -> None:
    book = RunBook(status(started_at=START, first_step_at=START))
    good, bad = record(10, 0.1), record(20, 0.2, validated=False)
    bad.reason = "shard 2: 1024 bytes, manifest says 4096"
    book.apply(Judged([CheckpointJudged(generation=0, checkpoint=c, deleted=[]) for c in (good, bad)]))
    book.apply(Judged([CheckpointJudged(generation=0, checkpoint=record(30, 0.3), deleted=[bad.path])]))
    assert [c.step for c in book.status.checkpoints] == [10, 30]
    (refused,) = book.status.rejected_checkpoints
    assert refused.reason == bad.reason and book.status.deleted_checkpoints.count == 1


# A verdict on generation 0's step 20 reaching the book after a crash ended generation 0: which
# records hold step 20 afterwards, kept (resume candidates, retention's list) and rejected.
LATE_VERDICTS = [
    # Refused and still on storage: kept, so the next keeper's retention deletes it; never resumable.
    ("refused", False, [], ["refused"], []),
    # Refused and already deleted by retention: the restart's storage scan cannot find it, the
    # verdict is the only record of the refusal left.
    ("refused", True, [], [], ["refused"]),
    # Valid: the restart judged storage itself, so the late verdict adds nothing.
    ("valid", False, [], [], []),
    # Refused, and the restart's storage scan filed it first: not twice.
    ("refused", False, ["scan"], ["scan"], []),
    # A suspect checkpoint is refused too.
    ("suspect", False, [], ["suspect"], []),
]


@pytest.mark.parametrize(("verdict", "deleted_with_it", "filed", "kept", "rejected"), LATE_VERDICTS)
def test_a_late_verdict_keeps_only_a_refusal_on_record(
    verdict: str, deleted_with_it: bool, filed: list[str], kept: list[str], rejected: list[str]
) -> None:
    book = RunBook(status(started_at=START, first_step_at=START, generation=1))
    late = record(20, 0.2, validated=verdict == "valid")
    late.suspect, late.reason = verdict == "suspect", verdict
    for reason in filed:
        book.status.checkpoints.append(late.model_copy(update={"reason": reason}))
    judged = CheckpointJudged(generation=0, checkpoint=late, deleted=[late.path] if deleted_with_it else [])
    assert records.file_verdict(book.status, judged) is False, "no news about the running generation"
    assert [c.reason for c in book.status.checkpoints if c.step == 20] == kept
    assert [c.reason for c in book.status.rejected_checkpoints] == rejected
    assert book.status.latest_valid_checkpoint() is None, "a late verdict never becomes a place to resume"


def test_a_late_refusal_is_filed_once_however_often_it_arrives() -> None:
    book = RunBook(status(started_at=START, first_step_at=START, generation=1))
    late = record(20, 0.2, validated=False)
    for deleted in ([], [late.path], []):
        book.apply(Judged([CheckpointJudged(generation=0, checkpoint=late, deleted=deleted)]))
    assert not book.status.checkpoints
    assert [c.step for c in book.status.rejected_checkpoints] == [20]
    assert book.status.deleted_checkpoints.count == 1
