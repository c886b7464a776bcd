"""What a node agent does for the supervisor: start, command, inspect and stop the ranks on its host,
and run its self-test. Each request (core.messages.control) arrives at the hub and is answered by `answer`.

The agent owns the rank processes, not any request: ranks outlive the launch that started them until
the next launch, a release or the agent's own death stops them. When it reaps one, it files how the
rank ended (RankExited, with the end of its log) in the run's channel, where the run monitor reads it, as it
files which process took which rank when a generation starts (RankStarted).
"""

from __future__ import annotations

import asyncio
import functools
import os
import shutil
import socket
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import structlog
import torch
import torch.distributed as dist

from stayalive.agent.forkserver import ForkServers
from stayalive.agent.gpu import GpuTelemetry
from stayalive.agent.hub import NodeHub
from stayalive.agent.processes import RankLauncher, RankProcess, start_rank, stop_ranks
from stayalive.agent.relay import LOOPBACK, StoreRelay
from stayalive.agent.selftest import MEMORY_SHARE, SelfTest
from stayalive.core.decisions.fencing import PartitionReport, cut_off
from stayalive.core.judgement.diagnosis import GpuHealth
from stayalive.core.judgement.gpu_faults import hard_faults
from stayalive.core.judgement.hangs import CollectiveProgress
from stayalive.core.messages.control import (
    AgentAnswer,
    AgentRequest,
    DumpStacks,
    Prepare,
    Prepared,
    Released,
    ReleaseRun,
    RunSelfTest,
    SelfTested,
    SendCommand,
    Sent,
    StackDump,
    Started,
    StartRanks,
)
from stayalive.core.protocol.access import run_token
from stayalive.core.protocol.telemetry import GpuReport, OpenStore, RankExited, RankStarted, Rejoin
from stayalive.core.run.faults import BrokenNode, HardwareFault, TelemetryFault
from stayalive.core.run.launch import NodeLaunch, rank_env

log = structlog.get_logger()


def _grew(path: Path, size: int) -> bool:
    return path.exists() and path.stat().st_size > size


def _tail(path: Path, offset: int) -> str:
    with open(path, errors="replace") as f:
        f.seek(offset)
        return f.read()


def loopback_store() -> dist.TCPStore:
    """A generation's rendezvous store, on a socket bound to loopback only (agent/relay.py says why;
    the store takes the socket, and closes it when it goes)."""
    listener = socket.create_server((LOOPBACK, 0), backlog=socket.SOMAXCONN)
    port = listener.getsockname()[1]
    return dist.TCPStore(LOOPBACK, port, is_master=True, wait_for_workers=False, master_listen_fd=listener.detach())


def launch_refusal(node: str, request: Prepare) -> str | None:
    """Why this host cannot run the generation, or None if it can. Without this, NCCL ranks on a host
    with no GPU, or ranks whose working directory is missing, fail one by one at start, and each
    failure reads as the node's."""
    workdir = Path(request.workdir or ".").absolute()
    if not workdir.is_dir():
        return f"{node} has no directory {workdir}: fix the run spec's workdir, or create it on every node"
    return backend_refusal(node, request.backend, request.ranks_per_node)


def backend_refusal(node: str, backend: str, ranks_per_node: int) -> str | None:
    """Why this host cannot run `ranks_per_node` ranks on `backend`, or None if it can."""
    if backend != "nccl":
        return None
    if not torch.cuda.is_available():
        why = (
            f"torch {torch.__version__} sees no CUDA device"
            if torch.version.cuda
            else f"torch {torch.__version__} is a CPU-only build"
        )
        return f"{node} cannot run backend nccl: {why}; use backend gloo, or nodes with GPUs"
    if (devices := torch.cuda.device_count()) < ranks_per_node:
        return f"{node} has {devices} CUDA devices for {ranks_per_node} NCCL ranks per node: lower ranks_per_node"
    return None


