"""What a rank's process does for the node agent beside training (training/run.py): leave its stacks
and collective counts where the agent reads them when the rank stops answering, abort its
communicators when the agent stops it, and execute itself again into the next generation."""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
from pathlib import Path
from typing import TextIO

import structlog
import torch.distributed as dist
from torch.distributed import distributed_c10d

from stayalive.training import collectives

log = structlog.get_logger()

_stacks: TextIO | None = None  # open for the life of the process: faulthandler writes into it
_aborts_on_terminate = False


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


def abort_on_terminate() -> None:
    """When the agent stops this rank (SIGTERM: a hang, a release), its communicators are aborted
    before the process goes (exit status 143: 128 + SIGTERM). NCCL's kernels of a hung
    collective spin on the GPU until their communicator is aborted, and the process's teardown waits
    for them; a Python signal handler alone would never run, the main thread being blocked in the
    collective, so the signal also wakes a thread of its own (Python's wakeup fd), which acts at once."""
    global _aborts_on_terminate
    if _aborts_on_terminate:  # a rank that rejoined in place formed its groups again
        return
    if threading.current_thread() is not threading.main_thread():
        log.warning("communicators are not aborted on SIGTERM: the group was formed outside the main thread")
        return
    _aborts_on_terminate = True
    woken, wake = os.pipe()
    os.set_blocking(wake, False)
    signal.set_wakeup_fd(wake)
    signal.signal(signal.SIGTERM, lambda _signal, _frame: _abort_and_terminate())

    def watch() -> None:
        while True:
            if signal.SIGTERM in os.read(woken, 64):
                _abort_and_terminate()

    threading.Thread(target=watch, name="stayalive-abort-on-terminate", daemon=True).start()


def _abort_and_terminate() -> None:
    if dist.is_initialized():
        log.warning("stopped: aborting this rank's communicators")
        distributed_c10d._abort_process_group()  # every group: none may hold the GPU
    os._exit(128 + signal.SIGTERM)  # as a shell reports a process SIGTERM ended; no atexit, as under SIGTERM


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
