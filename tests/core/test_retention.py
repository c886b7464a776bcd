"""Retention by the rule of docs/architecture.md §8, never a bare constant."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

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
