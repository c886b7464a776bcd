"""Activities on one node's task queue (`node.<id>`): everything the workflow does to ranks on a host.

The node agent owns the rank processes, not any one activity: `run_ranks` starts a generation and
reports its first decisive event, and the ranks outlive that activity until the workflow stops
them (or the agent dies, and its ranks with it).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import structlog
import torch.distributed as dist
from pydantic import BaseModel
from temporalio import activity

from agent.gpu import GpuTelemetry
from agent.hub import NodeHub
from agent.processes import RankProcess, start_rank, stop_ranks
from agent.standby import StandbyPool
from core.events import NodeOutcome, RankFailed, RanksFinished
from core.faults import BrokenNode, HardwareFault, TelemetryFault
from core.launch import Endpoint, NodeEndpoint, NodeLaunch, rank_env
from core.telemetry import Command, GpuReport, RankExited, Rejoin

log = structlog.get_logger()


class PrepareNode(BaseModel):
    run_id: str
    generation: int
    host_rendezvous: bool


class NodeCommand(BaseModel):
    run_id: str
    command: Command


class NodeStacks(BaseModel):
    node: str
    stacks: dict[int, str]  # rank → its newest dump
    files: dict[int, str]  # rank → the file that keeps every dump (the artifact)


def _grew(path: Path, size: int) -> bool:
    return path.exists() and path.stat().st_size > size


def _tail(path: Path, offset: int) -> str:
    with open(path, errors="replace") as f:
        f.seek(offset)
        return f.read()


def resolve_argv(argv: list[str]) -> list[str]:
    """`python` in an entrypoint means this agent's interpreter, as `torchrun script.py` would."""
    return [sys.executable, *argv[1:]] if argv[0] in ("python", "python3") else argv


