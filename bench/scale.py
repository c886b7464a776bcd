"""What a run costs Temporal at the width it is for: the real RunWorkflow and FleetWorkflow, with the
real fleet and paging activities and simulated nodes (sim/), on `temporal server start-dev`, through
every kind of interruption (sim/scenario.py) at 16, 128 and (without --quick) 2,048 nodes × 8 ranks.

Per width: history events and bytes per interruption, counted over every execution it touches (the
run's chain and the fleet's) from the moment it happened until the run checkpoints normally again;
the largest payload in any history; the most activities one execution had pending; the time from a
failure's report to the next launch; the longest workflow task; and this process's CPU per
interruption (the supervisor's workers and the simulator together). Each width gets a fresh server
and a fleet that learns of every node at once.

    python -m bench.scale [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

from stayalive.core.run.lifecycle import RunState
from stayalive.sim import history, scenario
from stayalive.sim.scenario import Ran
from stayalive.workers.devstack import SEARCH_ATTRIBUTES, temporal_binary

BUDGET_EVENTS = 50
PAYLOAD_LIMIT = 256 * 1024
PENDING_LIMIT = 1000
DECISION_LIMIT_S = 1.0
TASK_LIMIT_S = 1.0


async def measure(nodes: int) -> dict[str, object]:
    async with await WorkflowEnvironment.start_local(
        dev_server_existing_path=str(temporal_binary()),
        data_converter=pydantic_data_converter,
        dev_server_extra_args=[arg for attribute in SEARCH_ATTRIBUTES for arg in ("--search-attribute", attribute)],
    ) as env:
        ran = await scenario.every_kind(env.client, nodes, Path(tempfile.mkdtemp(prefix="bench-scale-")))
    return figures(nodes, ran)


def figures(nodes: int, ran: Ran) -> dict[str, object]:
    executions = [*ran.run, *ran.fleet]
    events = [c.events for c in ran.costs]
    sizes = [c.bytes for c in ran.costs]
    return {
        "nodes": nodes,
        "ranks": nodes * scenario.RANKS_PER_NODE,
        "completed": ran.result.state == RunState.COMPLETED
        and [i.cause for i in ran.result.interruptions] == scenario.CAUSES,
        "interruptions": len(ran.costs),
        "events_mean": round(statistics.fmean(events), 1),
        "events_max": max(events),
        "worst": max(ran.costs, key=lambda c: c.events).what,
        "bytes_mean": round(statistics.fmean(sizes)),
        "bytes_max": max(sizes),
        "payload_max_bytes": history.largest_payload(e for execution in executions for e in execution),
        "pending_activities_max": max(history.most_pending_activities(x) for x in executions),
        "decision_s_p50": round(statistics.median(ran.relaunch_s), 3),
        "decision_s_max": round(max(ran.relaunch_s), 3),
        "workflow_task_s_max": round(max(history.longest_workflow_task(x) for x in executions), 3),
        "cpu_s_per_interruption": round(ran.cpu_s / len(ran.costs), 3),
        "register_s": round(ran.register_s, 2),
        "by_kind": {c.what: c.events for c in ran.costs},
    }


def table(rows: list[dict[str, object]]) -> Table:
    grid = Table(title="Every kind of interruption, per width (events and bytes over every execution touched)")
    columns = [
        ("nodes", "nodes"),
        ("events/int. mean", "events_mean"),
        ("max", "events_max"),
        ("KiB/int. mean", "bytes_mean"),
        ("largest payload KiB", "payload_max_bytes"),
        ("pending act. max", "pending_activities_max"),
        ("failure→launch p50 s", "decision_s_p50"),
        ("max s", "decision_s_max"),
        ("longest task s", "workflow_task_s_max"),
        ("CPU s/int.", "cpu_s_per_interruption"),
    ]
    for title, _ in columns:
        grid.add_column(title, justify="right")
    for row in rows:
        cells = []
        for _, key in columns:
            value = row[key]
            if key in ("bytes_mean", "payload_max_bytes"):
                value = f"{float(value) / 1024:.1f}"  # type: ignore[arg-type]
            cells.append(str(value))
        grid.add_row(*cells)
    return grid


def summary(rows: list[dict[str, object]]) -> dict[str, object]:
    def worst(key: str) -> float:
        return max(float(r[key]) for r in rows)  # type: ignore[arg-type]

    line: dict[str, object] = {
        "bench": "scale",
        "widths": [r["nodes"] for r in rows],
        "events_per_interruption_max": worst("events_max"),
        "events_per_interruption_mean": [r["events_mean"] for r in rows],
        "bytes_per_interruption_max": worst("bytes_max"),
        "payload_max_bytes": worst("payload_max_bytes"),
        "pending_activities_max": worst("pending_activities_max"),
        "decision_s_max": worst("decision_s_max"),
        "workflow_task_s_max": worst("workflow_task_s_max"),
        "cpu_s_per_interruption": [r["cpu_s_per_interruption"] for r in rows],
        "register_s": [r["register_s"] for r in rows],
    }
    line["bar"] = (
        all(r["completed"] for r in rows)
        and line["events_per_interruption_max"] <= BUDGET_EVENTS  # type: ignore[operator]
        and line["payload_max_bytes"] <= PAYLOAD_LIMIT  # type: ignore[operator]
        and line["pending_activities_max"] <= PENDING_LIMIT  # type: ignore[operator]
        and line["decision_s_max"] <= DECISION_LIMIT_S  # type: ignore[operator]
        and line["workflow_task_s_max"] <= TASK_LIMIT_S  # type: ignore[operator]
    )
    return line


async def main(widths: list[int]) -> None:
    console = Console()
    if not console.is_terminal:  # a log or a pipe: the whole table, not columns cut to 80
        console = Console(width=160)
    rows = []
    for nodes in widths:
        row = await measure(nodes)
        console.print(f"{nodes} nodes: {json.dumps(row)}")
        rows.append(row)
    console.print(table(rows))
    print(json.dumps(summary(rows)))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="16 and 128 nodes only (about a minute)")
    args = parser.parse_args()
    asyncio.run(main([16, 128] if args.quick else [16, 128, 2048]))
