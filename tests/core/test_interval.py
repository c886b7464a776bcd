"""The checkpoint interval: the reference table (docs/architecture.md §14), Daly against the waste it approximates, and
`auto` following the run's measured failure rate."""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import datetime

import pytest

from stayalive.core.book.runbook import RunBook
from stayalive.core.decisions.interval import (
    checkpoint_seconds,
    choose_interval,
    daly,
    interval,
    mtbf,
    overhead,
    prior_mtbf,
    run_mtbf,
    young,
)
from stayalive.core.fleet.model import PUBLISHED_FAILURES_PER_GPU_HOUR, FailureRate
from stayalive.core.run.status import IntervalChoice, RunStatus
from stayalive.core.run.timeline import Cause
from tests.core.runs import at, checkpoint, interruption, spec, status

# Llama 3 405B had 419 unexpected interruptions in 54 days on 16,384 GPUs (Llama 3, arXiv:2407.21783, §3.3.4); C and R
# are the costs assumed at that scale (docs/architecture.md §16).
M = 54 * 24 * 3600 / 419  # 11,135 s = 3.09 h
C = 30.0
R = 600.0
MIN = 60.0


def argmin(f: Callable[[float], float], lo: float, hi: float) -> float:
    """Golden-section search for the minimum of a unimodal f on [lo, hi]: no formula involved."""
    ratio = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    for _ in range(200):
        c, d = b - ratio * (b - a), a + ratio * (b - a)
        a, b = (a, d) if f(c) < f(d) else (c, b)
    return (a + b) / 2


def test_the_mtbf_at_16k_gpus_is_3_1_hours() -> None:
    assert round(M / 3600, 1) == 3.1


@pytest.mark.parametrize(
    ("quantity", "expected", "places"),
    [
        pytest.param(lambda: young(C, M) / 60, 13.6, 1, id="Young T* = 13.6 min"),
        pytest.param(lambda: 100 * overhead(C, young(C, M), M, R), 12.73, 2, id="overhead at T* = 12.73%"),
        pytest.param(lambda: 100 * overhead(C, 30 * 60, M, R), 15.14, 2, id="overhead at 30 min = 15.14%"),
        pytest.param(lambda: 100 * R / M, 5.39, 2, id="restart term R/M = 5.39%"),
        pytest.param(
            lambda: 100 * (overhead(C, 30 * 60, M, R) - overhead(C, young(C, M), M, R)),
            2.4,
            1,
            id="a 2x error in T costs 2.4 points",
        ),
        pytest.param(lambda: 100 * (R - R / 2) / M, 2.7, 1, id="halving R saves 2.7 points"),
        pytest.param(lambda: daly(C, M), 797.5, 1, id="Daly T = 797.5 s"),
    ],
)
def test_seed_003_numbers(quantity: Callable[[], float], expected: float, places: int) -> None:
    assert round(quantity(), places) == expected


@pytest.mark.parametrize("t", [60.0, young(C, M), 1800.0, 7200.0])
def test_the_restart_term_does_not_move_with_the_interval(t: float) -> None:
    assert overhead(C, t, M, R) - overhead(C, t, M, 0.0) == pytest.approx(R / M)


def test_young_minimises_the_three_term_overhead() -> None:
    numeric = argmin(lambda t: overhead(C, t, M, R), 1.0, M)
    assert young(C, M) == pytest.approx(numeric, rel=1e-6)


@pytest.mark.parametrize(
    ("c", "daly_tolerance", "young_error"),
    [
        (30.0, 1e-5, 0.025),  # the assumed C: Daly within 0.001%, Young 2.5% long
        (300.0, 1e-4, 0.082),
        (3600.0, 5e-3, 0.33),  # C a third of M: Daly still within 0.5%, Young a third too long
    ],
)
def test_daly_approximates_the_minimum_of_the_exact_expected_waste(
    c: float, daly_tolerance: float, young_error: float
) -> None:
    """Daly (2006): with failures exponential at rate 1/M, each segment of τ work plus C checkpoint
    costs M·(e^((τ+C)/M) − 1) expected wall-clock, so the wall-clock per unit of work is
    (e^((τ+C)/M) − 1)/τ up to constant factors (the restart adds e^(R/M), which does not move τ).
    His interval is a series approximation of its minimiser."""
    exact = argmin(lambda tau: (math.exp((tau + c) / M) - 1) / tau, 1.0, 5 * M)
    assert daly(c, M) == pytest.approx(exact, rel=daly_tolerance)
    assert young(c, M) / exact - 1 == pytest.approx(young_error, abs=0.005)


@pytest.mark.parametrize("c", [2 * M, 3 * M])
def test_daly_is_the_mtbf_once_a_checkpoint_costs_twice_the_mtbf(c: float) -> None:
    assert daly(c, M) == M


@pytest.mark.parametrize(
    ("c", "m", "low", "high", "expected"),
    [
        (C, M, MIN, 6 * 3600, daly(C, M)),  # inside the bounds: the formula
        (0.5, 600.0, MIN, 6 * 3600, MIN),  # Daly ≈ 24 s: raised to the floor
        (600.0, 30 * 24 * 3600, MIN, 6 * 3600, 6 * 3600),  # Daly ≈ 13.5 h: capped
    ],
)
def test_interval_clamps_to_the_spec_bounds(c: float, m: float, low: float, high: float, expected: float) -> None:
    assert interval(c, m, low, high) == pytest.approx(expected)


