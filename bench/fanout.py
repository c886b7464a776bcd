"""The supervisor's data plane at width: the real supervisor worker (its launch, command, release,
monitor and stack-dump activities, RunWorkflow and FleetWorkflow) on `temporal server start-dev`,
against real node agents: farms of NodeHub + NodeAgent pairs (sim/hub_farm.py), each node's ranks
emulated (sim/emulated_rank.py), at 128 and 2,048 nodes × 8 ranks stepping once a second.

One run per width, through the run spec's own fault plan: CRASHES generations each lose a rank (each
on another node, which the fleet quarantines and self-tests; a spare takes its place), then one
generation trains for a steady window and hangs in one rank's all-reduce (the culprit one collective
short). Measured:

    fan-out      from the workflow's decision to launch (the workflow task that ran the launch) to
                 every node's agent acknowledging its ranks (p50 / max over every generation)
    relaunch     from a rank's crash to every node acknowledging the next generation (p50 / max):
                 detection, the release, the decision and the fan-out
    monitor      the supervisor process's CPU over the steady window (a share of one core), its
                 memory, and how long after its newest report the monitor judged each step
                 (stayalive_monitor_judging_lag_seconds on its /metrics)
    stacks       the hang's stack dump of every rank: the dump_stacks activity's time, and its file
    rendezvous   from the decision to every rank of the generation having joined the generation's
                 store through its node's relay (and the slowest single join)

Bars (at every width): fan-out ≤ 2 s, relaunch ≤ 3 s, monitor ≤ 25% of a core with no step judged
more than 2 s after its report, stack dump ≤ 10 s, rendezvous ≤ 5 s.

    python -m bench.fanout [--quick] [--widths N ...]      # --quick: 128 nodes, 3 crashes
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import tempfile
import time
import urllib.request
from collections import defaultdict
from collections.abc import Awaitable, Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from temporalio.api.enums.v1 import EventType
from temporalio.api.history.v1 import HistoryEvent
from temporalio.service import RPCError

from stayalive.core.run.spec import RunSpec
from stayalive.sim.history import chain
from stayalive.sim.hub_farm import farm_command, farm_spec, node_name, until
from stayalive.workers.devstack import DevStack, free_port
from stayalive.workers.secret import create_secret
from stayalive.workers.temporal import connect, plain
from stayalive.workflows.run import TASK_QUEUE, RunWorkflow

E = EventType
RANKS_PER_NODE = 8
FARM_NODES = 48  # nodes per farm process
SPARES = 8
STEP_S = 1.0
CRASH_AT = 10  # the first crash's step
# Each next crash this many steps later: the same step twice reads as a bad batch (which pages a person
# and stops restarting), and an interruption's step is the last one the monitor had judged.
CRASH_SPACING = 3
BARS = {"fanout_s_max": 2.0, "relaunch_s_max": 3.0, "monitor_core_share": 0.25, "stacks_s": 10.0, "rendezvous_s": 5.0}
JUDGED_WITHIN_S = 2.0
MIN_CRASHES = 3  # --quick's; the full run has 5


def spec(nodes: int, root: Path, crashes: int, steady_steps: int) -> RunSpec:
    world = nodes * RANKS_PER_NODE

    # Each crash on another node, spread over the width; the hang's culprit elsewhere again.
    def crash(g: int) -> dict[str, Any]:
        at_step = CRASH_AT + CRASH_SPACING * g
        return {"kind": "crash", "rank": (g * 997 + 3) % world, "at_step": at_step, "generation": g}

    hang = {"kind": "collective_hang", "rank": world // 2 + 5, "at_step": steady_steps, "generation": crashes}
    return farm_spec(
        f"fanout-{nodes}",
        nodes,
        RANKS_PER_NODE,
        SPARES,
        STEP_S,
        target_step=1_000_000,
        checkpoint={"root": str(root / "checkpoints"), "interval": "1000000 steps"},
        faults=[*map(crash, range(crashes)), hang],
        health={"step_timeout": "10s"},
    )


def cpu_seconds(pid: int) -> float:
    """The process's user and system CPU so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100.0  # utime, stime in clock ticks (USER_HZ = 100)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return math.nan


