"""What the `stayalive` CLI shows a person: live progress, the interruption timeline, the goodput.

Everything here reads Temporal, the way any other client would: the run's queries, and the run
monitor's heartbeat (the live summary) from the workflow's pending activities.

Output that is not a terminal (a CI log, `stayalive demo > demo.log`, `| tee`) must read whole: rich
would lay it out at 80 columns and cut cells to `restor…`, and would show a live display only once,
at its end. So such a console is LOG_WIDTH wide, every column folds rather than elides, and the live
view becomes plain lines.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from contextlib import nullcontext
from datetime import UTC, datetime
from typing import Any

from pydantic import TypeAdapter
from rich.console import Console, Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowHandle

from stayalive.core.fleet.model import EccTrend, FleetNode, Quarantine
from stayalive.core.run.status import CheckpointRecord, Ledger, Progress, RunResult, RunStatus
from stayalive.core.run.timeline import Interruption
from stayalive.workflows.run import RunWorkflow

LOG_WIDTH = 200  # every table's usual rows fit on one line; a longer cell (a reason, a detail) folds
LOG_EVERY = 10.0  # seconds between progress lines in a log: a line per poll would drown it


def make_console(**kwargs: Any) -> Console:
    """A terminal keeps its own width; anything else gets COLUMNS when set (rich reads it), else
    LOG_WIDTH instead of rich's 80."""
    made = Console(**kwargs)
    if not made.is_terminal and not os.environ.get("COLUMNS", "").isdigit():
        made.width = LOG_WIDTH
    return made


console = make_console()
errors = make_console(stderr=True)  # the live view while stdout carries JSON (--json)


def dump_json(value: object) -> str:
    """`--json`: the same data as the tables, as pydantic serialises it (models, lists, dicts of them)."""
    return TypeAdapter(Any).dump_json(value, indent=2).decode()


def _columns(table: Table, *names: str, right: tuple[str, ...] = ()) -> Table:
    """Columns that fold instead of eliding with "…". None is no_wrap: rich sizes those to their
    full width first and squeezes the others to nothing on a narrow terminal."""
    for name in names:
        table.add_column(name, overflow="fold", justify="right" if name in right else "left")
    return table


async def live_progress(client: Client, handle: WorkflowHandle) -> Progress | None:
    """The run monitor's latest heartbeat: step, loss and rates as of a second ago."""
    description = await handle.describe()
    for activity in description.raw_description.pending_activities:
        if activity.activity_type.name == "monitor_run" and activity.heartbeat_details.payloads:
            details = (await client.data_converter.decode(activity.heartbeat_details.payloads))[0]
            if isinstance(details, dict) and "progress" in details:
                return Progress.model_validate(details["progress"])
    return None


def _step_line(progress: Progress, target: int) -> str:
    if not progress.at:
        return f"step {progress.step:>6}/{target}   (no step measured yet)"
    return (
        f"step {progress.step:>6}/{target}   loss {progress.loss if progress.loss is not None else float('nan'):6.3f}"
        f"   {progress.steps_per_second:5.2f} steps/s   step p50 {progress.step_seconds_p50 * 1000:6.1f} ms"
    )


def _panel(status: RunStatus, progress: Progress, elapsed: float) -> Group:
    target = status.spec.target_step or 0
    header = Text.assemble(
        (f"{status.run_id}  ", "bold"),
        (status.state.value, "bold cyan"),
        f"  generation {status.generation}  ·  {elapsed:,.0f}s",
    )
    line = Text(_step_line(progress, target))
    checkpoints = status.checkpoints[-4:]
    kept = "  ".join(f"{c.step}{' ✓' if c.validated else (' …' if c.validated is None else ' ✗')}" for c in checkpoints)
    footer = Text(f"checkpoints {kept or '-'}   interruptions {status.interruption_count()}")
    for interruption in status.interruptions[-3:]:
        footer.append(f"\n  ⚠ {interruption.line()}", style="yellow")
    bar = (
        ProgressBar(total=target, completed=progress.step, width=60)
        if target
        else Text("(plain script: no step telemetry)")
    )
    return Group(header, bar, line, footer)


class LogLines:
    """The live view for a log: a plain line when the state or generation changes, one per new
    interruption, and the progress every LOG_EVERY seconds; nothing is ever redrawn."""

    def __init__(self, out: Console, every: float = LOG_EVERY) -> None:
        self.out, self.every = out, every
        self.printed_at = -math.inf
        self.seen = 0  # interruptions already printed (counting those no longer listed)
        self.phase: tuple[str, int] | None = None

    def update(self, status: RunStatus, progress: Progress, elapsed: float) -> None:
        new = status.interruption_count() - self.seen
        for interruption in status.interruptions[len(status.interruptions) - min(new, len(status.interruptions)) :]:
            self.out.print(f"⚠ {interruption.line()}", style="yellow", soft_wrap=True)
        self.seen += max(new, 0)
        phase = (status.state.value, status.generation)
        if phase == self.phase and elapsed - self.printed_at < self.every:
            return
        self.phase, self.printed_at = phase, elapsed
        target = status.spec.target_step or 0
        line = _step_line(progress, target) if target else "(plain script: no step telemetry)"
        self.out.print(
            f"{elapsed:6,.0f}s  {status.run_id}  {phase[0]}  generation {phase[1]}  {line}",
            soft_wrap=True,
            highlight=False,
        )


