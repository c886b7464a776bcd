"""Warm standby rank processes: the node agent keeps a few processes that have already paid for
Python start-up, `import torch` and the first optimizer step (training/standby.py), so a restart
hands each rank to a warm process instead of starting one cold (seed 003 R4: everything but the
weights is pre-warmed).

A standby is started exactly like a rank (activities/processes.spawn: own session, dies with the
agent) with the agent's environment, and becomes a rank when it reads its assignment on stdin. The
returned RankProcess wraps that same asyncio subprocess, so watching and stopping a rank does not
care how it started. After a take the pool refills in the background, one standby at a time and
only after `refill_delay`: warming a standby costs seconds of CPU, which must not be taken from
the ranks it just replaced while they restore and take their first step.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import structlog

from agent.processes import RankProcess, spawn
from training.standby import Assignment, unfit

log = structlog.get_logger()

REFILL_DELAY_S = 5.0  # after a take: the restarted ranks restore and take their first step first
WARM_TIMEOUT_S = 180.0  # a standby that is not warm by then is broken (or the host is): replace it
RETRY_AFTER_S = 30.0  # after a standby died warming: do not spin on a broken interpreter or module


@dataclass
class Standby:
    process: asyncio.subprocess.Process
    env: dict[str, str]  # the environment it started with: what `import torch` has already read
    warming: asyncio.Task[bool]  # True once it says it is warm

    @property
    def warm(self) -> bool:
        return self.warming.done() and not self.warming.cancelled() and self.warming.result()

    @property
    def alive(self) -> bool:
        return self.process.returncode is None


class StandbyPool:
    def __init__(self, size: int, log_dir: Path, refill_delay: float = REFILL_DELAY_S) -> None:
        self.size = size
        self.log_path = log_dir / "standby.log"  # warm-up output; a taken standby writes to its rank's log
        self.refill_delay = refill_delay
        self.standbys: list[Standby] = []
        self._filling: asyncio.Task[None] | None = None
        self._closed = False

    def start(self) -> None:
        """Fill the pool in the background (the agent serves meanwhile; a take finds what is there)."""
        self._fill_soon(0.0)

    @property
    def warm(self) -> int:
        return sum(s.alive and s.warm for s in self.standbys)

    async def wait_warm(self, timeout: float = WARM_TIMEOUT_S) -> None:
        """Until every standby of the pool is warm (tests and benchmarks start from a full pool)."""
        async with asyncio.timeout(timeout):
            while self.warm < self.size:
                await asyncio.sleep(0.05)

    async def take(
        self, rank: int, generation: int, argv: list[str], env: dict[str, str], log_path: Path
    ) -> RankProcess | None:
        """The rank, running in a standby (warm first, else one still warming: it has a head start);
        None when no standby can run it, and the caller starts it cold."""
        launch_env = {**os.environ, **env}  # what start_rank would give the process
        while (standby := self._pick()) is not None:
            if reason := unfit(argv, standby.env, launch_env):
                log.info("cold start: a standby cannot run this rank", rank=rank, reason=reason)
                return None
            self.standbys.remove(standby)  # before any await: a concurrent take never picks it too
            warm = standby.warm
            try:
                await self._assign(standby, Assignment(argv=argv, env=launch_env, log=log_path, cwd=Path.cwd()))
            except ConnectionError:  # it died just now; try the next one
                _discard(standby)
                continue
            self._fill_soon(self.refill_delay)
            state = "warm" if warm else "still warming"
            pid = standby.process.pid
            log.info("rank handed to a standby", rank=rank, generation=generation, pid=pid, standby=state)
            return RankProcess(rank=rank, generation=generation, process=standby.process, log_path=log_path)
        if self.size:
            log.info("cold start: no standby left", rank=rank)
            self._fill_soon(self.refill_delay)
        return None

    async def close(self) -> None:
        """Stop filling and kill every standby (a taken one is a rank now: not ours to stop)."""
        self._closed = True
        if self._filling is not None:
            self._filling.cancel()
            await asyncio.gather(self._filling, return_exceptions=True)
        standbys, self.standbys = self.standbys, []
        for standby in standbys:
            _discard(standby)
        await asyncio.gather(
            *(s.process.wait() for s in standbys), *(s.warming for s in standbys), return_exceptions=True
        )

    def _pick(self) -> Standby | None:
        for dead in [s for s in self.standbys if not s.alive]:
            self.standbys.remove(dead)
            _discard(dead)
        return min(self.standbys, key=lambda s: not s.warm, default=None)

    @staticmethod
    async def _assign(standby: Standby, assignment: Assignment) -> None:
        assignment.log.parent.mkdir(parents=True, exist_ok=True)
        stdin = standby.process.stdin
        assert stdin is not None
        stdin.write(assignment.model_dump_json().encode())
        await stdin.drain()
        stdin.close()  # the standby reads to EOF; a closed pipe also lets the rank's waiter see its exit

    def _fill_soon(self, delay: float) -> None:
        if not self._closed and (self._filling is None or self._filling.done()):
            self._filling = asyncio.create_task(self._fill(delay))

    async def _fill(self, delay: float) -> None:
        await asyncio.sleep(delay)
        while not self._closed and len([s for s in self.standbys if s.alive]) < self.size:
            try:
                standby = await self._spawn()
            except OSError as exc:  # out of processes or memory: the host's problem, not a rank's
                log.warning("cannot start a standby", error=str(exc))
                await asyncio.sleep(RETRY_AFTER_S)
                continue
            self.standbys.append(standby)
            if not await standby.warming:  # one at a time: each warm-up gets the CPU it needs
                log.warning("standby failed to warm up", pid=standby.process.pid, log=str(self.log_path))
                if standby in self.standbys:
                    self.standbys.remove(standby)
                _discard(standby)
                await asyncio.sleep(RETRY_AFTER_S)

    async def _spawn(self) -> Standby:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        read_fd, write_fd = os.pipe()
        try:
            with open(self.log_path, "ab") as log_file:
                argv = [sys.executable, "-m", "training.standby", str(write_fd)]
                process = await spawn(argv, env, asyncio.subprocess.PIPE, log_file, pass_fds=[write_fd])
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)  # the standby holds the only write end: its death reads as EOF
        return Standby(process=process, env=env, warming=asyncio.create_task(_warmed(read_fd, process.pid)))


def _discard(standby: Standby) -> None:
    """Kill a standby nobody will use; closing its stdin lets asyncio finish reaping it."""
    standby.warming.cancel()
    if standby.process.stdin is not None:
        standby.process.stdin.close()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(standby.process.pid, signal.SIGKILL)


async def _warmed(read_fd: int, pid: int) -> bool:
    """True when the standby says it is warm; False if it dies (EOF) or takes too long."""
    started = time.monotonic()
    reader = asyncio.StreamReader()
    pipe = os.fdopen(read_fd, "rb", buffering=0)
    transport, _ = await asyncio.get_running_loop().connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), pipe
    )
    try:
        async with asyncio.timeout(WARM_TIMEOUT_S):
            ready = await reader.readline() == b"ready\n"
    except TimeoutError:
        ready = False
    finally:
        transport.close()
    if ready:
        log.info("standby warm", pid=pid, seconds=round(time.monotonic() - started, 2))
    return ready