def launch_decisions(segments: list[list[HistoryEvent]]) -> list[float]:
    """When the workflow decided each launch: the launch local activity's first schedule, which its
    marker keeps (the marker itself is recorded only once the activity is done, and a long one spans
    several workflow tasks)."""
    decided = []
    for events in segments:
        for event in events:
            if event.event_type != E.EVENT_TYPE_MARKER_RECORDED:
                continue
            data = event.marker_recorded_event_attributes.details.get("data")
            marker = json.loads(data.payloads[0].data) if data is not None and data.payloads else {}
            if marker.get("activity_type") == "launch":
                decided.append(timestamp(marker["original_schedule_time"]))
    return decided


def timestamp(value: str | dict[str, int]) -> float:
    """A protobuf Timestamp as the marker's JSON has it: RFC 3339, or seconds and nanos."""
    if isinstance(value, str):
        return datetime.fromisoformat(value).timestamp()
    return value.get("seconds", 0) + value.get("nanos", 0) / 1e9


def stack_dump_s(segments: list[list[HistoryEvent]]) -> float:
    """The dump_stacks activity's time, from its start to its completion."""
    started: dict[int, float] = {}
    names: dict[int, str] = {}
    for events in segments:
        for event in events:
            at = event.event_time.ToDatetime().timestamp()
            if event.event_type == E.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
                names[event.event_id] = event.activity_task_scheduled_event_attributes.activity_type.name
            elif event.event_type == E.EVENT_TYPE_ACTIVITY_TASK_STARTED:
                started[event.activity_task_started_event_attributes.scheduled_event_id] = at
            elif event.event_type == E.EVENT_TYPE_ACTIVITY_TASK_COMPLETED:
                scheduled = event.activity_task_completed_event_attributes.scheduled_event_id
                if names.get(scheduled) == "dump_stacks":
                    return at - started[scheduled]
    raise RuntimeError("bench.fanout: the run never dumped its stacks")