def test_mtbf_weighs_the_prior_as_one_interruption() -> None:
    assert mtbf(0.0, 0, 6 * 3600) == 6 * 3600  # nothing observed: the prior
    assert mtbf(24 * 3600, 4, 6 * 3600) == pytest.approx(6 * 3600)  # the run agrees with the prior
    assert mtbf(24 * 3600, 8, 6 * 3600) == pytest.approx(30 * 3600 / 9)


# -- `auto`: the interval follows the run's failure rate ---------------------------------------------

DAY = 24.0  # hours every run below has been going


def run_with(failures: int, **fields: object) -> RunStatus:
    """A run 24 h old with a measured C of 30 s and `failures` crashes spread over the day."""
    crashes = [interruption(at(hours=DAY * (k + 0.5) / failures), node=f"n{k}") for k in range(failures)]
    fields.setdefault("checkpoints", [checkpoint(at(minutes=10), blocking_seconds=C)])
    return status(interruptions=crashes, **fields)


def chosen(status: RunStatus, now: datetime) -> float:
    choice = choose_interval(status, now)
    assert choice is not None
    return choice.seconds


def test_a_run_failing_twice_as_often_checkpoints_sooner_than_one_failing_half_as_often() -> None:
    now = at(hours=DAY)
    # The prior MTBF is 6 h, so 4 failures in a day is the expected rate; 8 doubles it, 2 halves it.
    doubled, expected, halved = (chosen(run_with(n), now) for n in (8, 4, 2))
    assert doubled < expected < halved
    assert doubled == pytest.approx(daly(C, 30 * 3600 / 9))  # M = (6 h + 24 h) / (1 + 8)
    assert halved == pytest.approx(daly(C, 30 * 3600 / 3))


def test_planned_interruptions_and_idle_time_do_not_move_the_interval() -> None:
    """A drain or a rollback was asked for, not suffered; a run paused for a day could not fail."""
    now = at(hours=DAY)
    expected = chosen(run_with(4), now)
    planned = run_with(4)
    planned.interruptions += [interruption(at(hours=3), Cause.DRAIN), interruption(at(hours=9), Cause.ROLLBACK)]
    assert chosen(planned, now) == pytest.approx(expected)
    paused = run_with(4)
    paused.interruptions.append(interruption(at(hours=12), Cause.PAUSE, idle_seconds=DAY * 3600))
    assert chosen(paused, at(hours=2 * DAY)) == pytest.approx(expected)


def test_interval_follows_the_spec_before_and_outside_auto() -> None:
    now = at(hours=DAY)
    first = choose_interval(run_with(4, checkpoints=[]), now)
    assert first is not None and first.seconds == MIN and "measure" in first.why  # early: it measures C
    assert checkpoint_seconds(run_with(4, checkpoints=[])) == MIN  # in force before any choice
    assert checkpoint_seconds(run_with(4, spec=spec(interval="10m"))) == 600.0
    assert choose_interval(run_with(4, spec=spec(interval="10m")), now) is None
    assert checkpoint_seconds(run_with(4, spec=spec(interval="200 steps"))) is None
    floor = choose_interval(run_with(8, spec=spec(min_interval="30m")), now)
    assert floor is not None and floor.seconds == 1800.0  # Daly says ~14 min; the spec's floor wins
    assert floor.optimum_s is not None and floor.optimum_s < 1800 and "held to min_interval" in floor.why


@pytest.mark.parametrize(
    ("in_force_by", "changes"),
    [(1.0, False), (1.04, False), (0.96, False), (1.06, True), (0.9, True), (2.0, True)],
)
def test_a_new_interval_reaches_the_ranks_only_when_it_moves_by_more_than_5_percent(
    in_force_by: float, changes: bool
) -> None:
    now = at(hours=DAY)
    run = run_with(4)
    optimum = chosen(run, now)
    run.intervals = [IntervalChoice(at=at(hours=1), seconds=optimum * in_force_by, mtbf_s=6 * 3600, why="earlier")]
    choice = choose_interval(run, now)
    assert (choice is not None) == changes
    assert checkpoint_seconds(run) == optimum * in_force_by  # what the ranks keep until a command moves it
    if choice is not None:
        assert choice.seconds == pytest.approx(optimum) and choice.cost_s == C and "Daly" in choice.why


def test_the_prior_is_the_spec_s_else_the_fleet_s_measured_one() -> None:
    fleet_s = 49.5 * 3600
    assert prior_mtbf(status(fleet_mtbf_s=fleet_s)) == fleet_s
    assert prior_mtbf(status(spec=spec(prior_mtbf="2h"), fleet_mtbf_s=fleet_s)) == 7200.0
    assert prior_mtbf(status()) == 6 * 3600  # no fleet has answered yet
    assert run_mtbf(status(fleet_mtbf_s=fleet_s), at(hours=0)) == fleet_s


def test_a_run_reports_the_gpu_hours_it_could_fail_in_once() -> None:
    """4 GPUs; paused for an hour between 2 h and 3 h: 10 h of wall-clock are 9 h of exposure."""
    run = status(nodes=["n1", "n2"])
    book = RunBook(run)
    run.interruptions.append(interruption(at(hours=2), Cause.PAUSE, idle_seconds=3600.0))
    assert book.exposure(at(hours=10)) == pytest.approx(9 * 4)
    assert book.exposure(at(hours=12)) == pytest.approx(2 * 4), "what was told is not told again"
    book.learned(FailureRate(gpu_hours=0.0, failures=0))
    assert run.fleet_mtbf_s == pytest.approx(3600 / (PUBLISHED_FAILURES_PER_GPU_HOUR * 4))
