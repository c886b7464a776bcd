"""A month at 16,384 GPUs writes hundreds of interruptions: the timeline keeps the newest
INTERRUPTIONS_KEPT whole and folds the rest into totals, and nothing that reads the run loses them:
the ledger, the run's MTBF, the counts by cause."""

from __future__ import annotations

import pytest

from stayalive.core.book.findings import Interrupted
from stayalive.core.book.runbook import RunBook
from stayalive.core.decisions.goodput import ledger
from stayalive.core.decisions.interval import run_mtbf
from stayalive.core.run.status import Progress, RunStatus
from stayalive.core.run.timeline import INTERRUPTIONS_KEPT, Cause
from tests.core.runs import at, interruption, status

HOURS = 400  # one interruption an hour: several times what the timeline keeps
STEP_S = 2.0


def crashes(hours: int) -> int:
    return sum(1 for hour in range(hours) if hour % 5 != 4)


def recorded(timeline_of: int) -> RunStatus:
    """A run with one interruption an hour: every fifth a drain, the rest crashes that lost 100 steps
    and took 600 s to restart; the ranks stepped at STEP_S."""
    book = RunBook(status(progress=Progress(step_seconds_p50=STEP_S), first_step_at=at()))
    for hour in range(timeline_of):
        cause = Cause.DRAIN if hour % 5 == 4 else Cause.CRASH
        lost = 0 if cause == Cause.DRAIN else 100
        row = interruption(at(hours=hour + 0.5), cause, node=f"n{hour % 7}", step=1000 * hour + lost)
        row.resumed_at(1000 * hour)
        row.restart_seconds = 60.0 if cause == Cause.DRAIN else 600.0
        book.apply(Interrupted(row))
    return book.status


def test_the_timeline_keeps_the_newest_and_counts_every_one() -> None:
    run = recorded(HOURS)
    assert len(run.interruptions) == INTERRUPTIONS_KEPT
    assert run.interruptions[-1].at == at(hours=HOURS - 0.5), "the newest stay"
    assert run.interruption_count() == HOURS
    assert run.interruptions_by_cause() == {"crash": crashes(HOURS), "drain": HOURS - crashes(HOURS)}
    assert run.earlier_interruptions.failures == crashes(HOURS - INTERRUPTIONS_KEPT)


def test_the_whole_run_ledger_still_counts_what_left_the_timeline() -> None:
    run = recorded(HOURS)
    book = ledger(run, at(hours=HOURS))
    failed, folded = crashes(HOURS), HOURS - INTERRUPTIONS_KEPT
    assert book.lost == pytest.approx(failed * 100 * STEP_S)
    assert book.recovery == pytest.approx(failed * 600.0 + (HOURS - failed) * 60.0)
    assert run.earlier_interruptions.planned_recovery_seconds == pytest.approx(60.0 * (folded - crashes(folded)))


@pytest.mark.parametrize("length", [INTERRUPTIONS_KEPT, HOURS], ids=["all kept", "most folded"])
def test_the_mtbf_counts_every_failure(length: int) -> None:
    run = recorded(length)
    assert run_mtbf(run, at(hours=length)) == pytest.approx((6 * 3600.0 + length * 3600.0) / (1 + crashes(length)))
