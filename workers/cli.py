"""`stayalive`: the command line. It wraps the calls the `temporal` CLI can make, and adds the live
view, the embedded development stack and the demo.

    stayalive demo                    the whole thing: dev stack, a GPT run with a crash, the timeline
    stayalive dev up | down | status  the embedded stack (Temporal + web UI, supervisor, node agents)
    stayalive check SPEC              validate a run spec, start nothing
    stayalive run SPEC [--follow]     start a run (workflow id = the spec's name unless --id)
    stayalive watch ID                live progress of a run, then its timeline
    stayalive timeline ID             the interruption timeline
    stayalive health ID               step, step times, goodput, nodes, checkpoint interval (JSON)
    stayalive checkpoints ID          every checkpoint: validated or not, and why
    stayalive report ID [--out DIR]   PNG plots: goodput, checkpoint interval, interruptions, step time
    stayalive checkpoint ID           force a checkpoint at the next agreed step
    stayalive drain ID NODE           take a node out (drain, wait, checkpoint, resize, resume)
    stayalive pause ID / resume ID    hold every rank at a step / go on
    stayalive resume-from ID STEP     roll back to a validated checkpoint
    stayalive fleet                   nodes, their states, and quarantine records
    stayalive fleet retest NODE       self-test a quarantined node again (after a repair)
    stayalive fleet quarantine NODE REASON
                                      take a node out of the pool until it passes a self-test
    stayalive slurm run SPEC          inside a Slurm allocation: an agent per node, the run, requeue-safe

--json (timeline, health, checkpoints, fleet, watch, run) prints the same data as JSON on stdout
instead of tables; watch and run --follow then show their live progress on stderr.

Temporal's address, namespace and TLS settings are the temporal CLI's, flags or environment
(--address/TEMPORAL_ADDRESS, --tls-cert-path/TEMPORAL_TLS_CLIENT_CERT_PATH, …); without an address
it talks to the dev stack.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import NoReturn

from temporalio.client import Client, WorkflowHandle, WorkflowUpdateFailedError
from temporalio.envconfig import ClientConnectConfig
from temporalio.service import RPCError

from stayalive.activities.fleet import FleetClient, FleetRefused
from stayalive.core.fleet.requests import QuarantineNode, Retest
from stayalive.core.run.lifecycle import RunState
from stayalive.core.run.spec import RunSpec
from stayalive.core.run.status import RunResult
from stayalive.workers import slurm
from stayalive.workers.console import (
    checkpoints_table,
    console,
    dump_json,
    errors,
    fleet_table,
    follow,
    ledger_table,
    timeline_table,
    ui_url,
)
from stayalive.workers.devstack import DevStack, StackError
from stayalive.workers.report import write_report
from stayalive.workers.specs import UsageError, load_spec
from stayalive.workers.temporal import add_temporal_flags, client_config, connect, plain
from stayalive.workflows.fleet import FleetWorkflow, fleet_handle
from stayalive.workflows.run import TASK_QUEUE, DrainNode, ResumeFrom, RunWorkflow

DEMO_SPEC = Path("examples/gpt-small.json")
DEMO_NODES = ["n1", "n2", "n3"]
JSON_COMMANDS = ("run", "watch", "timeline", "health", "checkpoints", "fleet")


def emit_json(value: object) -> None:
    """Plain stdout, not rich: a terminal's highlighting and wrapping would corrupt the JSON."""
    print(dump_json(value))


async def start_run(client: Client, spec: RunSpec, workflow_id: str) -> WorkflowHandle:
    try:
        return await client.start_workflow(RunWorkflow.run, spec, id=workflow_id, task_queue=TASK_QUEUE)
    except RPCError as exc:
        if "already" in str(exc).lower():
            raise UsageError(
                f"a run with id {workflow_id!r} is already running: `stayalive watch {workflow_id}`"
            ) from None
        raise