def judging(metrics_url: str, workflow_id: str) -> dict[str, float]:
    """From the supervisor's histogram: steps judged, and how many more than JUDGED_WITHIN_S late."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    buckets: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "stayalive_monitor_judging_lag_seconds":
            for sample in family.samples:
                if sample.name.endswith("_bucket") and sample.labels.get("run_id") == workflow_id:
                    buckets[float(sample.labels["le"])] = sample.value
    judged = buckets.get(math.inf, 0.0)
    within = max((count for bound, count in buckets.items() if bound <= JUDGED_WITHIN_S), default=0.0)
    all_within = min((bound for bound, count in buckets.items() if count == judged), default=math.inf)
    return {"steps_judged": judged, "judged_late": judged - within, "judged_within_s": all_within}


def read_events(paths: list[Path]) -> dict[str, list[dict[str, float]]]:
    kinds: dict[str, list[dict[str, float]]] = defaultdict(list)
    for path in paths:
        for line in path.read_text().splitlines():
            event = json.loads(line)
            kinds[event.pop("event")].append(event)
    return kinds


async def measure(nodes: int, crashes: int, steady_s: float) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix=f"bench-fanout-{nodes}-"))
    total = nodes + SPARES
    stack = DevStack(
        state_dir=root,
        nodes=[node_name(i) for i in range(total)],
        ui_port=None,
        port=free_port(),
        metrics_port=free_port(),
    )
    farms = math.ceil(total / FARM_NODES)
    per_farm = math.ceil(total / farms)
    event_files = [root / f"farm-{f}.jsonl" for f in range(farms)]
    # The hang comes once the steady window is over: the steps before it, and a few to settle in.
    steady_steps = math.ceil(steady_s / STEP_S) + 8
    try:
        create_secret(stack.secret_file)
        stack.start_temporal()
        stack.start_supervisor()
        for f, events in enumerate(event_files):
            first = f * per_farm
            stack.spawn(f"farm-{f}", farm_command(stack, first, min(per_farm, total - first), nodes, events))
        registering = time.monotonic()
        await stack.ready(timeout=600)
        register_s = time.monotonic() - registering
        client = await connect(plain(stack.address))
        workflow_id = f"fanout-{nodes}-{int(time.time())}"
        run = spec(nodes, root, crashes, steady_steps)
        handle = await client.start_workflow(RunWorkflow.run, run, id=workflow_id, task_queue=TASK_QUEUE)

        def generation_from(least: int) -> Callable[[], Awaitable[bool]]:
            async def reached() -> bool:
                try:
                    return (await handle.query(RunWorkflow.status_query)).generation >= least
                except RPCError:  # "Workflow is busy": a launch at 2,048 nodes holds its task; look again
                    return False

            return reached

        await until(generation_from(crashes), 60 + crashes * 60, f"generation {crashes}")
        await asyncio.sleep(6 * STEP_S)  # its ranks join, and step a few
        supervisor = stack.processes["supervisor"].pid
        cpu, began = cpu_seconds(supervisor), time.monotonic()
        await asyncio.sleep(steady_s)
        core_share = (cpu_seconds(supervisor) - cpu) / (time.monotonic() - began)
        memory = rss_mib(supervisor)
        await until(generation_from(crashes + 1), 120, "the hang's relaunch")
        await asyncio.sleep(3.0)  # the relaunch's acknowledgements reach the farms' files
        lag = judging(stack.metrics_url, workflow_id)
        await handle.terminate("bench.fanout: measured")
        segments = await chain(client, workflow_id)
        artifacts = list((root / "checkpoints").rglob("hang-*.txt"))
    finally:
        stack.stop()
    return figures(nodes, read_events(event_files), segments) | {
        "register_s": round(register_s, 1),
        "monitor_core_share": round(core_share, 3),
        "supervisor_rss_mib": round(memory),
        **lag,
        "stacks_bytes": sum(a.stat().st_size for a in artifacts),
    }


def figures(
    nodes: int, events: dict[str, list[dict[str, float]]], segments: list[list[HistoryEvent]]
) -> dict[str, Any]:
    decided = launch_decisions(segments)
    acked: dict[int, list[float]] = defaultdict(list)
    for ack in events["acknowledged"]:
        acked[int(ack["generation"])].append(ack["at"])
    joined: dict[int, list[dict[str, float]]] = defaultdict(list)
    for join in events["joined"]:
        joined[int(join["generation"])].append(join)
    launched = [g for g in sorted(acked) if g < len(decided)]
    fanout = [max(acked[g]) - decided[g] for g in launched]
    # The supervisor's part of it: from the decision to the first StartRanks reaching a node.
    first_asked = [
        min(a["asked"] for a in events["acknowledged"] if a["generation"] == g) - decided[g] for g in launched
    ]
    crashed = {int(c["generation"]): c["at"] for c in events["crashed"]}
    relaunch = [max(acked[g + 1]) - at for g, at in sorted(crashed.items()) if g + 1 in acked]
    complete = [g for g in launched if len(joined[g]) == nodes * RANKS_PER_NODE]
    rendezvous = [max(j["at"] for j in joined[g]) - decided[g] for g in complete]
    return {
        "nodes": nodes,
        "ranks": nodes * RANKS_PER_NODE,
        "generations": len(launched),
        "every_node_acknowledged": all(len(acked[g]) == nodes for g in launched),
        "fanout_s_p50": round(statistics.median(fanout), 3),
        "fanout_s_max": round(max(fanout), 3),
        "fanout_s": [round(f, 2) for f in fanout],
        "first_start_asked_s": [round(f, 2) for f in first_asked],
        "crashes": len(relaunch),
        "relaunch_s_p50": round(statistics.median(relaunch), 3) if relaunch else None,
        "relaunch_s_max": round(max(relaunch), 3) if relaunch else None,
        "stacks_s": round(stack_dump_s(segments), 3),
        "rendezvous_s": round(max(rendezvous), 3) if rendezvous else None,
        "join_s_max": round(max(j["took"] for js in joined.values() for j in js), 3),
    }


def passed(row: dict[str, Any]) -> bool:
    within = all(row[key] is not None and row[key] <= bar for key, bar in BARS.items())
    return within and row["every_node_acknowledged"] and row["judged_late"] == 0 and row["crashes"] >= MIN_CRASHES


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.fanout", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="128 nodes and 3 crashes only (about two minutes)")
    parser.add_argument("--widths", type=int, nargs="+", help="node counts to run (default: 128 and 2,048)")
    args = parser.parse_args()
    widths = args.widths or ([128] if args.quick else [128, 2048])
    rows: list[dict[str, Any]] = []
    for nodes in widths:
        row = asyncio.run(
            measure(nodes, crashes=MIN_CRASHES if args.quick else 5, steady_s=15.0 if args.quick else 40.0)
        )
        print(json.dumps(row), flush=True)
        rows.append(row)
    summary = {
        "bench": "fanout",
        "widths": widths,
        **{f"{k}@{r['nodes']}": r[k] for r in rows for k in (*BARS, "judged_late")},
    }
    print(json.dumps(summary | {"bar": all(passed(r) for r in rows)}))


if __name__ == "__main__":
    main()