def _progress(path: Path) -> CollectiveProgress | None:
    """A rank's collective counts; None from a rank that keeps none (a script without the hooks)."""
    try:
        return CollectiveProgress.decode(path.read_bytes())
    except FileNotFoundError:
        return None


def resolve_argv(argv: list[str]) -> list[str]:
    """`python` in an entrypoint means this agent's interpreter, as `torchrun script.py` would."""
    return [sys.executable, *argv[1:]] if argv[0] in ("python", "python3") else argv


class NodeAgent:
    def __init__(
        self,
        node: str,
        hub: NodeHub,
        state_dir: Path,
        forks: ForkServers | None = None,
        memory_share: float = MEMORY_SHARE,
        launch_rank: RankLauncher | None = None,
    ) -> None:
        self.node = node
        self.memory_share = memory_share  # of each GPU's free memory, under its self-test's pattern test
        self.forks = forks  # the warm process fresh ranks are forked from (agent/forkserver.py)
        self.launch_rank: RankLauncher = launch_rank or self._fork_or_spawn
        self.hub = hub
        self.state_dir = state_dir
        self.ranks: dict[str, list[RankProcess]] = {}
        self.stores: dict[str, tuple[int, dist.TCPStore]] = {}  # run → (generation, the store this node hosts for it)
        self.relays: dict[str, StoreRelay] = {}  # run → where this node's ranks reach its generation's store
        self.hardware: list[HardwareFault] = []  # simulated hardware (fault plans): self-test and GPU telemetry
        self.telemetry: GpuTelemetry | None = None  # this host's GPUs: sampled for its runs, read by its self-test
        # The newest reading of its GPUs' corrected ECC errors, summed: workers/node_agent.py tells the fleet.
        self.corrected_errors: tuple[datetime, int] | None = None
        self._starting = asyncio.Lock()  # one launch at a time: a retried one must find the first's ranks
        self.fence_after: dict[str, float] = {}  # run → how long unread before this node fences itself out
        self.partitions: list[PartitionReport] = []  # fenced out, not reported yet (workers/node_agent.py)
        hub.answer = self.answer
        hub.store_port = self.store_port

    async def answer(self, request: AgentRequest) -> AgentAnswer:
        if isinstance(request, Prepare):
            return self.prepare(request)
        if isinstance(request, StartRanks):
            return await self.start(request.launch)
        if isinstance(request, SendCommand):
            return Sent(reached=await self.hub.command(request.run_id, request.command))
        if isinstance(request, DumpStacks):
            return await self.dump_stacks(request.run_id)
        if isinstance(request, ReleaseRun):
            return Released(stopped=await self.release(request.run_id))
        return await self.self_test(request)

    def prepare(self, request: Prepare) -> Prepared:
        """Say this agent is here, and whether this host can run the generation; open a fresh
        rendezvous store if this node hosts the generation's."""
        if (refused := launch_refusal(self.node, request)) is not None:
            log.warning("launch refused", run_id=request.run_id, node=self.node, reason=refused)
            return Prepared(refused=refused)
        rendezvous = None
        if request.open_store:
            # torchrun gives every restart a new store: keys of the last attempt must not leak into this one.
            # The same generation again is a retried launch (a supervisor that died before it recorded
            # the first): its ranks may be running on that store already, so it stays.
            if self.stores.get(request.run_id, (None, None))[0] != request.generation:
                self.stores[request.run_id] = (request.generation, loopback_store())
            rendezvous = self.hub.endpoint  # the store is reached through this hub (agent/relay.py)
        log.info("generation prepared", run_id=request.run_id, node=self.node, generation=request.generation)
        return Prepared(rendezvous=rendezvous)

    def store_port(self, run_id: str, generation: int) -> int | None:
        """The loopback port of the generation's store, if this node hosts it (the hub joins callers to it)."""
        generation_here, store = self.stores.get(run_id, (None, None))
        return store.port if store is not None and generation_here == generation else None

    async def _open_relay(self, launch: NodeLaunch) -> None:
        """Where this node's ranks of the generation reach its store (their MASTER_ADDR:MASTER_PORT)."""
        if (old := self.relays.pop(launch.run_id, None)) is not None:
            old.close()
        opening = OpenStore(run_id=launch.run_id, generation=launch.generation)
        relay = StoreRelay(launch.rendezvous, opening, run_token(self.hub.secret, launch.run_id))
        await relay.start()
        self.relays[launch.run_id] = relay

    async def start(self, launch: NodeLaunch) -> Started:
        """Start this node's ranks of a generation: survivors of a hold take their new places, the rest
        start fresh, and whatever else of the run still runs here is stopped. A launch retried after
        the first got through finds its ranks running and answers with them."""
        async with self._starting:
            self.hardware += [f for f in launch.hardware if f not in self.hardware]
            current = [r for r in self.ranks.get(launch.run_id, []) if r.generation == launch.generation]
            if current:
                return Started(pids={r.rank: r.pid for r in current})
            self.hub.run(launch.run_id).begin(launch.generation, launch.ranks)
            await self._open_relay(launch)
            carried = await self._rejoin(launch) if launch.rejoin else []
            await stop_ranks([r for r in self.ranks.get(launch.run_id, []) if r not in carried])
            self.ranks[launch.run_id] = carried
            started = await self._start(launch, skip={r.rank for r in carried})
            for process in started:
                process.waiter.add_done_callback(functools.partial(self._reaped, launch.run_id, process))
            self.ranks[launch.run_id] = carried + started
            if launch.fence_after is not None:
                self.fence_after[launch.run_id] = launch.fence_after
            channel = self.hub.run(launch.run_id)
            for process in carried + started:
                rejoined = process in carried
                channel.append(
                    RankStarted(
                        rank=process.rank,
                        generation=launch.generation,
                        pid=process.pid,
                        rejoined=rejoined,
                        at=time.time(),
                    )
                )
            return Started(pids={r.rank: r.pid for r in carried + started}, rejoined=[r.rank for r in carried])

    def _reaped(self, run_id: str, process: RankProcess, _: object = None) -> None:
        """A rank process ended: file how, how far it got and the end of its log, for the monitor."""
        channel = self.hub.run(run_id)
        code = process.exit_code if process.exit_code is not None else -1
        channel.append(
            RankExited(
                rank=process.rank,
                generation=process.generation,
                exit_code=code,
                at=process.exited_at or time.time(),
                last_step=channel.last_step.get(process.rank),
                log_tail=process.log_tail() if code else "",
            )
        )
        if code:
            log.warning("rank failed", run_id=run_id, node=self.node, rank=process.rank, exit_code=code)

    async def release(self, run_id: str) -> int:
        """The run is over here: stop its ranks, close its store, free its host memory. Returns ranks stopped."""
        running = await self.fence(run_id)
        self.hub.runs.pop(run_id, None)
        shutil.rmtree(self.hub.memory_dir / run_id, ignore_errors=True)
        log.info("run released", run_id=run_id, node=self.node, stopped=running)
        return running

    async def fence_when_cut_off(self, every: float = 1.0) -> None:
        """Forever: a run that has ranks here (running, or dead of peers they lost) and that its monitor
        has not read for its `fence_after` has gone on without this node (a partition): stop its ranks,
        so none of them writes for that generation again, and keep the report for when Temporal can
        be reached. A run released here (over, or the node quarantined) is not watched."""
        while True:
            await asyncio.sleep(every)
            now = time.monotonic()
            for run_id, bound in list(self.fence_after.items()):
                ranks = self.ranks.get(run_id, [])  # the live ones, and those that died cut off (gloo lost peers)
                channel = self.hub.runs.get(run_id)
                if not ranks or channel is None or not cut_off(channel.read_at, now, bound):
                    continue
                if (live := {r.rank for r in ranks if r.exit_code is None}) and live <= channel.holding:
                    continue  # held (a pause waits for a person, unread): they write nothing until told to rejoin
                since = time.time() - (now - channel.read_at)
                generation = max(r.generation for r in ranks)
                log.warning("cut off from the run: fencing this node out", run_id=run_id, generation=generation)
                stopped = await self.fence(run_id)
                log.warning("fenced out of the run", run_id=run_id, generation=generation, stopped=stopped)
                report = PartitionReport(
                    node=self.node,
                    run_id=run_id,
                    generation=generation,
                    since=since,
                    fenced_at=time.time(),
                    stopped=stopped,
                )
                self.partitions.append(report)

    async def fence(self, run_id: str) -> int:
        """Out of the run's current generation: its ranks stopped, its store and relay closed. What the
        run keeps here (its records, the host-memory tier) stays until the run releases the node."""
        ranks = self.ranks.pop(run_id, [])
        running = sum(r.exit_code is None for r in ranks)
        await stop_ranks(ranks)
        self.stores.pop(run_id, None)
        if (relay := self.relays.pop(run_id, None)) is not None:
            relay.close()
        self.fence_after.pop(run_id, None)
        return running

    async def vacate(self) -> int:
        """Release every run still here (the node was quarantined, and its self-test needs it idle)."""
        return sum([await self.release(run_id) for run_id in list(self.ranks)])

    async def self_test(self, request: RunSelfTest) -> SelfTested:
        if request.node != self.node:
            # A miswired address: a result from here would vouch for the wrong host.
            raise ValueError(f"self-test for {request.node} reached the agent of {self.node}")
        gpus = self.telemetry.read if self.telemetry is not None else None
        test = SelfTest(self.node, self.broken, vacate=self.vacate, gpus=gpus, memory_share=self.memory_share)
        return SelfTested(result=await test.run())

    def broken(self) -> set[str]:
        """The parts of this node's simulated hardware that compute wrong answers (its self-test sees them)."""
        return {f.part for f in self.hardware if isinstance(f, BrokenNode) and f.node == self.node}

    def telemetry_faults(self) -> list[TelemetryFault]:
        return [f for f in self.hardware if not isinstance(f, BrokenNode)]

    async def sample_gpus(self, telemetry: GpuTelemetry, every: float = 0.5, report_every: float = 2.0) -> None:
        """Watch this host's GPUs a few times a second. Each run with ranks here gets a reading every
        `report_every` (the run monitor diagnoses a straggler from them, docs/architecture.md §11), and
        at once when a GPU fails without slowing (core/judgement/gpu_faults.py): the run cordons the node."""
        self.telemetry = telemetry
        last: list[GpuHealth] | None = None
        reported_at = -report_every
        while True:
            readings = await asyncio.to_thread(telemetry.read)
            failed, last = hard_faults(last, readings), readings
            if counts := [h.ecc_corrected for h in readings if h.ecc_corrected is not None]:
                self.corrected_errors = (datetime.now(UTC), sum(counts))
            if failed or time.monotonic() - reported_at >= report_every:
                reported_at = time.monotonic()
                for run_id, processes in self.ranks.items():
                    if any(p.exit_code is None for p in processes):
                        self.hub.run(run_id).append(GpuReport(node=self.node, readings=readings, at=time.time()))
            await asyncio.sleep(every)

    async def dump_stacks(self, run_id: str) -> StackDump:
        """Every live rank of the run here dumps its Python stacks (faulthandler, on SIGUSR1); with
        them, the collective progress each rank counts in its file (no answer from the rank needed)."""
        alive = [r for r in self.ranks.get(run_id, []) if r.exit_code is None]
        sizes = {r.rank: r.stack_path.stat().st_size if r.stack_path.exists() else 0 for r in alive}
        for r in alive:
            r.dump_stacks()
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline and not all(_grew(r.stack_path, sizes[r.rank]) for r in alive):
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.2)  # let the last frames land
        stacks = {r.rank: _tail(r.stack_path, sizes[r.rank]) for r in alive}
        progress = {r.rank: p for r in alive if (p := _progress(r.progress_path)) is not None}
        log.info("stacks dumped", run_id=run_id, node=self.node, ranks=sorted(stacks), counted=sorted(progress))
        return StackDump(stacks=stacks, progress=progress)

    def _env(self, launch: NodeLaunch, local_rank: int) -> dict[str, str]:
        run_dir = self.state_dir / "runs" / launch.run_id / f"g{launch.generation}"
        return rank_env(launch, local_rank, self.relays[launch.run_id].endpoint, os.environ) | {
            "STAYALIVE_AGENT": str(self.hub.endpoint),
            # What opens this run's doors at any hub (its own node's, its replica's): Hello, PutFile, GetFile.
            "STAYALIVE_RUN_TOKEN": run_token(self.hub.secret, launch.run_id),
            "STAYALIVE_NODE": self.node,
            "STAYALIVE_MEMORY_DIR": str(self.hub.memory_dir),
            # Where the rank dumps its Python stacks on SIGUSR1 (next to its log: RankProcess.stack_path).
            "STAYALIVE_STACK_FILE": str(run_dir / f"rank-{launch.ranks[local_rank]}.stacks"),
            # Where it counts the collectives it entered and completed (RankProcess.progress_path).
            "STAYALIVE_PROGRESS_FILE": str(run_dir / f"rank-{launch.ranks[local_rank]}.progress"),
        }

    async def _rejoin(self, launch: NodeLaunch) -> list[RankProcess]:
        """Hand each surviving process its place in the new generation, in order (ranks on a node are
        contiguous before and after a resize); it keeps its memory and pid. A node new to the run has
        none and starts its ranks fresh (they load the held checkpoint); a node that held some and lost one
        cannot rejoin: the run restarts from the held checkpoint instead."""
        held = self.ranks.get(launch.run_id, [])
        alive = sorted((r for r in held if r.exit_code is None), key=lambda r: r.rank)
        if held and len(alive) != len(launch.ranks):
            raise ValueError(f"{len(launch.ranks) - len(alive)} held rank processes are gone: restart them instead")
        carried = []
        for local_rank, (rank, process) in enumerate(zip(launch.ranks, alive, strict=False)):
            await self.hub.send(launch.run_id, process.rank, Rejoin(env=self._env(launch, local_rank)))
            process.rank, process.generation = rank, launch.generation
            carried.append(process)
        if carried:
            log.info("ranks rejoined", run_id=launch.run_id, node=self.node, ranks=[r.rank for r in carried])
        return carried

    async def _fork_or_spawn(
        self, rank: int, generation: int, argv: list[str], env: dict[str, str], log_path: Path, cwd: Path
    ) -> RankProcess:
        """Forked from the warm server for its entrypoint where there is one, else started cold."""
        warm = await self.forks.start_rank(rank, generation, argv, env, log_path, cwd) if self.forks else None
        return warm or await start_rank(rank, generation, argv, env, log_path, cwd)

    async def _start(self, launch: NodeLaunch, skip: set[int]) -> list[RankProcess]:
        argv = resolve_argv(launch.entrypoint)
        workdir = Path(launch.workdir or ".").absolute()  # checked when the generation was prepared
        run_dir = self.state_dir / "runs" / launch.run_id / f"g{launch.generation}"
        ranks = []
        for local_rank, rank in enumerate(launch.ranks):
            if rank in skip:
                continue
            env, log_path = self._env(launch, local_rank), run_dir / f"rank-{rank}.log"
            ranks.append(await self.launch_rank(rank, launch.generation, argv, env, log_path, workdir))
        if ranks:
            log.info(
                "ranks started",
                run_id=launch.run_id,
                node=self.node,
                generation=launch.generation,
                ranks=[r.rank for r in ranks],
                pids=[r.pid for r in ranks],
            )
        return ranks