def report(result: RunResult, url: str | None) -> None:
    console.print()
    if result.interruptions:
        console.print(timeline_table(result.interruptions))
    else:
        console.print("No interruptions.")
    if (earlier := result.earlier_interruptions).count:
        causes = ", ".join(f"{n} {cause}" for cause, n in sorted(earlier.by_cause.items()))
        console.print(f"and {earlier.count} earlier interruptions, no longer listed: {causes}")
    console.print(ledger_table(result.ledger))
    style = "bold green" if result.state == RunState.COMPLETED else "bold red"
    console.print(
        f"Run {result.run_id}: [{style}]{result.state.value}[/] at step {result.final_step}. {result.failure}"
    )
    if url:
        console.print(f"Web UI: {url}")


def stack_address(state_dir: Path) -> tuple[str, str | None]:
    record = DevStack.recorded(state_dir)
    if record is None:
        return "127.0.0.1:7233", None
    ui = f"http://127.0.0.1:{record['ui_port']}" if record.get("ui_port") else None
    return f"127.0.0.1:{record['port']}", ui


async def ensure_stack(state_dir: Path) -> tuple[str, str | None]:
    if DevStack.recorded(state_dir) is None:
        stack = DevStack(state_dir=state_dir, nodes=DEMO_NODES, spares=["n3"], detach=True)
        console.print("Starting the dev stack: Temporal dev server + web UI, supervisor worker, node agents n1 n2 n3 …")
        stack.start()
        await stack.ready()
    return stack_address(state_dir)


async def demo(args: argparse.Namespace) -> int:
    spec = load_spec(args.spec)
    address, ui = await ensure_stack(args.state_dir)
    client = await connect(plain(address))
    workflow_id = f"{spec.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    handle = await start_run(client, spec, workflow_id)
    faults = ", ".join(str(f) for f in spec.faults) or "none"
    console.print(
        f"Started run [bold]{workflow_id}[/]: {spec.world_size} ranks on {', '.join(spec.nodes)} "
        f"(spare {', '.join(spec.spare_nodes) or '-'}), {spec.target_step} steps; injected faults: {faults}"
    )
    result = await follow(client, handle)
    report(result, await ui_url(handle, ui))
    metrics = (DevStack.recorded(args.state_dir) or {}).get("metrics")
    console.print(
        f"The dev stack keeps running for the web UI and Prometheus ({metrics}); stop it with `stayalive dev down`. "
        f"Logs: {args.state_dir}/logs"
    )
    return 0 if result.state == RunState.COMPLETED else 1


async def run(args: argparse.Namespace) -> int:
    spec = load_spec(args.spec)
    _, ui = stack_address(args.state_dir)
    client = await connect(temporal(args))
    handle = await start_run(client, spec, args.id or spec.name)
    if not args.follow:
        emit_json({"workflow_id": handle.id}) if args.json else console.print(f"Started run {handle.id}")
        return 0
    (errors if args.json else console).print(f"Started run {handle.id}")
    return await _follow(client, handle, ui, args.json)


async def _follow(client: Client, handle: WorkflowHandle, ui: str | None, as_json: bool) -> int:
    """Live progress, then the end report: tables, or (as_json) the run's result as JSON on stdout
    with the live view on stderr, so the JSON stays parseable."""
    result = await follow(client, handle, out=errors if as_json else console)
    if as_json:
        emit_json(result)
    else:
        report(result, await ui_url(handle, ui))
    return 0 if result.state == RunState.COMPLETED else 1


async def watch(args: argparse.Namespace) -> int:
    _, ui = stack_address(args.state_dir)
    client = await connect(temporal(args))
    await _follow(client, client.get_workflow_handle(args.id, result_type=RunResult), ui, args.json)
    return 0  # watching succeeded whatever the run's outcome


def temporal(args: argparse.Namespace) -> ClientConnectConfig:
    """The flags' and the environment's Temporal (workers/temporal.py), else the dev stack's."""
    address, _ = stack_address(args.state_dir)
    try:
        return client_config(args, default_address=address)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


async def _client(args: argparse.Namespace) -> Client:
    return await connect(temporal(args))