class NodeActivities:
    def __init__(self, node: str, hub: NodeHub, state_dir: Path, standby: StandbyPool | None = None) -> None:
        self.node = node
        self.standby = standby  # warm processes that fresh ranks start in (activities/standby.py)
        self.hub = hub
        self.state_dir = state_dir
        self.ranks: dict[str, list[RankProcess]] = {}
        self.stores: dict[str, dist.TCPStore] = {}
        self.hardware: list[HardwareFault] = []  # simulated hardware (fault plans): self-test and GPU telemetry

    @activity.defn
    async def prepare_node(self, request: PrepareNode) -> NodeEndpoint:
        """Say where this node's agent listens; open a fresh rendezvous store if this node hosts it."""
        rendezvous = None
        if request.host_rendezvous:
            # torchrun gives every restart a new store: keys of the last attempt must not leak into this one.
            self.stores.pop(request.run_id, None)
            store = dist.TCPStore(self.hub.host, 0, is_master=True, wait_for_workers=False)
            self.stores[request.run_id] = store
            rendezvous = Endpoint(host=self.hub.advertise, port=store.port)
        log.info("generation prepared", run_id=request.run_id, node=self.node, generation=request.generation)
        return NodeEndpoint(node=self.node, hub=self.hub.endpoint, rendezvous=rendezvous)

    @activity.defn
    async def run_ranks(self, launch: NodeLaunch) -> NodeOutcome:
        """Start (or carry over) this node's ranks of one generation, then watch them until one fails or all
        finish."""
        self.hardware += [f for f in launch.hardware if f not in self.hardware]
        ranks = [r for r in self.ranks.get(launch.run_id, []) if r.generation == launch.generation]
        if not ranks:  # a retried activity (or the next segment of a continued run) finds them running
            carried = await self._rejoin(launch)
            await stop_ranks([r for r in self.ranks.get(launch.run_id, []) if r not in carried])
            self.ranks[launch.run_id] = carried
            ranks = carried + await self._start(launch)
        channel = self.hub.run(launch.run_id)
        reaped: set[int] = set()
        while True:
            running = [r.waiter for r in ranks if r.exit_code is None]
            await asyncio.wait(running, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
            pids = {r.rank: r.pid for r in ranks if r.exit_code is None}
            activity.heartbeat({"node": self.node, "pids": pids, "steps": channel.last_step})
            for r in ranks:
                if r.exit_code is not None and r.exited_at is not None and r.rank not in reaped:
                    reaped.add(r.rank)
                    channel.append(
                        RankExited(rank=r.rank, generation=r.generation, exit_code=r.exit_code, at=r.exited_at)
                    )
            if failed := [r for r in ranks if r.exit_code not in (None, 0)]:
                first = min(failed, key=lambda r: r.exited_at or 0.0)
                log.warning(
                    "rank failed",
                    run_id=launch.run_id,
                    node=self.node,
                    rank=first.rank,
                    exit_code=first.exit_code,
                )
                return RankFailed(
                    node=self.node,
                    generation=launch.generation,
                    rank=first.rank,
                    exit_code=first.exit_code or 0,
                    last_step=channel.last_step.get(first.rank),
                    at=first.exited_at or 0.0,
                    log_tail=first.log_tail(),
                )
            if all(r.exit_code == 0 for r in ranks):
                last_step = max((channel.last_step.get(r.rank, 0) for r in ranks), default=None)
                return RanksFinished(node=self.node, generation=launch.generation, last_step=last_step)

    @activity.defn
    async def release_run(self, run_id: str) -> int:
        """The run is over here: stop its ranks, close its store, free its host memory. Returns ranks stopped."""
        return await self._release(run_id)

    async def vacate(self) -> int:
        """Release every run still here (the node was quarantined, and its self-test needs it idle)."""
        return sum([await self._release(run_id) for run_id in list(self.ranks)])

    async def _release(self, run_id: str) -> int:
        ranks = self.ranks.pop(run_id, [])
        running = sum(r.exit_code is None for r in ranks)
        await stop_ranks(ranks)
        self.stores.pop(run_id, None)
        self.hub.runs.pop(run_id, None)
        shutil.rmtree(self.hub.memory_dir / run_id, ignore_errors=True)
        log.info("run released", run_id=run_id, node=self.node, stopped=running)
        return running

    def broken(self) -> set[str]:
        """The parts of this node's simulated hardware that compute wrong answers (its self-test sees them)."""
        return {f.part for f in self.hardware if isinstance(f, BrokenNode) and f.node == self.node}

    def telemetry_faults(self) -> list[TelemetryFault]:
        return [f for f in self.hardware if not isinstance(f, BrokenNode)]

    async def sample_gpus(self, telemetry: GpuTelemetry, every: float = 2.0) -> None:
        """Read this host's GPUs every few seconds into each run's telemetry: the run monitor diagnoses
        a straggler from them (seed R2)."""
        while True:
            readings = await asyncio.to_thread(telemetry.read)
            for run_id, processes in self.ranks.items():
                if any(p.exit_code is None for p in processes):
                    self.hub.run(run_id).append(GpuReport(node=self.node, readings=readings, at=time.time()))
            await asyncio.sleep(every)

    @activity.defn
    async def send_command(self, request: NodeCommand) -> int:
        return await self.hub.command(request.run_id, request.command)

    @activity.defn
    async def dump_stacks(self, run_id: str) -> NodeStacks:
        """Every live rank of the run here dumps its Python stacks (faulthandler, on SIGUSR1): a hung
        rank is alive, and the one whose stack differs from the rest is the culprit."""
        alive = [r for r in self.ranks.get(run_id, []) if r.exit_code is None]
        sizes = {r.rank: r.stack_path.stat().st_size if r.stack_path.exists() else 0 for r in alive}
        for r in alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(r.pid, signal.SIGUSR1)
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline and not all(_grew(r.stack_path, sizes[r.rank]) for r in alive):
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.2)  # let the last frames land
        stacks = {r.rank: _tail(r.stack_path, sizes[r.rank]) for r in alive}
        log.info("stacks dumped", run_id=run_id, node=self.node, ranks=sorted(stacks))
        return NodeStacks(node=self.node, stacks=stacks, files={r.rank: str(r.stack_path) for r in alive})

    def _env(self, launch: NodeLaunch, local_rank: int) -> dict[str, str]:
        run_dir = self.state_dir / "runs" / launch.run_id / f"g{launch.generation}"
        return rank_env(launch, local_rank) | {
            "STAYALIVE_AGENT": str(self.hub.endpoint),
            "STAYALIVE_NODE": self.node,
            "STAYALIVE_MEMORY_DIR": str(self.hub.memory_dir),
            # Where the rank dumps its Python stacks on SIGUSR1 (next to its log: RankProcess.stack_path).
            "STAYALIVE_STACK_FILE": str(run_dir / f"rank-{launch.ranks[local_rank]}.stacks"),
        }

    async def _rejoin(self, launch: NodeLaunch) -> list[RankProcess]:
        """Hand each surviving process its place in the new generation; it keeps its memory and pid."""
        alive = {r.rank: r for r in self.ranks.get(launch.run_id, []) if r.exit_code is None}
        carried = []
        for local_rank, rank in enumerate(launch.ranks):
            if rank in launch.adopt and (process := alive.get(launch.adopt[rank])) is not None:
                await self.hub.send(launch.run_id, process.rank, Rejoin(env=self._env(launch, local_rank)))
                process.rank, process.generation = rank, launch.generation
                carried.append(process)
        if carried:
            log.info("ranks rejoined", run_id=launch.run_id, node=self.node, ranks=[r.rank for r in carried])
        return carried

    async def _start(self, launch: NodeLaunch) -> list[RankProcess]:
        argv = resolve_argv(launch.entrypoint)
        run_dir = self.state_dir / "runs" / launch.run_id / f"g{launch.generation}"
        ranks = []
        for local_rank, rank in enumerate(launch.ranks):
            if rank in launch.adopt:
                continue
            env, log_path = self._env(launch, local_rank), run_dir / f"rank-{rank}.log"
            warm = await self.standby.take(rank, launch.generation, argv, env, log_path) if self.standby else None
            ranks.append(warm or await start_rank(rank, launch.generation, argv, env, log_path))
        if not ranks:
            return ranks
        self.ranks[launch.run_id] += ranks
        log.info(
            "ranks started",
            run_id=launch.run_id,
            node=self.node,
            generation=launch.generation,
            ranks=launch.ranks,
            pids=[r.pid for r in ranks],
        )
        return ranks
