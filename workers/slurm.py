"""`stayalive slurm`: a run inside a Slurm allocation (examples/stayalive.sbatch).

    stayalive slurm run SPEC [--train-nodes K] [--id ID]   the batch script's one command
    stayalive slurm agent --spares c3,c4                   one per node; `run` starts them with srun

`run` starts one node agent on every node of the allocation (`srun --ntasks-per-node=1`), the first K
nodes to train and the rest as hot spares, waits until each has told the fleet where its hub
listens, then starts the run, or reattaches to it: its workflow id is the spec's name and the job's
id, so a requeued job finds the run it started and never starts a second one (a finished run is
reported, not run again). While the run is open it reads `sinfo`: a node Slurm drains (or marks
failing) becomes the run's `drain_node`. It exits 0 when the run COMPLETED and 1 otherwise.

The supervisor and Temporal live outside the job and outlive it; Temporal's settings are the
temporal CLI's (workers/temporal.py) and reach the agents through the environment, as does the
fleet's secret (STAYALIVE_SECRET_FILE).
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import math
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import structlog
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowFailureError, WorkflowHandle
from temporalio.common import WorkflowIDConflictPolicy, WorkflowIDReusePolicy
from temporalio.exceptions import WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode

from stayalive.core.decisions.slurm import (
    SINFO_FORMAT,
    Placement,
    drain_reason,
    drains_to_ask,
    parse_scontrol_node,
    parse_sinfo,
    place,
    placed,
    rack_of,
    run_workflow_id,
)
from stayalive.core.run.lifecycle import RunState
from stayalive.core.run.spec import RunSpec
from stayalive.core.run.status import RunResult
from stayalive.training.logs import configure_logging
from stayalive.workers.secret import SECRET_ENV, add_secret_flag
from stayalive.workers.specs import UsageError, load_spec
from stayalive.workers.temporal import client_config, connect
from stayalive.workflows.fleet import FleetWorkflow, fleet_handle
from stayalive.workflows.run import TASK_QUEUE, DrainNode, RunWorkflow

log = structlog.get_logger()

# The temporal CLI's flag → the environment variable the agents read it from.
TEMPORAL_ENV = {
    "address": "TEMPORAL_ADDRESS",
    "namespace": "TEMPORAL_NAMESPACE",
    "api_key": "TEMPORAL_API_KEY",
    "tls_cert_path": "TEMPORAL_TLS_CLIENT_CERT_PATH",
    "tls_key_path": "TEMPORAL_TLS_CLIENT_KEY_PATH",
    "tls_ca_path": "TEMPORAL_TLS_SERVER_CA_CERT_PATH",
    "tls_server_name": "TEMPORAL_TLS_SERVER_NAME",
}


def slurm(*argv: str) -> str:
    """A Slurm command's output; its own error message if it fails."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True)
    except FileNotFoundError:
        raise UsageError(f"`{argv[0]}` is not on PATH: run this on a host of the Slurm cluster") from None
    except subprocess.CalledProcessError as exc:
        raise UsageError(f"`{' '.join(argv)}` failed: {exc.stderr.strip()}") from None
    return done.stdout


@dataclass
class Allocation:
    job_id: str
    nodes: list[str]  # Slurm's order
    restarts: int  # how often the job was requeued

    @classmethod
    def from_environment(cls) -> Allocation:
        job_id, nodelist = os.environ.get("SLURM_JOB_ID"), os.environ.get("SLURM_JOB_NODELIST")
        if not job_id or not nodelist:
            raise UsageError(
                "`stayalive slurm run` runs inside a Slurm allocation: submit examples/stayalive.sbatch "
                "with sbatch (or run it under salloc)"
            )
        nodes = slurm("scontrol", "show", "hostnames", nodelist).split()
        return cls(job_id, nodes, int(os.environ.get("SLURM_RESTART_COUNT", "0")))


# -- the launcher ------------------------------------------------------------------------------


def agent_environment(args: argparse.Namespace) -> dict[str, str]:
    """This environment plus the launcher's Temporal flags and secret file, for the agents to read."""
    env = dict(os.environ)
    env.update({name: str(value) for flag, name in TEMPORAL_ENV.items() if (value := getattr(args, flag))})
    if args.tls is not None:
        env["TEMPORAL_TLS"] = "true" if args.tls else "false"
    if args.secret_file:
        env[SECRET_ENV] = str(Path(args.secret_file).resolve())
    return env


async def start_agents(
    allocation: Allocation, placement: Placement, args: argparse.Namespace
) -> asyncio.subprocess.Process:
    """One node agent per node, one srun step for all: every node's whole share of the job (CPUs,
    memory, GPUs) goes to its agent and the ranks it starts, and the step overlaps any other."""
    argv = ["srun", f"--nodes={len(allocation.nodes)}", "--ntasks-per-node=1", "--overlap", "--mem=0"]
    argv += [f"--nodelist={','.join(allocation.nodes)}", "--kill-on-bad-exit=0", "--job-name=stayalive-agents"]
    argv += [
        sys.executable,
        "-m",
        "stayalive.workers.cli",
        "--state-dir",
        str(args.state_dir.resolve()),
        "slurm",
        "agent",
    ]
    argv += ["--spares", ",".join(placement.spares), "--rack", args.rack]
    log.info("starting node agents", nodes=",".join(allocation.nodes), spares=",".join(placement.spares))
    return await asyncio.create_subprocess_exec(*argv, env=agent_environment(args), stdin=subprocess.DEVNULL)