async def timeline(args: argparse.Namespace) -> int:
    interruptions = await (await _client(args)).get_workflow_handle(args.id).query(RunWorkflow.timeline)
    emit_json(interruptions) if args.json else console.print(timeline_table(interruptions))
    return 0


async def health(args: argparse.Namespace) -> int:
    report = await (await _client(args)).get_workflow_handle(args.id).query(RunWorkflow.health)
    # Always JSON; --json drops the terminal's highlighting for a consumer that reads a pipe anyway.
    emit_json(report) if args.json else console.print_json(report.model_dump_json())
    return 0


async def checkpoints(args: argparse.Namespace) -> int:
    records = await (await _client(args)).get_workflow_handle(args.id).query(RunWorkflow.checkpoints)
    emit_json(records) if args.json else console.print(checkpoints_table(records))
    return 0


async def plots(args: argparse.Namespace) -> int:
    status = await (await _client(args)).get_workflow_handle(args.id).query(RunWorkflow.status_query)
    for path in write_report(status, datetime.now(UTC), args.out or Path(f"report-{args.id}")):
        print(path)
    return 0


async def control(args: argparse.Namespace) -> int:
    """The signals and updates a person sends a run; a rejected update prints why."""
    client = await _client(args)
    handle: WorkflowHandle[RunWorkflow, RunResult] = client.get_workflow_handle(args.id, result_type=RunResult)
    try:
        if args.command == "checkpoint":
            await handle.signal(RunWorkflow.force_checkpoint)
            outcome = "asked for a checkpoint at the next step every rank agrees on"
        elif args.command == "pause":
            await handle.signal(RunWorkflow.pause, args.reason)
            outcome = "asked every rank to finish its step, checkpoint and hold"
        elif args.command == "resume":
            await handle.signal(RunWorkflow.resume)
            outcome = "asked the run to go on"
        elif args.command == "drain":
            outcome = await handle.execute_update(RunWorkflow.drain_node, DrainNode(node=args.node, reason=args.reason))
        else:
            outcome = await handle.execute_update(RunWorkflow.resume_from, ResumeFrom(step=args.step))
    except WorkflowUpdateFailedError as exc:
        raise UsageError(f"{args.id} refused: {exc.cause}") from None
    console.print(f"{args.id}: {outcome}")
    return 0


async def fleet(args: argparse.Namespace) -> int:
    handle = fleet_handle(await _client(args))
    if args.action is None:
        nodes, records = await handle.query(FleetWorkflow.nodes), await handle.query(FleetWorkflow.quarantines)
        trends = await handle.query(FleetWorkflow.ecc_trends)
        if args.json:
            emit_json({"nodes": nodes, "quarantines": records, "ecc_trends": trends})
        else:
            console.print(fleet_table(nodes, records, trends))
        return 0
    try:
        if args.action == "retest":
            await FleetClient(handle).ask(Retest(node=args.node))
            outcome = f"{args.node}: self-test started; `stayalive fleet` shows its result"
        else:
            record = await FleetClient(handle).ask(QuarantineNode(node=args.node, reason=args.reason))
            outcome = f"{args.node} quarantined: {record.cause()}; its self-test decides when it returns"
    except FleetRefused as refused:
        raise UsageError(f"the fleet refused: {refused}") from None
    console.print(outcome)
    return 0


def dev(args: argparse.Namespace) -> int:
    if args.action == "up":
        address, ui = asyncio.run(ensure_stack(args.state_dir))
        record = DevStack.recorded(args.state_dir)
        console.print(
            f"Temporal at {address}; web UI {ui}; /metrics at {record and record['metrics']}; "
            f"node agents {', '.join(DEMO_NODES)}"
        )
        if not address.endswith(":7233"):
            console.print(f"7233 was taken: point the temporal CLI here with TEMPORAL_ADDRESS={address}")
    elif args.action == "down":
        stopped = DevStack.stop_recorded(args.state_dir)
        console.print(f"Stopped: {', '.join(stopped) or 'nothing was running'}")
    else:
        record = DevStack.recorded(args.state_dir)
        console.print_json(data=record) if record else console.print("The dev stack is not running.")
    return 0


