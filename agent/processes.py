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
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


@dataclass
class RankProcess:
    rank: int
    generation: int
    process: asyncio.subprocess.Process
    log_path: Path
    exited_at: float | None = None
    waiter: asyncio.Future[int] = field(init=False)

    def __post_init__(self) -> None:
        self.waiter = asyncio.ensure_future(self._reap())

    async def _reap(self) -> int:
        code = await self.process.wait()
        self.exited_at = time.time()
        return code

    @property
    def stack_path(self) -> Path:
        """Where the rank dumps its stacks on SIGUSR1 (the agent sets STAYALIVE_STACK_FILE to it)."""
        return self.log_path.with_suffix(".stacks")

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def exit_code(self) -> int | None:
        """The exit status, with death by signal N reported as 128 + N, as a shell would."""
        code = self.process.returncode
        return None if code is None else (128 - code if code < 0 else code)

    def log_tail(self, lines: int = 12) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


async def spawn(
    argv: list[str], env: dict[str, str], stdin: int | IO[Any], stdout: int | IO[Any], pass_fds: Sequence[int] = ()
) -> asyncio.subprocess.Process:
    """Start a process the way every rank process starts (a rank, or a warm standby that becomes one):
    its own session, dying with this agent, stderr into stdout."""
    return await asyncio.create_subprocess_exec(
        *argv,
        env=env,
        stdin=stdin,
        stdout=stdout,
        stderr=asyncio.subprocess.STDOUT,
        preexec_fn=_die_with_parent,
        start_new_session=True,
        pass_fds=pass_fds,
    )


async def start_rank(rank: int, generation: int, argv: list[str], env: dict[str, str], log_path: Path) -> RankProcess:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log_file:
        process = await spawn(argv, {**os.environ, **env}, asyncio.subprocess.DEVNULL, log_file)
    return RankProcess(rank=rank, generation=generation, process=process, log_path=log_path)


async def stop_ranks(ranks: list[RankProcess], grace: float = 5.0) -> None:
    """SIGTERM every rank's process group, then SIGKILL what is left after `grace` seconds."""
    alive = [r for r in ranks if r.process.returncode is None]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for r in alive:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(r.pid, sig)
        if alive:
            await asyncio.wait([r.waiter for r in alive], timeout=grace)
        alive = [r for r in alive if r.process.returncode is None]
