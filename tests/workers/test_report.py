"""`stayalive report`: the four PNGs are written for a run with a history and for one without, and
the series behind them say what the run's status says."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest

from stayalive.core.decisions.goodput import ledger
from stayalive.core.run.lifecycle import RunState
from stayalive.core.run.status import DeletedCheckpoints, IntervalChoice, Progress, RunStatus, Sample
from stayalive.core.run.timeline import Cause, EarlierInterruptions
from stayalive.workers import cli
from stayalive.workers.report import (
    POINTS,
    NodeCounts,
    counts_by_cause,
    counts_by_node,
    interval_series,
    ledger_series,
    recent_goodput_series,
    time_axis,
    write_report,
)
from tests.core.runs import at, checkpoint, interruption, status

END = at(hours=4)
FILES = ["goodput.png", "interval.png", "interruptions.png", "step_time.png"]


def finished_run() -> RunStatus:
    """Four hours: startup to 5 min, three checkpoints, failures on n1 and n2, a drain, a pause."""
    return status(
        run_id="tiny/0123abcd",
        state=RunState.COMPLETED,
        first_step_at=at(minutes=5),
        finished_at=END,
        progress=Progress(step_seconds_p50=2.0),
        checkpoints=[checkpoint(at(hours=h), blocking_seconds=30.0, step=100 * h) for h in (1, 2, 3)],
        interruptions=[
            interruption(at(hours=1.5), Cause.CRASH, "n1", step=150, lost_steps=20, restart_seconds=300),
            interruption(at(hours=2.2), Cause.NODE_LOST, "n2", step=220, restart_seconds=600),
            interruption(at(hours=2.5), Cause.DRAIN, "n2", step=250, restart_seconds=120),
            interruption(at(hours=3.0), Cause.PAUSE, None, step=300, idle_seconds=600, restart_seconds=60),
            interruption(at(hours=3.3), Cause.CRASH, "n1", step=330, restart_seconds=200),
            interruption(at(hours=3.5), Cause.HANG, "n1", step=350, restart_seconds=400),
        ],
        samples=[Sample(at=at(hours=h), step=100 * h, step_seconds_p50=2.0 + 0.1 * h) for h in (1, 2, 3)],
        intervals=[
            IntervalChoice(at=at(minutes=5), seconds=3600, mtbf_s=6 * 3600, why="prior"),
            IntervalChoice(at=at(hours=1), seconds=1800, cost_s=30, mtbf_s=5 * 3600, optimum_s=1700, why="daly"),
            IntervalChoice(at=at(hours=2), seconds=600, cost_s=30, mtbf_s=2 * 3600, optimum_s=400, why="clamped"),
        ],
    )


def assert_plots(paths: list[Path], directory: Path) -> None:
    assert paths == [directory / name for name in FILES]
    for path in paths:
        data = path.read_bytes()
        assert data.startswith(b"\x89PNG"), path
        assert len(data) > 5_000, path


def test_a_finished_run_gets_four_plots(tmp_path: Path) -> None:
    directory = tmp_path / "report-tiny"
    assert_plots(write_report(finished_run(), at(hours=9), directory), directory)


@pytest.mark.parametrize("started_at", [at(), None], ids=["started 10 minutes ago", "not started"])
def test_a_run_without_history_still_gets_four_plots(tmp_path: Path, started_at: datetime | None) -> None:
    run = status(run_id="tiny/0123abcd", state=RunState.RUNNING, started_at=started_at)
    assert_plots(write_report(run, at(minutes=10), tmp_path), tmp_path)


def test_the_ledger_shares_add_up_and_end_at_the_runs_goodput() -> None:
    run = finished_run()
    hours, shares = ledger_series(run, now=at(hours=9))  # finished: `now` is not the end
    assert hours.size == POINTS and hours[-1] == pytest.approx(4.0)
    np.testing.assert_allclose(sum(shares.values()), 1.0, atol=1e-9)
    assert shares["productive"][-1] == pytest.approx(ledger(run, END).goodput, abs=1e-12)
    # Half way, the ledger is of the first two hours, not of the whole run: startup is 5 min of 2 h.
    assert hours[POINTS // 2 - 1] == pytest.approx(2.0)
    assert shares["startup"][POINTS // 2 - 1] == pytest.approx(300 / 7200)


def test_checkpoints_retention_deleted_are_spread_over_the_run() -> None:
    run = finished_run()
    run.deleted_checkpoints = DeletedCheckpoints(count=24, blocking_seconds=720.0, newest_step=290)
    _, shares = ledger_series(run, now=END)
    # At 2 h: half of the deleted ones' 720 s, and the kept checkpoints of 1 h and 2 h, 30 s each.
    assert shares["checkpoint"][POINTS // 2 - 1] == pytest.approx((360 + 60) / 7200)
    assert shares["checkpoint"][-1] == pytest.approx(ledger(run, END).checkpoint / ledger(run, END).wall)


def test_the_last_hour_goodput_starts_once_an_hour_lies_behind() -> None:
    hours, goodput = recent_goodput_series(finished_run(), now=at(hours=9))  # finished: `now` is not the end
    assert hours[0] >= 1.0 and hours[-1] == pytest.approx(4.0)
    assert goodput[-1] == pytest.approx(ledger(finished_run(), END, since=at(hours=3)).goodput)
    # At 3.5 h, the hour before it as the run stood then, not the run's last hour.
    unfinished = finished_run().model_copy(update={"finished_at": None})
    half_past_three = int(np.argmin(abs(hours - 3.5)))
    assert hours[half_past_three] == pytest.approx(3.5)
    assert goodput[half_past_three] == pytest.approx(ledger(unfinished, at(hours=3.5), since=at(hours=2.5)).goodput)


def test_the_last_hour_goodput_starts_where_the_timeline_is_whole() -> None:
    folded = finished_run().model_copy(
        update={"earlier_interruptions": EarlierInterruptions(count=3, newest_at=at(hours=2))}
    )
    hours, _ = recent_goodput_series(folded, now=END)
    assert hours.size and hours[0] > 3.0  # the hour before each lies past the folded interruptions


def test_interruptions_are_counted_by_cause_and_by_node() -> None:
    run = finished_run()
    causes = counts_by_cause(run)
    assert causes == {"crash": 2, "node_lost": 1, "drain": 1, "pause": 1, "hang": 1}
    assert next(iter(causes)) == "crash"
    assert counts_by_node(run) == [NodeCounts("n1", 3, 0), NodeCounts("n2", 1, 1), NodeCounts("—", 0, 1)]
    assert counts_by_node(run, top=1) == [NodeCounts("n1", 3, 0)]


def test_the_interval_steps_run_to_the_end_with_the_optimum_where_known() -> None:
    hours, seconds, optimum = interval_series(finished_run(), now=at(hours=9))
    np.testing.assert_allclose(hours, [5 / 60, 1.0, 2.0, 4.0])
    np.testing.assert_array_equal(seconds, [3600, 1800, 600, 600])
    np.testing.assert_array_equal(optimum, [np.nan, 1700, 400, 400])


@dataclass
class QueriedRun:
    """What `stayalive report` reads of Temporal: one workflow's status query."""

    status: RunStatus
    asked: str = ""

    def get_workflow_handle(self, workflow_id: str) -> QueriedRun:
        self.asked = workflow_id
        return self

    async def query(self, query: object) -> RunStatus:
        assert query is cli.RunWorkflow.status_query
        return self.status


def test_the_report_command_writes_into_report_id_by_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    temporal = QueriedRun(finished_run())

    async def client(args: object) -> QueriedRun:
        return temporal

    monkeypatch.setattr(cli, "_client", client)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["report", "tiny"]) == 0
    assert temporal.asked == "tiny"
    assert capsys.readouterr().out.splitlines() == [str(Path("report-tiny") / name) for name in FILES]
    assert_plots([Path("report-tiny") / name for name in FILES], Path("report-tiny"))


@pytest.mark.parametrize(
    ("length", "label", "end"),
    [
        (at(minutes=3), "minutes since start", 3.0),  # the demo
        (at(hours=10), "hours since start", 10.0),
        (at(hours=24 * 30), "days since start", 30.0),  # the month
    ],
)
def test_the_time_axis_reads_in_whole_units_of_the_runs_length(length: datetime, label: str, end: float) -> None:
    axis = time_axis(status(), length)
    assert (axis.label, axis.limits) == (label, (0.0, pytest.approx(end)))
    assert axis.of([1.5]) == pytest.approx([1.5 * axis.per_hour])