async def follow(client: Client, handle: WorkflowHandle, poll: float = 0.5, out: Console | None = None) -> RunResult:
    """Show the run live until it closes (redrawn in a terminal, plain lines in a log); return its result."""
    out = out or console
    started = time.monotonic()
    result = asyncio.ensure_future(handle.result())
    lines = None if out.is_terminal and not out.is_dumb_terminal else LogLines(out)
    with Live(console=out, refresh_per_second=4, transient=False) if lines is None else nullcontext() as live:
        while not result.done():
            try:
                status = await handle.query(RunWorkflow.status_query)
                measured = await live_progress(client, handle)
                # A new generation's monitor has measured nothing yet: show where the run stands.
                progress = measured if measured is not None and measured.at else status.progress
                if lines is not None:
                    lines.update(status, progress, time.monotonic() - started)
                elif live is not None:
                    live.update(_panel(status, progress, time.monotonic() - started))
            except Exception:  # the run may be between workflow tasks, or the server restarting
                pass
            await asyncio.wait([result], timeout=poll)
    return result.result()


def timeline_table(interruptions: list[Interruption]) -> Table:
    table = Table(title="Interruption timeline", title_justify="left")
    _columns(table, "at", "cause", "node", "rank", "step", "resumed from", "lost steps", "restart s", "restored from")
    for i in interruptions:
        table.add_row(
            i.at.strftime("%H:%M:%S"),
            i.cause.value,
            i.node or "-",
            "-" if i.rank is None else str(i.rank),
            "-" if i.step is None else str(i.step),
            "-" if i.resumed_from is None else str(i.resumed_from),
            "-" if i.lost_steps is None else str(i.lost_steps),
            "-" if i.restart_seconds is None else f"{i.restart_seconds:.1f}",
            i.restored_from or "-",
        )
    return table


def ledger_table(book: Ledger) -> Table:
    table = Table(title=f"Goodput {book.goodput:.1%} of {book.wall:,.0f}s wall-clock", title_justify="left")
    _columns(table, "where the time went", "seconds", "share", right=("seconds", "share"))
    rows = {
        "productive training": book.productive,
        "start-up to first step": book.startup,
        "checkpoint (blocking)": book.checkpoint,
        "lost work (recomputed)": book.lost,
        "recovery (failure to first step)": book.recovery,
        "straggler (slower than ideal steps)": book.straggler,
        "idle (waiting for a person or nodes)": book.idle,
    }
    for name, seconds in rows.items():
        table.add_row(name, f"{seconds:,.1f}", f"{seconds / book.wall:.1%}" if book.wall else "-")
    return table


async def ui_url(handle: WorkflowHandle, ui: str | None) -> str | None:
    if ui is None:
        return None
    description = await handle.describe()
    if description.status == WorkflowExecutionStatus.RUNNING or description.run_id is None:
        return f"{ui}/namespaces/default/workflows/{handle.id}"
    return f"{ui}/namespaces/default/workflows/{handle.id}/{description.run_id}/history"


def checkpoints_table(records: list[CheckpointRecord]) -> Table:
    table = Table(title="Checkpoints (kept, and the newest refused)", title_justify="left")
    _columns(table, "step", "generation", "blocking s", "validated", "SDC", "why")
    for c in records:
        # not "…": in a table that reads as a cut cell
        verdict = "pending" if c.validated is None else ("yes" if c.validated else "no")
        checked = f"unverified (checked to {c.last_verified_step})"
        sdc = "suspect" if c.suspect else ("verified" if c.verified else checked)
        table.add_row(
            str(c.step),
            str(c.generation),
            f"{c.blocking_seconds:.3f}",
            verdict,
            sdc,
            c.reason,
        )
    return table


def _day_time(unix_s: int) -> str:
    return datetime.fromtimestamp(unix_s, UTC).strftime("%m-%d %H:%M")


def fleet_table(nodes: list[FleetNode], quarantines: list[Quarantine], trends: list[EccTrend]) -> Group:
    table = Table(title="Fleet", title_justify="left")
    _columns(table, "node", "rack", "hub", "state", "run", "since")
    for n in nodes:
        table.add_row(n.id, n.rack, n.hub, n.state.value, n.run_id or "-", n.since.strftime("%H:%M:%S"))
    records = Table(title="Quarantine records", title_justify="left")
    _columns(records, "node", "reason", "since", "runs affected", "last self-test", "released")
    for q in quarantines:
        test = q.self_tests[-1] if q.self_tests else None
        earlier = f" (+{q.earlier_runs} earlier)" if q.earlier_runs else ""
        records.add_row(
            q.node,
            q.reason,
            q.since.strftime("%H:%M:%S"),
            ", ".join(q.run_ids_affected) + earlier,
            "-" if test is None else ("passed" if test.passed else f"failed: {test.detail}"),
            q.released_at.strftime("%H:%M:%S") if q.released_at else "no",
        )
    if not trends:
        return Group(table, records)
    ecc = Table(title="Corrected ECC errors (NVML, since each driver loaded)", title_justify="left")
    _columns(ecc, "node", "errors", "per day", "first read", "last read")
    for t in trends:
        first, last = _day_time(t.points[0][0]), _day_time(t.points[-1][0])
        ecc.add_row(t.node, str(t.corrected), f"{t.per_day():.1f}", first, last)
    return Group(table, records, ecc)
