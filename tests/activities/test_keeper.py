"""The run monitor's checkpoint keeper decides retention itself, over what the workflow gave it at the
generation's start and its own verdicts since: the same rule (core/decisions/retention.py), the same records."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from stayalive.activities.checkpoints import Shelf
from stayalive.core.messages.events import KeeperInput
from stayalive.core.run.status import CheckpointRecord

START = datetime(2026, 1, 1, tzinfo=UTC)


def record(step: int, generation: int = 0, last_verified: int = 0, **flags: bool) -> CheckpointRecord:
    return CheckpointRecord(
        step=step,
        path=f"/ckpt/run/step-{step:08d}-g{generation}",
        generation=generation,
        blocking_seconds=0.1,
        written_at=START + timedelta(minutes=step / 10),  # all within the first six-hour window
        validated=flags.pop("validated", True),
        last_verified_step=last_verified,
        **flags,
    )


def shelf(records: list[CheckpointRecord], verified_step: int = 0) -> Shelf:
    # Checks and checkpoints every 100 steps: keep the newest 3 × 100/100 + 2 = 5 valid ones.
    keeper = KeeperInput(
        root="/ckpt",
        checkpoints=records,
        verified_step=verified_step,
        started_at=START,
        sdc_check_steps=100,
        checkpoint_steps=100,
    )
    return Shelf(keeper, list(records))


def test_each_verdict_drops_what_falls_out_of_the_newest_five() -> None:
    kept = shelf([record(s) for s in (100, 200, 300, 400, 500, 600)])
    assert kept.add(record(700, generation=1)) == [record(200)]  # 100 is the window's milestone
    kept.forget([record(200).path])
    assert [c.step for c in kept.add(record(800, generation=1))] == [300]
    kept.forget([record(300).path])
    assert [c.step for c in kept.records] == [100, 400, 500, 600, 700, 800]


def test_suspect_and_invalid_records_go_with_the_next_verdict() -> None:
    """What the workflow marked when the last generation ended (an SDC rollback's suspects) is deleted
    once the keeper next has a verdict, not before: a generation that never checkpoints deletes nothing."""
    kept = shelf([record(100), record(200, suspect=True), record(300, validated=False)])
    assert {c.step for c in kept.add(record(400, generation=1))} == {200, 300}


def test_the_newest_verified_checkpoint_stays_however_old() -> None:
    """An SDC rollback needs the newest checkpoint a passing check covered; the verdict that moves the
    watermark past a checkpoint makes it verified, as the workflow's own record does."""
    kept = shelf([record(s) for s in (100, 200, 300, 400, 500, 600, 700)], verified_step=0)
    dropped = kept.add(record(800, generation=1, last_verified=250))
    assert [c.step for c in dropped] == [300]  # 200 is verified now (a check passed at 250): kept
    assert [c.step for c in kept.records if c.verified] == [100, 200]


def test_the_norm_band_is_anchored_on_the_newest_resumable_checkpoint() -> None:
    kept = shelf([record(100), record(200), record(300, suspect=True)])
    reference = kept.reference()
    assert reference is not None and reference.step == 200
    kept.add(record(400, generation=1, validated=False))
    reference = kept.reference()
    assert reference is not None and reference.step == 200
