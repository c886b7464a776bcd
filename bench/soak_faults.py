"""The soak's own faults (bench/soak.py): what the bench does to a run from outside its ranks, and
when. It waits for the moment a fault is planned for (a generation's step, or the restart after the
fault before it), then kills a node agent, the supervisor or the dev server, cuts a namespaced node's
link, or drains a node and kills the supervisor during the drain."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from temporalio.client import Client, WorkflowHandle

from bench.soak_plan import PlannedFault, RunPlan
from harness.records import hubs, subscribe
from stayalive.core.protocol.telemetry import NodeSteps, Record, Subscribe
from stayalive.core.run.status import RunStatus
from stayalive.workers.devstack import DevStack
from stayalive.workers.netns import Partitionable
from stayalive.workflows.run import DrainNode, RunWorkflow

PARTITIONED = "n2"  # the node whose agent lives in a network namespace, where one can be made
DOWN_S = 2.0  # how long a killed supervisor or server stays down
REOPEN_S = 2.0  # how often a fault waiting for its step opens its streams to the agents again


async def status_of(handle: WorkflowHandle) -> RunStatus:
    """The run's status, waiting out a supervisor or server that is down."""
    while True:
        with contextlib.suppress(Exception):
            return await asyncio.wait_for(handle.query(RunWorkflow.status_query), timeout=5)
        await asyncio.sleep(0.3)


class Missed(Exception):
    """A fault of the bench's own found no moment to land in (its generation ended first)."""


