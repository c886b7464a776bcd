"""The goodput ledger: every second of wall-clock in one category, overlaps counted once, any window
of the run, and agreement with the overhead equation (docs/architecture.md §14) on a simulated year."""

from __future__ import annotations

import random
from datetime import datetime, timedelta

import numpy as np
import pytest

from stayalive.core.book.findings import Interrupted, Observed
from stayalive.core.book.runbook import RunBook
from stayalive.core.decisions.goodput import ledger, recent_goodput, straggler_wait
from stayalive.core.decisions.interval import overhead, young
from stayalive.core.decisions.paging import classify
from stayalive.core.decisions.recovery import interruption_from
from stayalive.core.messages.events import FirstStep, NodeLost
from stayalive.core.run.lifecycle import RunState
from stayalive.core.run.status import CheckpointRecord, Ledger, Progress, RunStatus
from stayalive.core.run.timeline import Cause, Interruption, PagingClass
from tests.core.runs import T0, at, checkpoint, interruption, status

STEP_S = 2.0


def run(**fields: object) -> RunStatus:
    fields.setdefault("progress", Progress(step_seconds_p50=STEP_S))
    fields.setdefault("first_step_at", at(minutes=5))
    return status(**fields)


def costs(book: Ledger) -> list[float]:
    return [book.startup, book.checkpoint, book.lost, book.recovery, book.idle, book.straggler]


def assert_partition(book: Ledger) -> None:
    assert all(c >= 0 for c in costs(book)), book
    assert book.productive + sum(costs(book)) == pytest.approx(book.wall, rel=0.01), book


def test_a_run_that_has_not_started_has_an_empty_ledger() -> None:
    book = ledger(status(started_at=None), at(hours=1))
    assert book.wall == 0 and book.goodput == 0


def test_one_crash() -> None:
    """5 min startup; a checkpoint (30 s blocking) at 1 h; a crash at 3 h losing 200 steps (400 s)
    and restarting in 600 s; read at 6 h."""
    book = ledger(
        run(
            checkpoints=[checkpoint(at(hours=1), 30.0)],
            interruptions=[interruption(at(hours=3), lost_steps=200, restart_seconds=600.0)],
        ),
        at(hours=6),
    )
    assert (book.wall, book.startup, book.checkpoint, book.lost, book.recovery, book.idle) == (
        21600.0, 300.0, 30.0, 400.0, 600.0, 0.0,
    )  # fmt: skip
    assert book.productive == 21600 - 1330
    assert book.goodput == pytest.approx(20270 / 21600)


# -- overlaps: a second claimed twice is counted once --------------------------------------------------


def test_a_crash_before_the_first_step_is_recovery_not_also_startup() -> None:
    """Generation 0 died while starting (at 3 min); generation 1's first step came at 15 min. The
    old ledger counted the 11 minutes of restart twice: in startup (start → first step) and recovery."""
    book = ledger(
        run(first_step_at=at(minutes=15), interruptions=[interruption(at(minutes=3), restart_seconds=660.0)]),
        at(hours=1),
    )
    assert (book.startup, book.recovery) == (180.0 + 60.0, 660.0)
    assert_partition(book)


def test_a_pause_is_idle_then_recovery_and_its_hold_checkpoint_counts_once() -> None:
    """Paused at 2 h for an hour (the hold's checkpoint blocked inside it), then 120 s to resume."""
    pause = interruption(at(hours=2), Cause.PAUSE, idle_seconds=3600.0, restart_seconds=120.0, lost_steps=0)
    book = ledger(run(interruptions=[pause], checkpoints=[checkpoint(at(hours=2, seconds=40), 30.0)]), at(hours=4))
    assert (book.idle, book.recovery, book.checkpoint) == (3600.0, 120.0, 0.0)
    assert_partition(book)


def test_lost_work_reaching_back_over_an_earlier_restart_counts_only_the_running_time() -> None:
    """The second crash rolls back 400 steps (800 s at p50), but the run had only restarted 300 s
    before it: the 500 s before that were the first restart's, already recovery."""
    first = interruption(at(hours=1), restart_seconds=600.0, lost_steps=0)
    second = interruption(at(hours=1, seconds=900), node="n2", restart_seconds=600.0, lost_steps=400)
    book = ledger(run(interruptions=[first, second]), at(hours=2))
    assert (book.lost, book.recovery) == (300.0, 1200.0)
    assert_partition(book)


