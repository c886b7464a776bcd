"""Rank processes on this node: start them the way torchrun does, reap them, stop them.

A rank dies with its node agent (PR_SET_PDEATHSIG): an agent that is gone cannot supervise, and an
orphaned rank would hold its GPU and its peers hostage. Each rank leads its own process group so
that stopping it also stops anything it started.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


@dataclass(eq=False)
class RankProcess:
    """A rank's process, started cold (this agent's child) or forked by the fork server (its child):
    either way a pid that leads its own process group, and a waiter for its exit status."""

    rank: int
    generation: int
    pid: int
    log_path: Path
    waiter: asyncio.Future[int]  # the exit status as asyncio reports it: -N for death by signal N
    exited_at: float | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.waiter.add_done_callback(self._exited)

    def _exited(self, _: object) -> None:
        self.exited_at = time.time()

    @property
    def stack_path(self) -> Path:
        """Where the rank dumps its stacks on SIGUSR1 (the agent sets STAYALIVE_STACK_FILE to it)."""
        return self.log_path.with_suffix(".stacks")

    @property
    def progress_path(self) -> Path:
        """Where the rank counts its collectives (the agent sets STAYALIVE_PROGRESS_FILE to it)."""
        return self.log_path.with_suffix(".progress")

    @property
    def exit_code(self) -> int | None:
        """The exit status, with death by signal N reported as 128 + N, as a shell would."""
        if not self.waiter.done() or self.waiter.cancelled():
            return None
        code = self.waiter.result()
        return 128 - code if code < 0 else code

    def signal(self, sig: int) -> None:
        """Signal the rank's whole process group (a rank that is gone is left alone)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, sig)

    def dump_stacks(self) -> None:
        """Ask the rank to dump its Python stacks into `stack_path` (faulthandler, on SIGUSR1)."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGUSR1)

    def log_tail(self, lines: int = 12) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


async def spawn(
    argv: list[str],
    env: dict[str, str],
    stdin: int | IO[Any],
    stdout: int | IO[Any],
    stderr: int | IO[Any] = asyncio.subprocess.STDOUT,
    cwd: Path | None = None,
) -> asyncio.subprocess.Process:
    """Start a process the way every rank process starts (a cold rank, or the fork server ranks are
    forked from): its own session, dying with this agent, stderr into stdout unless told."""
    return await asyncio.create_subprocess_exec(
        *argv,
        env=env,
        cwd=cwd,
        stdin=stdin,
        stdout=stdout,
        stderr=stderr,
        preexec_fn=_die_with_parent,
        start_new_session=True,
    )


async def start_rank(
    rank: int, generation: int, argv: list[str], env: dict[str, str], log_path: Path, cwd: Path | None = None
) -> RankProcess:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log_file:
        process = await spawn(argv, {**os.environ, **env}, asyncio.subprocess.DEVNULL, log_file, cwd=cwd)
    waiter = asyncio.ensure_future(process.wait())
    return RankProcess(rank=rank, generation=generation, pid=process.pid, log_path=log_path, waiter=waiter)


class RankLauncher(Protocol):
    """How an agent starts a rank: a process, cold or forked warm (agent/node.py), or an emulated
    one where a bench stands thousands of nodes on one host (sim/hub_farm.py)."""

    async def __call__(
        self, rank: int, generation: int, argv: list[str], env: dict[str, str], log_path: Path, cwd: Path
    ) -> RankProcess: ...


async def stop_ranks(ranks: list[RankProcess], grace: float = 5.0) -> None:
    """SIGTERM every rank's process group, then SIGKILL what is left after `grace` seconds."""
    alive = [r for r in ranks if r.exit_code is None]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for r in alive:
            r.signal(sig)
        if alive:
            await asyncio.wait([r.waiter for r in alive], timeout=grace)
        alive = [r for r in alive if r.exit_code is None]
