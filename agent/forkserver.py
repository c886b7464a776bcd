"""The node agent's side of the warm fork servers (training/forkserver.py): it keeps one server per
kind of entrypoint running (stayalive's trainer, warm at once; any other script, started when the
first one comes), asks them for ranks, and turns their reports into RankProcess exits.

A forked rank is the server's child, not the agent's, so the agent learns its exit from the
server's `exited PID CODE` line instead of waitpid; stopping it works as for a cold rank (signals
to its process group). If the server dies, its children die with it (their death signal), so their
exits are settled as SIGKILL and every one of their process groups is killed to be sure; a server
that was serving is replaced at once, one that died warming up only after `retry_after`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, TypeVar

import structlog

from stayalive.agent.processes import RankProcess, spawn
from stayalive.training.forkserver import Assignment, profile_for, unfit

log = structlog.get_logger()
T = TypeVar("T")

WARM_TIMEOUT_S = 180.0  # a server not warm by then is broken (or the host is): replace it
RETRY_AFTER_S = 30.0  # after a server died warming up: do not spin on a broken interpreter or module


class ForkServers:
    """One warm server per kind of entrypoint; a rank is forked from the one for its kind."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.servers: dict[str, ForkServer] = {}

    def start(self) -> None:
        self.server("trainer")  # what most runs start: warm before the first launch

    def server(self, profile: str) -> ForkServer:
        if profile not in self.servers:
            self.servers[profile] = ForkServer(self.log_dir, profile)
            self.servers[profile].start()
        return self.servers[profile]

    async def start_rank(
        self, rank: int, generation: int, argv: list[str], env: dict[str, str], log_path: Path, cwd: Path
    ) -> RankProcess | None:
        return await self.server(profile_for(argv)).start_rank(rank, generation, argv, env, log_path, cwd)

    async def close(self) -> None:
        for server in self.servers.values():
            await server.close()