async def fleet_hubs(client: Client, nodes: list[str]) -> dict[str, str]:
    try:
        return await fleet_handle(client).query(FleetWorkflow.hubs, nodes)
    except RPCError as exc:  # no fleet yet: the first agent starts it
        if exc.status == RPCStatusCode.NOT_FOUND:
            return {}
        raise


async def agents_registered(
    client: Client, nodes: list[str], before: dict[str, str], agents: asyncio.subprocess.Process
) -> None:
    """Until every node's agent of this job has registered: a hub the fleet did not know before this
    job's agents started. Then until the nodes are usable too (a node that registers again is
    self-tested first), for at most two minutes more: a node that stays out is the run's to replace."""
    deadline = time.monotonic() + 300
    while True:
        if agents.returncode is not None:
            raise UsageError(f"the node agents' srun step ended (status {agents.returncode}) before they registered")
        hubs = await fleet_hubs(client, nodes)
        waiting = [node for node in nodes if node not in hubs or hubs[node] == before.get(node)]
        if not waiting:
            break
        if time.monotonic() > deadline:
            raise UsageError(f"node agents of {', '.join(waiting)} did not register with the fleet within 300 s")
        await asyncio.sleep(1.0)
    log.info("node agents registered", nodes=",".join(nodes))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        states = {n.id: n.state for n in await fleet_handle(client).query(FleetWorkflow.nodes) if n.id in nodes}
        if all(state.usable for state in states.values()):
            return
        await asyncio.sleep(1.0)


async def start_or_reattach(client: Client, spec: RunSpec, workflow_id: str) -> tuple[WorkflowHandle, str]:
    """The job's run: started, found running (a requeue), or found finished. Never a second run: the
    id's existing run is used while it runs, and a closed one refuses a new start."""
    handle: WorkflowHandle = client.get_workflow_handle(workflow_id, result_type=RunResult)
    try:
        await handle.describe()
        found = True
    except RPCError as exc:
        if exc.status != RPCStatusCode.NOT_FOUND:
            raise
        found = False
    try:
        handle = await client.start_workflow(
            RunWorkflow.run,
            spec,
            id=workflow_id,
            task_queue=TASK_QUEUE,
            id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
            id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
        )
    except WorkflowAlreadyStartedError:
        return handle, "finished"
    return handle, "reattached" if found else "started"


async def follow_slurm(handle: WorkflowHandle, nodes: list[str], min_nodes: int, every: float) -> None:
    """Forever: a node of the run that Slurm took out is drained from it (drain, wait, checkpoint,
    resize); a run waiting for nodes is told (`resume`) that this job's agents are up, at most every
    30 s, so a requeued job's run looks for its nodes at once instead of at its next timer."""
    woken_at = -math.inf
    while True:
        await asyncio.sleep(every)
        try:
            text = await asyncio.to_thread(slurm, "sinfo", "-h", "-N", "-n", ",".join(nodes), "-o", SINFO_FORMAT)
            health = await handle.query(RunWorkflow.health)
            short = health.state == RunState.STOPPED.value and len(health.nodes) < min_nodes
            if short and time.monotonic() - woken_at > 30:
                log.info("the run waits for nodes; telling it this job's agents are up", run_id=handle.id)
                await handle.signal(RunWorkflow.resume)
                woken_at = time.monotonic()
        except (UsageError, RPCError) as exc:  # Slurm or Temporal busy: ask again next time
            log.warning("could not read the nodes' states", run_id=handle.id, error=str(exc))
            continue
        for node in drains_to_ask(parse_sinfo(text), health.nodes, health.state):
            log.info("Slurm took a node out; draining it from the run", run_id=handle.id, node=node.name)
            try:
                outcome = await handle.execute_update(
                    RunWorkflow.drain_node, DrainNode(node=node.name, reason=drain_reason(node))
                )
            except Exception as exc:  # refused (the run moved on meanwhile): sinfo is read again
                log.warning("drain not taken yet", run_id=handle.id, node=node.name, error=str(exc))
                continue
            log.info("drained", run_id=handle.id, node=node.name, outcome=outcome)


async def stop(agents: asyncio.subprocess.Process) -> None:
    """srun passes SIGTERM to every agent, which stops its ranks and leaves."""
    if agents.returncode is None:
        agents.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(agents.wait(), timeout=30)
        except TimeoutError:
            agents.kill()
            await agents.wait()


