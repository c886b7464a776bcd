"""Emulated ranks: what a node agent starts instead of rank processes where a bench stands thousands
of nodes on one host (sim/hub_farm.py). Everything the supervisor meets is real: the agent, its hub,
its relay and the generation's rendezvous store. Only the rank is not a process training a model: it
is a task on its agent's event loop that speaks the rank's side of the protocol as a rank of
`stayalive.Run` does:

- it answers its hub's challenge with the run's token and says Hello;
- it joins the generation's rendezvous store through its node's relay (MASTER_ADDR:MASTER_PORT), as
  `init_process_group` does, and reads the generation's first step time from it, so that every rank
  of the generation steps together, as a synchronous job's ranks do;
- it reports its steps in RankSteps batches (training/step_reports.py's batching) at the step time
  its entrypoint names, with a compute time a few percent apart from its peers';
- it meets the run spec's fault plan (STAYALIVE_FAULTS): a Crash exits with its code, and a Hang or
  CollectiveHang stops every rank inside the step's all-reduce, the culprit one collective short, as
  its collective counts show;
- on a stack dump it writes its counts and a stack, as faulthandler and training/collectives.py do;
- an `exit` command ends it after the next step, Finished reported; a signal from its agent ends it
  as it ends a process (exit status -N);
- rank 0 commits a checkpoint every `checkpoint.interval` steps and at the target step, for the
  whole world (sim/emulated_checkpoint.py), and says so as the rank that commits one does.

An entrypoint `["emulated-rank", "--step-seconds", "1.0"]` asks for one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import structlog
import torch.distributed as dist

from stayalive.activities.hubs import open_hub
from stayalive.agent.processes import RankProcess
from stayalive.core.judgement.hangs import CollectiveProgress, Site
from stayalive.core.protocol.telemetry import CheckpointCommitted, Command, Finished, Hello, RankSteps, to_rank
from stayalive.core.run.faults import CollectiveHang, Crash, Hang
from stayalive.sim.emulated_checkpoint import commit
from stayalive.training.checkpoint import parse_checkpoint_dirname
from stayalive.training.step_reports import batch_steps
from stayalive.training.supervision import SupervisionConfig

log = structlog.get_logger()

ENTRYPOINT = "emulated-rank"
START_AFTER_S = 2.0  # from the first rank's join to the generation's first step: the rest join meanwhile
STORE_TIMEOUT = timedelta(seconds=60)
SPREAD = 0.04  # how far apart the ranks' compute times are (of the step)


def step_seconds(argv: list[str]) -> float:
    """The step time an emulated rank's entrypoint names; ValueError for any other entrypoint."""
    if not argv or Path(argv[0]).name != ENTRYPOINT:
        raise ValueError(f"an emulated node runs only `{ENTRYPOINT} --step-seconds S`, not {argv[:1]}")
    parser = argparse.ArgumentParser(prog=ENTRYPOINT, exit_on_error=False)
    parser.add_argument("--step-seconds", type=float, default=1.0)
    return float(parser.parse_args(argv[1:]).step_seconds)


def join_store(host: str, port: int, generation: int) -> float:
    """Join the generation's store and read its first step's time, which the first to come sets."""
    store = dist.TCPStore(host, port, is_master=False, timeout=STORE_TIMEOUT, wait_for_workers=False)
    first = store.compare_set(f"emulated/g{generation}/start", "", f"{time.time() + START_AFTER_S:.6f}")
    return float(first)