@dataclass
class FaultDriver:
    stack: DevStack
    client: Client
    net: Partitionable | None
    rng: random.Random
    behind: list[asyncio.Task[None]] = field(default_factory=list)  # what a fault finishes while the run goes on
    where: dict[str, str] = field(default_factory=dict)  # node → its agent's hub, as last heard
    late: list[str] = field(default_factory=list)  # faults that found their generation over, and landed after

    # -- when to act -------------------------------------------------------------------------------

    async def hubs(self) -> dict[str, str]:
        """Where every node's agent listens: asked of the fleet (which needs a supervisor), else as
        last heard, so that a fault right after the supervisor was killed still finds its moment."""
        with contextlib.suppress(Exception):
            self.where = await asyncio.wait_for(hubs(self.client, self.stack.nodes), timeout=3)
        return self.where

    async def reached(self, handle: WorkflowHandle, generation: int, step: int) -> bool:
        """Until the run's generation `generation` reports `step` on any node, read from the agents
        themselves (the workflow's status needs a supervisor, which may be the fault before); False
        once a record of a later generation, or the status, shows that one ended first. The streams
        are opened again every REOPEN_S: an agent gives a node released and taken back a new channel
        of the run, and a stream on the old one hears nothing (a fresh one replays the generation)."""
        run_id = f"{handle.id}/{(handle.first_execution_run_id or '')[:8]}"
        lines: asyncio.Queue[bytes] = asyncio.Queue()
        readers: list[asyncio.Task[None]] = []
        try:
            while True:
                for reader in readers:
                    reader.cancel()
                subscription = Subscribe(run_id=run_id, generation=generation)
                readers = [
                    asyncio.create_task(self._read(hub, subscription, lines)) for hub in (await self.hubs()).values()
                ]
                deadline = time.monotonic() + REOPEN_S
                while (left := deadline - time.monotonic()) > 0:
                    try:
                        line = await asyncio.wait_for(lines.get(), timeout=left)
                    except TimeoutError:
                        break
                    message = Record.model_validate_json(line).message
                    if (of := getattr(message, "generation", None)) is not None and of > generation:
                        return False
                    if isinstance(message, NodeSteps) and message.generation == generation and message.step >= step:
                        return True
                with contextlib.suppress(Exception):
                    status = await asyncio.wait_for(handle.query(RunWorkflow.status_query), timeout=3)
                    if status.state.terminal or status.generation > generation:
                        return False
        finally:
            for reader in readers:
                reader.cancel()

    @staticmethod
    async def _read(hub: str, subscription: Subscribe, into: asyncio.Queue[bytes]) -> None:
        """One agent's records of the run, into `into` (an agent that cannot be reached adds none)."""
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            reader, writer = await subscribe(hub, subscription)
            try:
                while line := await reader.readline():
                    if not line.startswith(b'{"t":"beat"'):
                        into.put_nowait(line)
            finally:
                writer.close()

    async def interrupted(self, handle: WorkflowHandle, generation: int, timeout: float = 120) -> bool:
        """Until the timeline holds an interruption of `generation`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = await status_of(handle)
            if any(i.generation == generation for i in status.interruptions):
                return True
            if status.state.terminal:
                return False
            await asyncio.sleep(0.3)
        return False

    # -- what the bench does itself ------------------------------------------------------------------

    async def act(self, handle: WorkflowHandle, fault: PlannedFault) -> str | None:
        """Carry out one fault of the bench's own; the node it acted on, if any."""
        if fault.on_restart:
            if not await self.interrupted(handle, fault.generation - 1):
                raise Missed(f"no restart after generation {fault.generation - 1} to land in")
        elif not await self.reached(handle, fault.generation, fault.step):
            if fault.interrupts:  # the generations after it were planned on its interruption
                raise Missed(f"generation {fault.generation} ended before step {fault.step}")
            # A killed supervisor or server interrupts nothing: landing in a later generation (the
            # run moved on while the bench could not see it) still tests what it is there to test.
            self.late.append(f"{fault.kind} planned for generation {fault.generation} landed later")
        nodes = (await status_of(handle)).nodes
        if fault.action in ("supervisor_killed", "supervisor_killed_in_restart"):
            await self.down("supervisor")
        elif fault.action == "server_killed":
            await self.down("temporal")
        elif fault.action == "agent_killed":
            node = self.rng.choice(nodes)
            self.stack.kill(f"agent-{node}")
            await self.interrupted(handle, fault.generation)
            self.start_agent(node)  # back: it registers, passes its self-test, and is a spare again
            return node
        elif fault.action == "supervisor_killed_in_drain":
            node = self.rng.choice(nodes)
            request = DrainNode(node=node, reason="soak: a planned drain")
            self.behind.append(
                asyncio.create_task(self.answered(handle.execute_update(RunWorkflow.drain_node, request)))
            )
            await asyncio.sleep(0.3)
            await self.down("supervisor")
            return node
        elif fault.action == "partition":
            assert self.net is not None
            self.net.cut()  # restored once the node has fenced itself out, while the run goes on
            self.behind.append(asyncio.create_task(self.restore_when_fenced(self.net, self.fenced())))
            return PARTITIONED
        return None

    @staticmethod
    async def answered(update: Coroutine[Any, Any, str]) -> None:
        """The drain's answer, once the restarted supervisor gives it: the run goes on meanwhile (the
        timeline, not the answer, is what the checks read)."""
        with contextlib.suppress(Exception):
            await asyncio.wait_for(update, timeout=120)

    async def down(self, process: str) -> None:
        self.stack.kill(process)
        await asyncio.sleep(DOWN_S)
        if process == "temporal":
            self.stack.start_temporal()
        else:
            self.stack.start_supervisor()

    def fenced(self) -> int:
        """How often the partitioned node's agent has fenced itself out so far."""
        log = self.stack.state_dir / "logs" / f"agent-{PARTITIONED}.log"
        return log.read_text(errors="replace").count("fenced out of the run")

    async def restore_when_fenced(self, net: Partitionable, before: int, timeout: float = 90) -> None:
        """The cut link back once the node's agent, unread, has fenced itself out (or after `timeout`)."""
        deadline = time.monotonic() + timeout
        try:
            while self.fenced() == before and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
        finally:
            net.restore()

    def start_agent(self, node: str) -> None:
        self.stack.start_agent(node, netns=self.net if node == PARTITIONED else None)

    async def drive(self, handle: WorkflowHandle, run: RunPlan) -> tuple[dict[int, str], dict[int, str]]:
        """The bench's own faults of `run`, in order: the node each acted on, and why any missed."""
        acted, missed = {}, {}
        self.behind = []
        for index, fault in enumerate(run.faults):
            if fault.action is None:
                continue
            try:
                if (node := await self.act(handle, fault)) is not None:
                    acted[index] = node
            except Missed as why:
                missed[index] = str(why)
        await asyncio.gather(*self.behind)
        return acted, missed