async def launch(args: argparse.Namespace) -> int:
    allocation = Allocation.from_environment()
    spec = load_spec(args.spec)
    try:
        placement = place(allocation.nodes, args.train_nodes or len(spec.nodes))
        spec = placed(spec, placement)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    workflow_id = args.id or run_workflow_id(spec.name, allocation.job_id)
    structlog.contextvars.bind_contextvars(run_id=workflow_id)
    try:
        client = await connect(client_config(args))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    handle: WorkflowHandle = client.get_workflow_handle(workflow_id, result_type=RunResult)
    if await closed(handle):
        return await outcome(handle)
    before = await fleet_hubs(client, allocation.nodes)
    agents = await start_agents(allocation, placement, args)
    try:
        await agents_registered(client, allocation.nodes, before, agents)
        handle, how = await start_or_reattach(client, spec, workflow_id)
        log.info("the job's run", how=how, job_id=allocation.job_id, restarts=allocation.restarts)
        if how == "finished":
            return await outcome(handle)
        drains = asyncio.create_task(follow_slurm(handle, allocation.nodes, spec.min_nodes, args.poll))
        result = asyncio.create_task(outcome(handle))
        ended_agents = asyncio.create_task(agents.wait())
        await asyncio.wait([result, ended_agents], return_when=asyncio.FIRST_COMPLETED)
        drains.cancel()
        if not result.done():
            result.cancel()
            raise UsageError(
                f"the node agents' srun step ended (status {agents.returncode}) while run {workflow_id} is open; "
                f"requeue the job (scontrol requeue {allocation.job_id}) to reattach to it"
            )
        return result.result()
    finally:
        await stop(agents)


async def closed(handle: WorkflowHandle) -> bool:
    try:
        return (await handle.describe()).status != WorkflowExecutionStatus.RUNNING
    except RPCError as exc:
        if exc.status == RPCStatusCode.NOT_FOUND:
            return False
        raise


async def outcome(handle: WorkflowHandle) -> int:
    """The run's end, logged; 0 when it COMPLETED."""
    try:
        result: RunResult = await handle.result()
    except WorkflowFailureError as exc:
        log.error("the run ended without a result", run_id=handle.id, cause=str(exc.cause))
        return 1
    log.info("run ended", run_id=handle.id, state=result.state.value, step=result.final_step, failure=result.failure)
    return 0 if result.state == RunState.COMPLETED else 1


# -- the agent of one node -------------------------------------------------------------------


_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


def interface_of(address: str) -> str | None:
    """The name of this host's network interface that holds `address` (IPv4), if one does."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                answer = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on it
                continue
            if socket.inet_ntoa(answer[20:24]) == address:
                return name
    return None


def agent(args: argparse.Namespace) -> NoReturn:
    """Become this node's agent: its name is Slurm's, its hub listens on the node's Slurm address,
    and gloo binds the interface holding that address (unless GLOO_SOCKET_IFNAME says otherwise)."""
    node = os.environ.get("SLURMD_NODENAME")
    if not node:
        raise UsageError("`stayalive slurm agent` runs as a task of `srun`, which names its node (SLURMD_NODENAME)")
    fields = parse_scontrol_node(slurm("scontrol", "show", "node", "-o", node))
    address = socket.gethostbyname(fields.get("NodeAddr", node))
    env = dict(os.environ)
    if "GLOO_SOCKET_IFNAME" not in env and (interface := interface_of(address)):
        env["GLOO_SOCKET_IFNAME"] = interface
    spares = [name for name in args.spares.split(",") if name]
    argv = [sys.executable, "-m", "stayalive.workers.node_agent", "--node", node, "--host", address]
    argv += ["--rack", rack_of(fields.get("AvailableFeatures", ""), args.rack), "--state-dir", str(args.state_dir)]
    argv += ["--spare"] if node in spares else []
    sys.stdout.flush()
    os.execve(sys.executable, argv, env)


def add_commands(commands: argparse._SubParsersAction) -> None:
    """`stayalive slurm run|agent`. Temporal's settings and --state-dir are `stayalive`'s own, before
    the command (`stayalive --address HOST:7233 slurm run SPEC`), or TEMPORAL_* in the environment."""
    p = commands.add_parser("slurm", help="a run inside a Slurm allocation (examples/stayalive.sbatch)")
    actions = p.add_subparsers(dest="action", required=True)
    run = actions.add_parser("run", help="node agents on the allocation's nodes; start the run or reattach to it")
    run.add_argument("spec", type=Path)
    run.add_argument(
        "--train-nodes", type=int, default=None, help="nodes that train (default: the spec's count); the rest wait"
    )
    run.add_argument("--id", default=None, help="workflow id (default: SPEC's name-slurm-JOBID, kept by a requeue)")
    run.add_argument("--poll", type=float, default=10.0, help="seconds between reads of the nodes' Slurm states")
    add_secret_flag(run)
    for parser in (run, actions.add_parser("agent", help="this node's agent (`slurm run` starts it with srun)")):
        parser.add_argument("--rack", default="rack-a", help="failure domain of a node without a rack-… feature")
    actions.choices["agent"].add_argument("--spares", default="", help="comma-separated nodes that are hot spares")


def main(args: argparse.Namespace) -> int:
    configure_logging(node=os.environ.get("SLURMD_NODENAME", "launcher"))
    if args.action == "agent":
        agent(args)
    return asyncio.run(launch(args))
