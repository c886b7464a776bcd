"""What the `stayalive` CLI shows a person: live progress, the interruption timeline, the goodput.

Everything here reads Temporal, the way any other client would: the run's queries, and the run
monitor's heartbeat (the live summary) from the workflow's pending activities.
"""

from __future__ import annotations

import asyncio
import time

from rich.console import Console, Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowHandle

from core.fleet import FleetNode, Quarantine
from core.goodput import Ledger
from core.run import CheckpointRecord, Interruption, Progress, RunResult, RunStatus
from workflows.run import RunWorkflow

console = Console()


async def live_progress(client: Client, handle: WorkflowHandle) -> Progress | None:
    """The run monitor's latest heartbeat: step, loss and rates as of a second ago."""
    description = await handle.describe()
    for activity in description.raw_description.pending_activities:
        if activity.activity_type.name == "monitor_run" and activity.heartbeat_details.payloads:
            details = (await client.data_converter.decode(activity.heartbeat_details.payloads))[0]
            if isinstance(details, dict) and "progress" in details:
                return Progress.model_validate(details["progress"])
    return None


def _panel(status: RunStatus, progress: Progress, elapsed: float) -> Group:
    target = status.spec.target_step or 0
    header = Text.assemble(
        (f"{status.run_id}  ", "bold"),
        (status.state.value, "bold cyan"),
        f"  generation {status.generation}  ·  {elapsed:,.0f}s",
    )
    line = Text(
        f"step {progress.step:>6}/{target}   loss {progress.loss if progress.loss is not None else float('nan'):6.3f}"
        f"   {progress.steps_per_second:5.2f} steps/s   step p50 {progress.step_seconds_p50 * 1000:6.1f} ms"
    )
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


async def follow(client: Client, handle: WorkflowHandle, poll: float = 0.5) -> RunResult:
    """Show the run live until it closes; return its result."""
    started = time.monotonic()
    result = asyncio.ensure_future(handle.result())
    with Live(console=console, refresh_per_second=4, transient=False) as live:
        while not result.done():
            try:
                status = await handle.query(RunWorkflow.status_query)
                progress = await live_progress(client, handle) or status.progress
                live.update(_panel(status, progress, time.monotonic() - started))
            except Exception:  # the run may be between workflow tasks, or the server restarting
                pass
            await asyncio.wait([result], timeout=poll)
    return result.result()


def timeline_table(interruptions: list[Interruption]) -> Table:
    table = Table(title="Interruption timeline", title_justify="left")
    for column in ("at", "cause", "node", "rank", "step", "resumed from", "lost steps", "restart s", "restored from"):
        table.add_column(column)
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
    table.add_column("where the time went")
    table.add_column("seconds", justify="right")
    table.add_column("share", justify="right")
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
    for column in ("step", "generation", "blocking s", "validated", "SDC", "why"):
        table.add_column(column)
    for c in records:
        verdict = "…" if c.validated is None else ("yes" if c.validated else "no")
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


def fleet_table(nodes: list[FleetNode], quarantines: list[Quarantine]) -> Group:
    table = Table(title="Fleet", title_justify="left")
    for column in ("node", "rack", "hub", "state", "run", "since"):
        table.add_column(column)
    for n in nodes:
        table.add_row(n.id, n.rack, n.hub, n.state.value, n.run_id or "-", n.since.strftime("%H:%M:%S"))
    records = Table(title="Quarantine records", title_justify="left")
    for column in ("node", "reason", "since", "runs affected", "last self-test", "released"):
        records.add_column(column)
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
    return Group(table, records)