class ForkServer:
    def __init__(self, log_dir: Path, profile: str = "trainer", retry_after: float = RETRY_AFTER_S) -> None:
        self.profile = profile
        self.log_path = log_dir / f"forkserver-{profile}.log"  # the server's own output; a rank writes to its log
        self.retry_after = retry_after
        self.env = dict(os.environ)  # the environment the server starts with: what `import torch` read
        self.process: asyncio.subprocess.Process | None = None
        self._ready = asyncio.Event()
        # request seq: the child's pid and its exit status, settled together, as `started` is read (its
        # `exited` may be read right after, before the asking task runs again)
        self._asked: dict[int, asyncio.Future[tuple[int, asyncio.Future[int]]]] = {}
        self._running: dict[int, asyncio.Future[int]] = {}  # child pid: its exit status
        self._seq = itertools.count()
        self._keeping: asyncio.Task[None] | None = None
        self._backoff = False  # waiting to replace a server that died warming up

    def start(self) -> None:
        """Start the server in the background (the agent serves meanwhile; ranks wait for it to warm)."""
        self._keeping = asyncio.create_task(self._keep())

    @property
    def warm(self) -> bool:
        return self._ready.is_set()

    async def wait_warm(self, timeout: float = WARM_TIMEOUT_S) -> None:
        async with asyncio.timeout(timeout):
            await self._ready.wait()

    async def start_rank(
        self, rank: int, generation: int, argv: list[str], env: dict[str, str], log_path: Path, cwd: Path
    ) -> RankProcess | None:
        """The rank, forked from the server (waiting for it to warm if it is warming); None when the
        server cannot run it, and the caller starts it cold."""
        launch_env = {**os.environ, **env}  # what start_rank would give the process
        if reason := unfit(argv, self.env, launch_env):
            log.info("cold start: the fork server cannot run this rank", rank=rank, reason=reason)
            return None
        try:
            if self._backoff:
                raise ConnectionError("the fork server died warming up; another starts later")
            await self.wait_warm()
            process = self.process  # the one that is warm now: no await between this and the request
            assert process is not None and process.stdin is not None
            log_path.parent.mkdir(parents=True, exist_ok=True)
            seq = next(self._seq)
            asked = self._asked[seq] = asyncio.get_running_loop().create_future()
            try:
                request = Assignment(seq=seq, argv=argv, env=launch_env, log=log_path, cwd=cwd)
                process.stdin.write(request.model_dump_json().encode() + b"\n")
                await process.stdin.drain()
                pid, waiter = await asyncio.wait_for(asked, WARM_TIMEOUT_S)
            finally:
                self._asked.pop(seq, None)
        except (ConnectionError, OSError, TimeoutError) as exc:
            log.warning("cold start: no rank from the fork server", rank=rank, generation=generation, error=str(exc))
            return None
        log.info("rank forked", rank=rank, generation=generation, pid=pid)
        return RankProcess(rank=rank, generation=generation, pid=pid, log_path=log_path, waiter=waiter)

    async def close(self) -> None:
        """Stop the server; whatever it still runs dies with it (the agent stops its ranks first)."""
        if self._keeping is not None:
            self._keeping.cancel()
            await asyncio.gather(self._keeping, return_exceptions=True)
        if self.process is not None:
            await self.process.wait()

    async def _keep(self) -> None:
        while True:
            started = time.monotonic()
            try:
                process = await self._spawn()
            except OSError as exc:  # out of processes or memory: the host's problem, not a rank's
                log.warning("cannot start the fork server", error=str(exc))
                await self._back_off()
                continue
            try:
                served = await self._serve(process, started)
            finally:
                self._ready.clear()
                self._settle(process)
            log.warning("fork server died", pid=process.pid, code=process.returncode, log=str(self.log_path))
            if not served:
                await self._back_off()

    async def _back_off(self) -> None:
        """Wait before the next server; meanwhile ranks start cold rather than wait for it."""
        self._backoff = True
        try:
            await asyncio.sleep(self.retry_after)
        finally:
            self._backoff = False

    async def _spawn(self) -> asyncio.subprocess.Process:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.env = dict(os.environ)
        with open(self.log_path, "ab") as log_file:
            argv = [sys.executable, "-m", "stayalive.training.forkserver", self.profile]
            self.process = await spawn(
                argv, self.env, asyncio.subprocess.PIPE, asyncio.subprocess.PIPE, stderr=log_file
            )
        return self.process

    async def _serve(self, process: asyncio.subprocess.Process, started: float) -> bool:
        """Read the server's reports until it dies; True if it was ever warm."""
        assert process.stdout is not None
        try:
            async with asyncio.timeout(WARM_TIMEOUT_S):
                if await process.stdout.readline() != b"ready\n":
                    return False
        except TimeoutError:
            log.warning("the fork server did not warm up in time", pid=process.pid)
            return False
        log.info("fork server warm", pid=process.pid, seconds=round(time.monotonic() - started, 2))
        self._ready.set()
        loop = asyncio.get_running_loop()
        while line := await process.stdout.readline():
            what, key, value = line.decode().rstrip("\n").split(" ", 2)
            if what == "started":
                exited = self._running[int(value)] = loop.create_future()
                _resolve(self._asked.get(int(key)), (int(value), exited))
            elif what == "exited":
                _resolve(self._running.pop(int(key), None), int(value))
            else:  # "failed SEQ REASON": the fork itself failed
                _fail(self._asked.get(int(key)), OSError(value))
        return True

    def _settle(self, process: asyncio.subprocess.Process) -> None:
        """The server is gone, and with it every child it forked: settle them, and kill the server."""
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        if process.stdin is not None:
            process.stdin.close()
        for pid, exited in self._running.items():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            _resolve(exited, -signal.SIGKILL)
        self._running.clear()
        for asked in self._asked.values():
            _fail(asked, ConnectionError("the fork server died"))


def _resolve(future: asyncio.Future[T] | None, value: T) -> None:
    if future is not None and not future.done():
        future.set_result(value)


def _fail(future: asyncio.Future[Any] | None, error: Exception) -> None:
    if future is not None and not future.done():
        future.set_exception(error)
