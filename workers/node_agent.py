"""A node agent: one per host. It launches, watches, commands and stops the ranks of this host, serves
their telemetry to the run monitor, keeps the host-memory checkpoint tier, and runs the host's
self-test when the fleet asks. Everything it does for the supervisor arrives at its hub (one TCP
port): it is not a Temporal worker, so 2,048 agents open no long polls at all. It tells the fleet
where its hub listens when it starts.

    python -m stayalive.workers.node_agent --node n1 --rack rack-a --address 127.0.0.1:7233 --secret-file secret

Temporal's settings are the temporal CLI's (workers/temporal.py, TLS included). The hub answers only
holders of the fleet's secret (workers/secret.py) and, for a run's own doors, its ranks' token.

A dead agent is how the run learns its host is gone (its hub falls silent), so the agent does
nothing clever to stay up: its ranks die with it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import math
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime
from pathlib import Path

import structlog
from temporalio.client import Client
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.envconfig import ClientConnectConfig
from temporalio.service import RPCError, RPCStatusCode

from stayalive.activities.fleet import PATIENT, FleetClient
from stayalive.agent.forkserver import ForkServers
from stayalive.agent.gpu import GpuTelemetry, gpu_telemetry
from stayalive.agent.hub import NodeHub
from stayalive.agent.node import NodeAgent
from stayalive.agent.selftest import MEMORY_SHARE
from stayalive.core.decisions.fencing import PARTITION_REPORT
from stayalive.core.fleet.requests import FleetRequest, RecordCorrectedErrors, RegisterNode, fleet_id
from stayalive.core.fleet.rules import FleetError, check_register
from stayalive.training.logs import configure_logging
from stayalive.workers.secret import add_secret_flag, load_secret
from stayalive.workers.temporal import add_temporal_flags, client_config, connect
from stayalive.workflows.fleet import FleetInput, FleetWorkflow, fleet_handle
from stayalive.workflows.run import TASK_QUEUE

log = structlog.get_logger()

ECC_REPORT_EVERY = 600.0  # seconds between a node's corrected-ECC reports while its count keeps rising


def default_memory_dir(node: str) -> Path:
    """Host memory: tmpfs where the host has one (every Linux host's /dev/shm)."""
    shm = Path("/dev/shm")
    return (shm if shm.is_dir() else Path("/tmp")) / "stayalive" / node


async def register(client: Client, node: str, rack: str, spare: bool, hub: str) -> None:
    """Tell the fleet this node is up and where its hub listens (host:port), starting the fleet's
    workflow if this is its first node; return once the server holds the registration.

    The registration is a `request` signal (with start): once the server holds it, the fleet applies
    it in order with every other request, and a query of the fleet sees it. The agent waits for no
    answer and queries nothing: a query is answered by the fleet's own worker, which answers the
    queries queued for a workflow before its next workflow task (sdk-core), so 2,056 agents looking
    for their answers held the fleet's tasks back until they timed out, and those not answered within
    a minute sent their registrations again. What the fleet would refuse is refused here first."""
    try:
        check_register(node, rack, hub)
    except FleetError as refused:
        log.error("the fleet would refuse this node's registration", node=node, hub=hub, reason=str(refused))
        raise
    request = FleetRequest(
        id=f"register/{node}/{uuid.uuid4()}", op=RegisterNode(node=node, rack=rack, hub=hub, spare=spare)
    )
    while True:
        try:
            await client.start_workflow(
                FleetWorkflow.run,
                FleetInput(),
                id=fleet_id(),
                task_queue=TASK_QUEUE,
                id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
                start_signal="request",
                start_signal_args=[request],
            )
        except Exception as exc:  # Temporal is not up yet: keep asking (the same id: applied once)
            log.warning("fleet registration not sent; retrying", node=node, error=str(exc))
            await asyncio.sleep(2.0)
        else:
            log.info("registered with the fleet", node=node, hub=hub)
            return


async def report_partitions(
    client: Client, agent: NodeAgent, announce: Callable[[], Awaitable[None]], every: float = 2.0
) -> None:
    """Forever: tell each run this node fenced itself out of that it was cut off, once Temporal answers
    (the run amends its node-lost entry to a partition; a run that is over has nothing to amend), and
    announce the node to the fleet again: the self-test its quarantine began could not reach it, which
    says nothing of its hardware, and a registration tests it again."""
    while True:
        await asyncio.sleep(every)
        for report in list(agent.partitions):
            handle = client.get_workflow_handle(report.run_id.rsplit("/", 1)[0])
            try:
                await asyncio.wait_for(handle.signal(PARTITION_REPORT, report), timeout=10)
            except RPCError as exc:
                if exc.status != RPCStatusCode.NOT_FOUND:
                    log.warning("partition not reported yet", run_id=report.run_id, error=str(exc))
                    continue
            except Exception as exc:  # Temporal is still out of reach
                log.warning("partition not reported yet", run_id=report.run_id, error=str(exc))
                continue
            log.info("partition reported", run_id=report.run_id, generation=report.generation)
            agent.partitions.remove(report)
            await announce()


async def report_corrected_errors(
    client: Client, node: str, newest: Callable[[], tuple[datetime, int] | None], every: float = ECC_REPORT_EVERY
) -> None:
    """Forever: tell the fleet this node's corrected-ECC count when it changes (the fleet keeps the trend,
    core/fleet/rules.py): the first count at once, later changes at most once every `every` seconds, so
    a node whose memory keeps correcting errors sends a few requests an hour and a quiet one none. A
    count that fell is a driver reload: the fleet starts the trend over from it. `newest()`: the agent's
    latest reading (agent/node.py `corrected_errors`)."""
    fleet = FleetClient(fleet_handle(client), PATIENT)
    sent, sent_at = 0, -math.inf
    while True:
        await asyncio.sleep(1.0)
        reading = newest()
        if reading is None or reading[1] == sent or time.monotonic() - sent_at < every:
            continue
        at, corrected = reading
        request = RecordCorrectedErrors(node=node, at=at, corrected=corrected)
        try:
            await fleet.ask(request, id=f"ecc/{node}/{at.isoformat()}")
        except Exception as exc:  # not registered yet, or Temporal out of reach: the next rise or poll tries again
            log.warning("corrected ECC errors not reported yet", node=node, corrected=corrected, error=str(exc))
            continue
        log.info("corrected ECC errors reported", node=node, corrected=corrected)
        sent, sent_at = corrected, time.monotonic()


@contextlib.asynccontextmanager
async def on_duty(
    client: Client, agent: NodeAgent, rack: str, spare: bool, telemetry: GpuTelemetry
) -> AsyncIterator[None]:
    """What an agent does beside answering its hub, while the block runs: it registers with the
    fleet, samples its GPUs, fences itself out of a run it is cut off from and reports that, and
    reports its corrected-ECC count. After the block, every run still here is released."""
    announce = functools.partial(register, client, agent.node, rack, spare, str(agent.hub.endpoint))
    duties = [
        announce(),
        agent.sample_gpus(telemetry),
        agent.fence_when_cut_off(),
        report_partitions(client, agent, announce),
        report_corrected_errors(client, agent.node, lambda: agent.corrected_errors),
    ]
    tasks = [asyncio.create_task(duty) for duty in duties]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await agent.vacate()


async def serve(args: argparse.Namespace, temporal: ClientConnectConfig, secret: bytes, memory_dir: Path) -> None:
    hub = NodeHub(args.node, args.host, memory_dir, secret, args.advertise)
    await hub.start()
    node_dir = args.state_dir / "nodes" / args.node
    forks = ForkServers(node_dir) if args.fork_server else None
    if forks is not None:
        forks.start()
    agent = NodeAgent(args.node, hub, node_dir, forks, memory_share=args.selftest_memory_share)
    telemetry = gpu_telemetry(args.node, args.rack, faults=agent.telemetry_faults)
    client = await connect(temporal)
    log.info("node agent started", node=args.node, hub=str(hub.endpoint))
    stopped = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stopped.set)
    try:
        async with on_duty(client, agent, args.rack, args.spare, telemetry):
            await stopped.wait()
    finally:
        hub.close()
        if forks is not None:
            await forks.close()