def check(args: argparse.Namespace) -> int:
    spec = load_spec(args.spec)
    console.print(
        f"{args.spec}: valid. {spec.world_size} ranks on {len(spec.nodes)} nodes, target step {spec.target_step}."
    )
    return 0


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(
        prog="stayalive", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    root.add_argument(
        "--state-dir",
        type=Path,
        default=Path(".stayalive"),
        help="the dev stack's state (default .stayalive)",
    )
    add_temporal_flags(root, address_help="Temporal frontend host:port (default: the dev stack's)")
    commands = root.add_subparsers(dest="command", required=True)
    p = commands.add_parser("demo", help="run the demo end to end")
    p.add_argument("spec", type=Path, nargs="?", default=DEMO_SPEC)
    p = commands.add_parser("dev", help="the embedded development stack")
    p.add_argument("action", choices=["up", "down", "status"])
    p = commands.add_parser("check", help="validate a run spec")
    p.add_argument("spec", type=Path)
    p = commands.add_parser("run", help="start a run")
    p.add_argument("spec", type=Path)
    p.add_argument("--id", help="workflow id (default: the spec's name)")
    p.add_argument("--follow", action="store_true", help="show live progress until the run closes")
    p.add_argument("--json", action="store_true", help="JSON on stdout: the workflow id, or with --follow the result")
    for name in ("watch", "timeline", "health", "checkpoints", "checkpoint", "resume"):
        p = commands.add_parser(name)
        p.add_argument("id", help="the run's workflow id")
        if name in JSON_COMMANDS:
            p.add_argument("--json", action="store_true", help="the same data as JSON on stdout")
    p = commands.add_parser("report", help="PNG plots of a run: goodput, checkpoint interval, interruptions, step time")
    p.add_argument("id", help="the run's workflow id")
    p.add_argument("--out", type=Path, default=None, help="folder for the plots (default ./report-ID, created)")
    p = commands.add_parser("pause")
    p.add_argument("id")
    p.add_argument("--reason", default="paused by an operator")
    p = commands.add_parser("drain")
    p.add_argument("id")
    p.add_argument("node")
    p.add_argument("--reason", default="drained by an operator")
    p = commands.add_parser("resume-from")
    p.add_argument("id")
    p.add_argument("step", type=int)
    p = commands.add_parser("fleet", help="the fleet's nodes and quarantine records; retest or quarantine a node")
    p.add_argument("--json", action="store_true", help="nodes and quarantine records as JSON on stdout")
    actions = p.add_subparsers(dest="action")
    p = actions.add_parser("retest", help="self-test a quarantined node again (after a repair, say)")
    p.add_argument("node")
    p = actions.add_parser("quarantine", help="take a node out of the pool; its self-test decides when it returns")
    p.add_argument("node")
    p.add_argument("reason", help="what was seen, e.g. 'fan failing'")
    slurm.add_commands(commands)
    return root


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    handlers = {
        "demo": demo,
        "run": run,
        "watch": watch,
        "timeline": timeline,
        "health": health,
        "checkpoints": checkpoints,
        "report": plots,
        "fleet": fleet,
        **dict.fromkeys(("checkpoint", "pause", "resume", "drain", "resume-from"), control),
    }
    try:
        if args.command == "slurm":
            return slurm.main(args)
        if args.command in handlers:
            return asyncio.run(handlers[args.command](args))
        return dev(args) if args.command == "dev" else check(args)
    except (UsageError, StackError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def entry() -> NoReturn:
    """The `stayalive` command. It leaves without Python's teardown: the Temporal client's Rust threads
    can outlive the event loop and abort a finalizing interpreter ("PyGILState_Release ... must be
    current", temporalio/sdk-python#300), which turned a completed demo into exit status 134."""
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    entry()
