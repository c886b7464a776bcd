"""What a rank's process does for the node agent beside training (training/run.py): leave its stacks
and collective counts where the agent reads them when the rank stops answering, and execute itself
again into the next generation."""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
from pathlib import Path
from typing import TextIO

import structlog

from stayalive.training import collectives

log = structlog.get_logger()

_stacks: TextIO | None = None  # open for the life of the process: faulthandler writes into it


def watch_from_outside() -> None:
    """On SIGUSR1 every thread's Python stack goes to STAYALIVE_STACK_FILE, even while blocked in a
    collective; collective counts go to STAYALIVE_PROGRESS_FILE (core/judgement/hangs.py reads both)."""
    global _stacks
    if stack_file := os.environ.get("STAYALIVE_STACK_FILE"):
        Path(stack_file).parent.mkdir(parents=True, exist_ok=True)  # a rejoined rank's generation is new
        _stacks = open(stack_file, "a")  # noqa: SIM115 - open for the life of the process
        faulthandler.register(signal.SIGUSR1, file=_stacks, all_threads=True)
    if progress_file := os.environ.get("STAYALIVE_PROGRESS_FILE"):
        collectives.track(Path(progress_file))


def execute_again(env: dict[str, str]) -> None:
    """This process's command line again, in this process (the same pid), with `env`: `python -m
    module …` or `python script …`."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    if spec is not None and spec.name != "__main__":
        argv = [sys.executable, "-m", spec.name.removesuffix(".__main__"), *sys.argv[1:]]
    else:
        argv = [sys.executable, *sys.argv]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(argv[0], argv, env)