@dataclass(eq=False)
class EmulatedRank(RankProcess):
    """A rank's place in its agent, filled by a task instead of a process (the agent's pid stands in)."""

    env: dict[str, str] = field(default_factory=dict)
    step_s: float = 1.0
    # Told, once the rank joined its generation's store, how long that took from its start.
    joined: Callable[[EmulatedRank, float], None] = lambda rank, took: None
    _task: asyncio.Task[None] | None = field(default=None, init=False)
    _step: int = field(default=0, init=False)  # the step it is computing (0: none yet)
    _entered: int = field(default=0, init=False)  # collectives entered in this generation
    _completed: int = field(default=0, init=False)
    _stack: str = field(default="", init=False)

    @classmethod
    def start(
        cls,
        rank: int,
        generation: int,
        argv: list[str],
        env: dict[str, str],
        log_path: Path,
        joined: Callable[[EmulatedRank, float], None],
    ) -> EmulatedRank:
        waiter: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        emulated = cls(rank, generation, os.getpid(), log_path, waiter, env, step_seconds(argv), joined)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        emulated._task = asyncio.create_task(emulated._live())
        return emulated

    def signal(self, sig: int) -> None:
        if sig == signal.SIGUSR1:
            self.dump_stacks()
        elif self._task is not None and not self.waiter.done():
            self._task.cancel()
            self._end(-sig)

    def dump_stacks(self) -> None:
        progress = CollectiveProgress(
            generation=self.generation,
            step=self._step,
            entered=self._entered,
            completed=self._completed,
            site=Site.GRADIENTS if self._entered else 0,
        )
        self.progress_path.write_bytes(progress.encode())
        with open(self.stack_path, "a") as f:
            f.write(f"Thread 0x0001 (most recent call first):\n{self._stack}\n")

    def _end(self, status: int) -> None:
        if not self.waiter.done():
            self.waiter.set_result(status)

    async def _live(self) -> None:
        config = SupervisionConfig.from_env(self.env)
        assert config.agent is not None, "an emulated rank is started by a node agent"
        hello = Hello(run_id=config.run_id, rank=self.rank, generation=self.generation, pid=self.pid)
        started = time.monotonic()
        try:
            reader, writer = await open_hub(config.agent, hello, config.run_token.encode())
        except OSError as exc:
            self._log(f"agent unreachable: {exc}")
            return self._end(1)
        stopping = asyncio.Event()
        listening = asyncio.create_task(self._listen(reader, stopping))
        try:
            self._stack = '  File "emulated_rank.py", in join_store\n'
            host, port = self.env["MASTER_ADDR"], int(self.env["MASTER_PORT"])
            first_at = await asyncio.to_thread(join_store, host, port, self.generation)
            self.joined(self, time.monotonic() - started)
            await self._train(config, first_at, writer, stopping)
            await writer.drain()
        finally:
            listening.cancel()
            writer.close()

    async def _train(
        self, config: SupervisionConfig, first_at: float, writer: asyncio.StreamWriter, stopping: asyncio.Event
    ) -> None:
        resumed = _resumed_step(config)
        faults = [f for f in config.faults if f.fires_in(self.generation)]
        crash = {f.at_step: f.exit_code for f in faults if isinstance(f, Crash) and f.rank == self.rank}
        # A rank that hangs, or dies, leaves its peers waiting in the step's all-reduce.
        hangs = {f.at_step: f.rank for f in faults if isinstance(f, Hang | CollectiveHang | Crash)}
        compute = self.step_s * (0.8 + SPREAD * (zlib.crc32(b"%d" % self.rank) % 1000 / 1000 - 0.5))
        batch = batch_steps(self.step_s)
        pending: list[tuple[int, float]] = []  # (step, at) not reported yet
        step = resumed
        while step < config.target_step:
            step += 1
            self._step = step
            self._stack = '  File "emulated_rank.py", in forward_backward\n'
            await asyncio.sleep(max(0.0, first_at + (step - resumed - 1) * self.step_s + compute - time.time()))
            if step in crash:
                self._send(writer, pending)
                self._log(f"crash at step {step} (fault plan)")
                return self._end(crash[step])
            if step in hangs:  # every rank waits in the all-reduce; the culprit never entered it
                self._entered += hangs[step] != self.rank
                self._send(writer, pending)
                self._stack = '  File "emulated_rank.py", in all_reduce\n'
                await asyncio.Event().wait()
            self._entered += 1
            self._stack = '  File "emulated_rank.py", in all_reduce\n'
            await asyncio.sleep(max(0.0, first_at + (step - resumed) * self.step_s - time.time()))
            self._completed += 1
            pending.append((step, time.time()))
            if step % batch == 0 or stopping.is_set():
                self._send(writer, pending, compute)
            if self.rank == 0 and (
                step == config.target_step or (config.every_steps and step % config.every_steps == 0)
            ):
                self._send(writer, pending, compute)  # a step's report comes before its checkpoint's commit
                await self._commit(config, step, writer)
            if stopping.is_set():
                break
        self._send(writer, pending, compute)
        writer.write(Finished(rank=self.rank, generation=self.generation, step=step).model_dump_json().encode() + b"\n")
        self._end(0)

    async def _commit(self, config: SupervisionConfig, step: int, writer: asyncio.StreamWriter) -> None:
        started = time.monotonic()
        path = await asyncio.to_thread(commit, config, step, int(self.env["WORLD_SIZE"]))
        committed = CheckpointCommitted(
            rank=self.rank,
            generation=self.generation,
            step=step,
            path=str(path),
            blocking_s=time.monotonic() - started,
            at=time.time(),
        )
        writer.write(committed.model_dump_json().encode() + b"\n")

    def _send(self, writer: asyncio.StreamWriter, pending: list[tuple[int, float]], compute: float = 0.0) -> None:
        if not pending:
            return
        steps = RankSteps(
            rank=self.rank,
            generation=self.generation,
            step=[s for s, _ in pending],
            compute_s=[compute] * len(pending),
            step_s=[self.step_s] * len(pending),
            loss=[4.0 / (1 + s / 1000) for s, _ in pending],
            samples=[[] for _ in pending],
            at=[at for _, at in pending],
        )
        writer.write(steps.model_dump_json().encode() + b"\n")
        pending.clear()

    async def _listen(self, reader: asyncio.StreamReader, stopping: asyncio.Event) -> None:
        """Commands from the agent: `exit` is carried out; the rest are not emulated."""
        with contextlib.suppress(ConnectionError):
            while line := await reader.readline():
                message = to_rank.validate_json(line)
                if isinstance(message, Command) and message.kind == "exit":
                    stopping.set()
                else:
                    self._log(f"not emulated: {message.t} {getattr(message, 'kind', '')}")

    def _log(self, line: str) -> None:
        with open(self.log_path, "a") as f:
            f.write(f"emulated rank {self.rank}, generation {self.generation}: {line}\n")


def _resumed_step(config: SupervisionConfig) -> int:
    """The step the generation resumes after (the step of the checkpoint it is launched from)."""
    return 0 if config.resume_from is None else parse_checkpoint_dirname(config.resume_from.name)[0]