def test_a_restart_under_way_runs_to_now_and_a_stopped_run_waits_idle() -> None:
    crashed = interruption(at(hours=1), lost_steps=0)  # no first step since: restart_seconds is None
    book = ledger(run(interruptions=[crashed]), at(hours=1, minutes=10))
    assert (book.recovery, book.idle) == (600.0, 0.0)
    stopped = ledger(run(interruptions=[crashed], state=RunState.STOPPED), at(hours=3))
    assert (stopped.recovery, stopped.idle) == (0.0, 7200.0)
    # A failure during a restart ends the first restart's span where the second one begins.
    again = interruption(at(hours=1, minutes=4), node="n2", restart_seconds=300.0, lost_steps=0)
    twice = ledger(run(interruptions=[crashed, again]), at(hours=2))
    assert twice.recovery == 240.0 + 300.0


def test_a_finished_run_stops_its_clock() -> None:
    done = run(finished_at=at(hours=5))
    assert ledger(done, at(hours=9)).wall == 5 * 3600


# -- windows ----------------------------------------------------------------------------------------


def test_a_window_clips_every_span() -> None:
    """Read at 10 h over the last hour: the crash at 8 h is outside, the one at 9 h 05 min has 400 s
    of lost work (half of it before 9 h) and a 600 s restart; the checkpoint at 9 h 30 min is in."""
    early = interruption(at(hours=8), lost_steps=100, restart_seconds=600.0)
    late = interruption(at(hours=9, minutes=5), node="n2", lost_steps=300, restart_seconds=600.0)
    status_ = run(interruptions=[early, late], checkpoints=[checkpoint(at(hours=9, minutes=30), 30.0)])
    book = ledger(status_, at(hours=10), since=at(hours=9))
    assert (book.wall, book.startup, book.lost, book.recovery, book.checkpoint) == (3600.0, 0.0, 300.0, 600.0, 30.0)
    whole = ledger(status_, at(hours=10))
    assert (whole.lost, whole.recovery) == (200.0 + 600.0, 1200.0)


def test_a_window_before_the_start_is_the_whole_run_and_one_after_the_end_is_empty() -> None:
    status_ = run(interruptions=[interruption(at(hours=1), lost_steps=10, restart_seconds=60.0)])
    assert ledger(status_, at(hours=2), since=T0 - timedelta(days=1)) == ledger(status_, at(hours=2))
    assert ledger(status_, at(hours=2), since=at(hours=3)).wall == 0


def test_straggler_seconds_come_from_the_status_and_a_window_gets_its_share_of_them() -> None:
    """600 s lost to a straggler over 10 h. The run's running time is 36,000 − 300 (startup) − 600
    (a restart) = 35,100 s, of which the last hour holds 3,000: the window gets that share."""
    crash = interruption(at(hours=9, minutes=30), lost_steps=0, restart_seconds=600.0)
    status_ = run(interruptions=[crash], straggler_seconds=600.0)
    assert ledger(status_, at(hours=10)).straggler == 600.0
    window = ledger(status_, at(hours=10), since=at(hours=9))
    assert window.straggler == pytest.approx(600.0 * 3000 / 35100)
    assert_partition(window)
    assert ledger(run(), at(hours=1)).straggler == 0.0


# -- the paging rule's goodput -------------------------------------------------------------------------


def test_recent_goodput_is_none_in_the_first_hour() -> None:
    assert recent_goodput(run(), at(minutes=59)) is None
    assert recent_goodput(run(), at(minutes=61)) == pytest.approx(56 / 60)  # minutes 1-5 were startup


def test_three_long_restarts_in_an_hour_page_as_a_goodput_collapse() -> None:
    """Each crash takes 15 min to restart: 45 of the last 60 minutes recovering, goodput 25%."""
    crashes = [
        interruption(at(hours=5, minutes=m), node=f"n{m}", step=1000 + m, lost_steps=0, restart_seconds=900.0)
        for m in (0, 18, 36)
    ]
    now = at(hours=5, minutes=60)
    goodput = recent_goodput(run(interruptions=crashes), now)
    assert goodput == pytest.approx(0.25)
    latest = crashes[-1]
    verdict = classify(crashes[:-1], latest, baseline_mtbf_s=0.5 * 3600, goodput_last_hour=goodput)
    assert (verdict.paging, verdict.rule) == (PagingClass.CORRELATED, "goodput collapse")


# -- simulated runs ----------------------------------------------------------------------------------------