def parser() -> argparse.ArgumentParser:
    """The agent's command line (deploy/kubernetes checks its DaemonSet's flags against it)."""
    parser = argparse.ArgumentParser(
        prog="python -m stayalive.workers.node_agent",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--node", required=True, help="this node's id, e.g. n1")
    parser.add_argument("--rack", default="rack-a", help="the failure domain this node shares with its neighbours")
    parser.add_argument("--spare", action="store_true", help="a hot spare: kept idle to replace a failed node")
    add_temporal_flags(parser)
    add_secret_flag(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address the hub listens on (the store: loopback only)")
    parser.add_argument("--advertise", default=None, help="address other hosts reach this one at (default --host)")
    parser.add_argument("--state-dir", type=Path, default=Path(".stayalive"), help="where rank logs are kept")
    parser.add_argument("--memory-dir", type=Path, default=None, help="host-memory checkpoint tier (default /dev/shm)")
    parser.add_argument(
        "--fork-server",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="fork ranks from a warm process that has imported torch (--no-fork-server: start each cold)",
    )
    parser.add_argument(
        "--selftest-memory-share",
        type=memory_share,
        default=MEMORY_SHARE,
        help=f"share of each GPU's free memory the self-test's pattern test covers (default {MEMORY_SHARE})",
    )
    return parser


def memory_share(value: str) -> float:
    share = float(value)
    if not 0 < share <= 0.9:
        raise argparse.ArgumentTypeError(f"{value}: a share of free memory above 0 and at most 0.9 (e.g. 0.5)")
    return share


def main() -> None:
    cli = parser()
    args = cli.parse_args()
    configure_logging(node=args.node)
    try:
        temporal = client_config(args)
    except ValueError as exc:
        cli.error(str(exc))
    asyncio.run(serve(args, temporal, load_secret(args.secret_file), args.memory_dir or default_memory_dir(args.node)))


if __name__ == "__main__":
    main()
