"""A farm of node agents: many real agents in one process, so that one host stands in for thousands
of nodes before the supervisor. Each node is what `python -m stayalive.workers.node_agent` runs (a
NodeHub on a port of its own that takes the fleet's secret, its NodeAgent with its relay and store,
and the agent's duties: registration with the fleet, GPU sampling, fencing), except that its GPUs
are simulated and its ranks emulated (sim/emulated_rank.py). bench.fanout runs a few farms against
the real supervisor worker; nothing of the supervisor's side is replaced.

It records what a bench measures from the nodes' side, one JSON line each, in `--events`: when each
node answered a generation's StartRanks (`acknowledged`), when each rank had joined its
generation's rendezvous store through its node's relay (`joined`), and when a rank failed of itself
(`crashed`, as the fault plan has it).

    python -m stayalive.sim.hub_farm --first 0 --count 512 --address 127.0.0.1:7233 \\
        --secret-file secret --state-dir farm --events farm-0.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import structlog
from temporalio.client import Client

from stayalive.agent.gpu import SimulatedTelemetry
from stayalive.agent.hub import NodeHub
from stayalive.agent.node import NodeAgent
from stayalive.core.messages.control import AgentAnswer, AgentRequest, Started, StartRanks
from stayalive.core.run.spec import RunSpec
from stayalive.sim.emulated_rank import ENTRYPOINT, EmulatedRank
from stayalive.training.logs import configure_logging
from stayalive.workers.devstack import DevStack
from stayalive.workers.node_agent import on_duty
from stayalive.workers.secret import add_secret_flag, load_secret
from stayalive.workers.temporal import add_temporal_flags, client_config, connect

log = structlog.get_logger()

RACK_NODES = 32  # nodes per rack (a failure domain), as a cluster's leaf switch might hold
# Threads for what blocks: the ranks' store joins (torch's TCPStore client) and the GPU readings. A
# join holds its thread while the farm's own relays and hubs carry it, so a generation's joins must
# not wait in line for threads.
BLOCKING_THREADS = 256
# torch names the peer of every store connection (c10d's formatSockAddr: a reverse lookup of the
# relay's loopback address), so a farm's thousands of ranks ask the host's resolver at once, where a
# real node's eight would; a resolver that drops some costs each its 5 s timeout. One second, once:
# c10d gives up naming peers after its first failed lookup.
RESOLVER_OPTIONS = "timeout:1 attempts:1"


def node_name(index: int) -> str:
    return f"n{index:05d}"


def farm_spec(name: str, nodes: int, ranks_per_node: int, spares: int, step_seconds: float, **fields: Any) -> RunSpec:
    """A run of emulated ranks stepping every `step_seconds` on the farm's first `nodes` nodes, the
    next `spares` its spares; `fields` the rest of its spec (target_step, checkpoint, faults, …)."""
    spec = {
        "name": name,
        "world_size": nodes * ranks_per_node,
        "ranks_per_node": ranks_per_node,
        "nodes": [node_name(i) for i in range(nodes)],
        "spare_nodes": [node_name(nodes + i) for i in range(spares)],
        "min_nodes": nodes,
        "entrypoint": [ENTRYPOINT, "--step-seconds", f"{step_seconds:g}"],
    }
    return RunSpec.model_validate(spec | fields)


async def until(ready: Callable[[], Awaitable[bool]], timeout: float, what: str) -> None:
    """Look every half second until `ready()`; TimeoutError naming `what` past `timeout` seconds (a
    farm's bench and test wait on the stack this way)."""
    deadline = time.monotonic() + timeout
    while not await ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not within {timeout:g}s")
        await asyncio.sleep(0.5)


def farm_command(stack: DevStack, first: int, count: int, spares_from: int, events: Path) -> list[str]:
    """The command line of a farm serving `stack`'s Temporal and fleet, its state in the stack's."""
    argv = [sys.executable, "-m", "stayalive.sim.hub_farm", "--first", str(first), "--count", str(count)]
    argv += ["--spares-from", str(spares_from), "--address", stack.address, "--secret-file", str(stack.secret_file)]
    return [*argv, "--state-dir", str(stack.state_dir / "farm"), "--events", str(events)]


class Events:
    """The farm's measurements, written a batch at a time (one line each)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lines: list[str] = []

    def note(self, **event: Any) -> None:
        self._lines.append(json.dumps(event))

    async def keep_writing(self, every: float = 0.5) -> None:
        while True:
            await asyncio.sleep(every)
            self.flush()

    def flush(self) -> None:
        if self._lines:
            lines, self._lines = self._lines, []
            with open(self.path, "a") as f:
                f.write("\n".join(lines) + "\n")


class FarmNode:
    """One emulated node: a real hub and agent, its ranks emulated, its answers to StartRanks noted."""

    def __init__(self, name: str, secret: bytes, state_dir: Path, events: Events) -> None:
        self.name, self.events = name, events
        self.hub = NodeHub(name, "127.0.0.1", state_dir / "memory" / name, secret)
        self.agent = NodeAgent(name, self.hub, state_dir / "nodes" / name, launch_rank=self._launch)
        self.hub.answer = self._answer

    async def serve(self, client: Client, spares_from: int, stopped: asyncio.Event) -> None:
        """On duty as an agent is, until the farm is stopped."""
        index = int(self.name[1:])
        rack = f"rack-{index // RACK_NODES}"
        telemetry = SimulatedTelemetry(self.name, rack, faults=self.agent.telemetry_faults)
        await self.hub.start()
        try:
            async with on_duty(client, self.agent, rack, index >= spares_from, telemetry):
                await stopped.wait()
        finally:
            self.hub.close()

    async def _answer(self, request: AgentRequest) -> AgentAnswer:
        asked = time.time()
        answer = await self.agent.answer(request)
        if isinstance(request, StartRanks) and isinstance(answer, Started):
            generation = request.launch.generation
            self.events.note(event="acknowledged", node=self.name, generation=generation, asked=asked, at=time.time())
        return answer

    async def _launch(
        self, rank: int, generation: int, argv: list[str], env: dict[str, str], log_path: Path, cwd: Path
    ) -> EmulatedRank:
        emulated = EmulatedRank.start(rank, generation, argv, env, log_path, joined=self._joined)
        emulated.waiter.add_done_callback(lambda _: self._ended(emulated))
        return emulated

    def _joined(self, rank: EmulatedRank, took: float) -> None:
        self.events.note(event="joined", rank=rank.rank, generation=rank.generation, took=took, at=time.time())

    def _ended(self, rank: EmulatedRank) -> None:
        """A rank that failed of itself (not stopped by its agent's signal)."""
        if not rank.waiter.cancelled() and rank.waiter.result() > 0:
            self.events.note(event="crashed", rank=rank.rank, generation=rank.generation, at=rank.exited_at)


async def farm(args: argparse.Namespace) -> None:
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(BLOCKING_THREADS))
    secret = load_secret(args.secret_file)
    client = await connect(client_config(args))
    events = Events(args.events)
    stopped = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stopped.set)
    nodes = [
        FarmNode(node_name(index), secret, args.state_dir, events)
        for index in range(args.first, args.first + args.count)
    ]
    serving = [asyncio.create_task(node.serve(client, args.spares_from, stopped)) for node in nodes]
    log.info("farm serving", first=node_name(args.first), nodes=args.count)
    writing = asyncio.create_task(events.keep_writing())
    await asyncio.gather(*serving)  # every node vacated at once when the farm is stopped, not one by one
    writing.cancel()
    events.flush()
    # Store joins still waiting in torch's client (their store gone with its node) hold threads that
    # asyncio.run would wait out to their timeout: nothing of theirs is needed any more.
    os._exit(0)


def open_files_as_the_host_allows() -> None:
    """A farm holds sockets by the thousand (hubs, relays, store joins, its ranks' lines to their
    agents): 64 nodes already take some 950, near a common default soft limit of 1,024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 1 << 20 if hard == resource.RLIM_INFINITY else hard
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m stayalive.sim.hub_farm",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--first", type=int, default=0, help="the index of this farm's first node")
    parser.add_argument("--count", type=int, required=True, help="how many nodes this farm runs")
    parser.add_argument("--spares-from", type=int, default=1 << 30, help="nodes from this index on are spares")
    parser.add_argument("--state-dir", type=Path, required=True, help="the nodes' rank logs and host memory")
    parser.add_argument("--events", type=Path, required=True, help="where the farm's measurements go (JSON lines)")
    add_temporal_flags(parser)
    add_secret_flag(parser)
    args = parser.parse_args()
    open_files_as_the_host_allows()
    os.environ.setdefault("RES_OPTIONS", RESOLVER_OPTIONS)  # read by the C resolver at its first lookup
    configure_logging(node=f"farm-{node_name(args.first)}")
    asyncio.run(farm(args))


if __name__ == "__main__":
    main()
