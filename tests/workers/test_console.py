"""What `stayalive` prints where nobody is looking at a terminal (a CI log, `> demo.log`, `| tee`):
tables whole, never a cell cut to "…", and the live view as plain lines, not a redrawn one."""

from __future__ import annotations

import asyncio
import io
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

import pytest
from rich.console import Console

from stayalive.core.run.lifecycle import RunState
from stayalive.core.run.status import Ledger, Progress, RunResult
from stayalive.core.run.timeline import Cause
from stayalive.workers import console as ui
from tests.core.runs import checkpoint, interruption, status

AT = datetime(2026, 1, 1, 13, 16, 42, tzinfo=UTC)
CONTROL = ("…", "\r", "\x1b[")  # an elided cell; a redrawn line; cursor movement or colour


def log_console(monkeypatch: pytest.MonkeyPatch, columns: str | None = None) -> tuple[Console, io.StringIO]:
    """A console on a file, as the module makes one for a log."""
    if columns is None:
        monkeypatch.delenv("COLUMNS", raising=False)
    else:
        monkeypatch.setenv("COLUMNS", columns)
    out = io.StringIO()
    return ui.make_console(file=out), out


def timeline() -> list[Any]:
    return [
        interruption(
            AT,
            Cause.CHECKPOINT_INVALID,
            "gpu-node-0017.rack-b",
            rank=13,
            step=123456,
            resumed_from=120000,
            lost_steps=3456,
            restart_seconds=1234.5,
            restored_from="memory",
        ),
        interruption(AT, Cause.NODE_LOST, "n2", step=7, restored_from="storage"),
    ]


def test_a_log_is_wide_enough_for_the_whole_timeline(monkeypatch: pytest.MonkeyPatch) -> None:
    out, file = log_console(monkeypatch)
    assert not out.is_terminal and out.width == ui.LOG_WIDTH
    out.print(ui.timeline_table(timeline()))
    text = file.getvalue()
    assert not any(code in text for code in CONTROL), text
    for cell in ("restored from", "resumed from", "13:16:42", "checkpoint_invalid", "gpu-node-0017.rack-b"):
        assert cell in text
    row = next(line for line in text.splitlines() if "checkpoint_invalid" in line)
    for cell in ("123456", "120000", "3456", "1234.5", "memory", "13"):
        assert cell in row, f"{cell!r} not on the row's one line: {row}"


def test_a_log_is_wide_enough_for_the_whole_ledger(monkeypatch: pytest.MonkeyPatch) -> None:
    out, file = log_console(monkeypatch)
    book = Ledger(wall=123456.0, startup=600.0, checkpoint=1800.0, lost=900.0, recovery=2400.0, idle=60.0)
    out.print(ui.ledger_table(book))
    text = file.getvalue()
    assert not any(code in text for code in CONTROL), text
    lines = text.splitlines()
    for name, seconds in (
        ("idle (waiting for a person or nodes)", "60.0"),
        ("straggler (slower than ideal steps)", "0.0"),
        ("recovery (failure to first step)", "2,400.0"),
    ):
        assert any(name in line and seconds in line for line in lines), name
    assert "Goodput 95.3% of 123,456s wall-clock" in text


def test_checkpoints_say_pending_not_an_ellipsis(monkeypatch: pytest.MonkeyPatch) -> None:
    out, file = log_console(monkeypatch)
    waiting = checkpoint(AT, step=40, validated=True).model_copy(update={"validated": None, "last_verified_step": 30})
    out.print(ui.checkpoints_table([waiting]))
    text = file.getvalue()
    assert "…" not in text
    assert "pending" in text and "unverified (checked to 30)" in text


def column_text(table: str) -> list[str]:
    """Each body column's fragments joined, top to bottom: a folded cell reads whole again."""
    body = table.split("┡", 1)[1].splitlines()[1:]
    rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in body if "│" in line]
    return ["".join(column) for column in zip(*rows, strict=True)]


def test_a_narrow_log_folds_cells_instead_of_eliding_them(monkeypatch: pytest.MonkeyPatch) -> None:
    out, file = log_console(monkeypatch, columns="72")
    assert out.width == 72, "COLUMNS is the user's say"
    out.print(ui.timeline_table(timeline()))
    text = file.getvalue()
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 72
    columns = column_text(text)
    for cell in ("13:16:42", "checkpoint_invalid", "gpu-node-0017.rack-b", "123456", "1234.5", "memorystorage"):
        assert any(cell in column for column in columns), f"{cell!r} lost: {columns}"


def test_a_log_gets_plain_progress_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    out, file = log_console(monkeypatch)
    lines = ui.LogLines(out, every=10.0)
    run = status(run_id="demo-1", state=RunState.RUNNING, generation=0)
    progress = Progress(step=5, loss=3.21, steps_per_second=2.0, step_seconds_p50=0.5, at=1000.0)
    lines.update(run, progress, elapsed=1.0)
    lines.update(run, progress.model_copy(update={"step": 6}), elapsed=2.0)  # too soon: nothing
    crashed = run.model_copy(update={"generation": 1, "interruptions": timeline()[1:]})
    lines.update(crashed, progress.model_copy(update={"step": 7}), elapsed=3.0)  # a new generation: at once
    lines.update(crashed, progress.model_copy(update={"step": 30}), elapsed=13.5)  # the interval is up
    printed = file.getvalue().splitlines()
    assert not any(code in line for line in printed for code in CONTROL), printed
    assert [line.split()[0] for line in printed] == ["1s", "⚠", "3s", "14s"]
    assert "step      5/1000   loss  3.210" in printed[0] and "demo-1  RUNNING  generation 0" in printed[0]
    assert printed[1] == "⚠ node_lost on node n2 at step 7", "each interruption once"
    assert "generation 1" in printed[2] and "step     30/1000" in printed[3]


def test_follow_in_a_log_prints_lines_and_returns_the_result(monkeypatch: pytest.MonkeyPatch) -> None:
    out, file = log_console(monkeypatch)
    run = status(run_id="demo-1", state=RunState.RUNNING, progress=Progress(step=9))
    book = Ledger(wall=1.0, startup=0.0, checkpoint=0.0, lost=0.0, recovery=0.0)
    done = RunResult(run_id="demo-1", state=RunState.COMPLETED, final_step=1000, interruptions=[], ledger=book)

    async def result() -> RunResult:
        await asyncio.sleep(0.05)
        return done

    async def query(_: object) -> Any:
        return run

    async def describe() -> Any:
        return SimpleNamespace(raw_description=SimpleNamespace(pending_activities=[]))

    handle = SimpleNamespace(result=result, query=query, describe=describe)
    assert asyncio.run(ui.follow(None, handle, poll=0.01, out=out)) == done  # type: ignore[arg-type]
    text = file.getvalue()
    assert "step      9/1000" in text and not any(code in text for code in CONTROL), text


def test_a_generation_with_no_step_measured_yet_says_so_instead_of_a_nan_loss(monkeypatch: pytest.MonkeyPatch) -> None:
    out, file = log_console(monkeypatch)
    ui.LogLines(out).update(status(run_id="demo-1", state=RunState.RUNNING), Progress(step=169), elapsed=1.0)
    (line,) = file.getvalue().splitlines()
    assert "step    169/1000   (no step measured yet)" in line and "nan" not in line