def simulated_run(
    c: float, t: float, m: float, r: float, seed: int, pauses: float = 0.05, days: float = 30.0
) -> tuple[RunStatus, datetime]:
    """`days` of a run checkpointing after every `t` seconds of work (blocking `c`), failing at
    exponential intervals of mean `m` of wall-clock, restarting in `r` ± 20% and losing the work since
    its last checkpoint; a share `pauses` of the interruptions are pauses of up to an hour instead."""
    rng = random.Random(seed)
    end = days * 24 * 3600.0
    startup = 300.0
    checkpoints: list[CheckpointRecord] = []
    interruptions: list[Interruption] = []
    clock, next_failure = startup, rng.expovariate(1 / m)
    while clock < end:
        while next_failure >= clock + t + c and clock + t + c <= end:  # work, checkpoint, ...
            clock += t + c
            checkpoints.append(checkpoint(at(clock), c))
        if next_failure >= end:
            break
        lost = max(0.0, next_failure - clock)  # since the last checkpoint (or the restart)
        paused = rng.random() < pauses
        idle = rng.uniform(0, 3600) if paused else 0.0
        restart = r * rng.uniform(0.8, 1.2)
        interruptions.append(
            interruption(
                at(next_failure),
                Cause.PAUSE if paused else Cause.CRASH,
                node=f"n{len(interruptions)}",
                lost_steps=round(lost / STEP_S),
                idle_seconds=idle,
                restart_seconds=restart,
            )
        )
        clock = next_failure + idle + restart
        next_failure = clock + rng.expovariate(1 / m)
    return run(first_step_at=at(startup), checkpoints=checkpoints, interruptions=interruptions), at(end)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_simulated_month_partitions_wall_clock(seed: int) -> None:
    simulated, now = simulated_run(30.0, 817.0, 11135.0, 600.0, seed)
    assert len(simulated.interruptions) > 150
    month = simulated.model_copy(update={"straggler_seconds": 0.05 * 30 * 24 * 3600})
    assert_partition(ledger(month, now))
    for day in range(30):
        assert_partition(ledger(month, now, since=now - timedelta(days=day + 1)))


def test_a_simulated_year_agrees_with_the_overhead_equation() -> None:
    """The reference table (docs/architecture.md §14): C = 30 s, T = T* = 13.6 min, M = 3.1 h, R = 600 s gives 12.73%
    overhead. A simulated year's ledger (a year, so ~2,700 failures average out) lands within 1.5
    points of it, a little below: the equation is first order, charging checkpoints and failures to
    all of wall-clock when they only happen while the run is running (here ~89% of it)."""
    c, m, r = 30.0, 54 * 24 * 3600 / 419, 600.0
    t = young(c, m)
    year, now = simulated_run(c, t, m, r, seed=7, pauses=0.0, days=365)
    measured, equation = 1 - ledger(year, now).goodput, overhead(c, t, m, r)
    assert equation - 0.015 < measured < equation


@pytest.mark.parametrize(
    ("compute", "step_s", "stragglers", "baseline", "expected"),
    [
        ([0.10, 0.10, 0.15, 0.10], 0.16, [2], None, 0.05),  # the barrier waited 50 ms for rank 2
        ([0.10, 0.10, 0.15, 0.10], 0.16, [], None, 0.0),  # nobody known slow: noise is not a loss
        ([0.10, 0.10, 0.09, 0.10], 0.11, [2], None, 0.0),  # the known straggler recovered
        ([0.13, 0.13, 0.13, 0.13], 0.14, [], 0.10, 0.04),  # a known slowdown: 40 ms over the baseline
        ([0.10, 0.10, 0.20, 0.10], 0.21, [2], 0.18, 0.10),  # both: the larger, they overlap
        ([0.10, float("nan"), 0.10, 0.10], 0.11, [1], None, 0.0),  # the straggler's report is missing
    ],
)
def test_straggler_wait_is_actual_against_ideal_step_time(
    compute: list[float], step_s: float, stragglers: list[int], baseline: float | None, expected: float
) -> None:
    assert straggler_wait(np.array(compute), step_s, stragglers, baseline) == pytest.approx(expected)


def test_a_lost_node_costs_its_work_since_the_checkpoint_and_its_silence() -> None:
    """A node dies right after step 1,450 (2 s a step, checkpoint at 1,000); its agent's silence gives
    it away 15 s later; the next generation loads step 1,000 and steps 60 s after the death. Lost: 450
    steps (900 s). Recovery: the 15 s of silence and the restart after it, 60 s in all."""
    status = run(first_step_at=at(minutes=5))
    status.progress.step_seconds_p50 = 2.0
    died = at(hours=3)
    last = Progress(step=1450, at=died.timestamp(), step_seconds_p50=2.0)
    lost = interruption_from(NodeLost(node="n2", detail="silent", progress=last), status, died + timedelta(seconds=15))
    assert (lost.at, lost.step, lost.detected_after_s) == (died, 1450, 15.0)
    book = RunBook(status)
    book.apply(Interrupted(lost))
    book.resumed(1000)
    book.apply(Observed(FirstStep(step=1001, at=(died + timedelta(seconds=60)).timestamp(), progress=last)))
    assert lost.lost_steps == 450 and lost.restart_seconds == 60.0
    result = ledger(status, at(hours=4))
    assert (result.lost, result.recovery) == (900.0, 60.0)
    assert_partition(result)
