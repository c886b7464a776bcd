"""The warm fork server a node agent starts its ranks from: `python -m stayalive.training.forkserver`.

After a crash every rank restarts, and most of a restart is not training: Python start-up and
`import torch` take seconds of CPU per process (bench/recovery.py measures R). The fork server pays for that
once per node: it imports what a rank imports, says `ready`, then forks one child per launch
request it reads on stdin (one JSON line each). The child becomes the rank: its stdout and stderr
go to the rank's log, its environment, argv, cwd and sys.path become what a cold `python -m
module ...` or `python script.py ...` would have had, and the entrypoint runs in-process through
runpy, then the interpreter exits the way a cold one does (atexit, threads joined, the exit status
of the script). Everything is pre-warmed except the weights (docs/architecture.md §6), and no rank pays for
another's warm-up: a fork shares the server's imported pages instead of importing them again.

The server reports on stdout, one line each: `ready`, `started SEQ PID` (or `failed SEQ REASON`) per
request, and `exited PID CODE` when a child it forked exits (CODE as asyncio reports it: -N for
death by signal N). It exits when stdin closes. Each child leads its own session and gets SIGKILL
if the server dies, as the server does if its agent dies: ranks never outlive their supervision.
`started` comes only once the child leads its session, so a stop sent at once reaches its group.

The server runs no torch operation before it forks: the first one starts OpenMP's thread pool,
which a forked child would inherit broken (DataLoader workers fork at the same point, for the same
reason).

Limits (checked by `unfit` before the agent asks; it starts the rank cold otherwise):
- Only `python -m module args...` and `python script.py args...` with this interpreter: interpreter
  options (`-u`, `-X`, `-O`, `-c`) are fixed when the process starts.
- Variables read when the interpreter or torch starts (PYTHON*, LD_*, OMP_*/MKL_*/KMP_* thread
  counts, CUDA_*/NVIDIA_*/HIP_* device visibility, PYTORCH_*/TORCH* settings other than
  TORCHELASTIC_*) must have the values the server started with: `import torch` has already read
  them. The agent starts its server with its own environment, so only a spec's `env` can differ.
  One exception: a whole-number OMP_NUM_THREADS (what torchrun sets, and the agent as it does) is
  applied in the child with `torch.set_num_threads`, which is what torch does with it at start-up.
- The server never initialises CUDA, so CUDA_VISIBLE_DEVICES and the device a rank picks from
  LOCAL_RANK are still the rank's own choice.
- Modules imported by the server stay imported; a rank's code sees the same files a cold start
  would, but module-level state of torch was initialised under the server's environment.
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import os
import runpy
import selectors
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel

# What a rank imports, by the kind of entrypoint: one server per kind (agent/forkserver.py).
# stayalive's trainer also gets torch._dynamo, which a process's first optimizer step imports (0.8 s
# of CPU). A foreign script does not: imported before its first step, torch._dynamo made a
# tutorial-shaped DDP script (its model freed after destroy_process_group) hang at exit in 2-5 runs
# of 6, cold processes as well as forked ones, and never without it (torch 2.13, gloo:
# ~ProcessGroupGloo joins a worker that waits for the GIL). The trainer leaves with os._exit.
PROFILES = {
    "trainer": (
        "torch",
        "torch.distributed",
        "torch._dynamo",
        "torch.distributed.checkpoint",
        "stayalive.training.train",
        "stayalive.training.run",  # what `stayalive.Run` and `init_process_group` load on first use
    ),
    "script": ("torch", "torch.distributed"),
}
TRAINER_MODULE = "stayalive.training.train"
_PR_SET_PDEATHSIG = 1

# Read once, when the interpreter or torch starts up (prefixes); TORCHELASTIC_* is read at
# init_process_group time, so it may change freely.
IMPORT_TIME = (
    "PYTHON",
    "LD_",
    "OMP_",
    "MKL_",
    "KMP_",
    "GOMP_",
    "OPENBLAS_",
    "CUDA_",
    "NVIDIA_",
    "HIP_",
    "ROCR_",
    "PYTORCH_",
    "TORCH",
)
RUNTIME = ("TORCHELASTIC_",)
THREADS = "OMP_NUM_THREADS"  # applied when the child becomes the rank (become), if a whole number


class Assignment(BaseModel):
    """What the agent asks the server to fork: the rank's whole launch, as start_rank would run it."""

    seq: int  # echoed in the server's answer, which names the child's pid
    argv: list[str]  # argv[0] is this interpreter
    env: dict[str, str]  # the complete environment, not a delta
    log: Path
    cwd: Path


@dataclass(frozen=True)
class Entrypoint:
    module: str | None  # `python -m module`
    script: str | None  # `python script.py`
    args: list[str]


def entrypoint(argv: list[str]) -> Entrypoint | None:
    """`[python, -m, mod, *args]` or `[python, script, *args]`; None for anything a warm process cannot
    reproduce (interpreter options, `-c`, another interpreter)."""
    if len(argv) < 2 or argv[0] != sys.executable:
        return None
    if argv[1] == "-m" and len(argv) >= 3:
        return Entrypoint(module=argv[2], script=None, args=argv[3:])
    if not argv[1].startswith("-"):
        return Entrypoint(module=None, script=argv[1], args=argv[2:])
    return None


def profile_for(argv: list[str]) -> str:
    """Which warm server forks this entrypoint: stayalive's trainer, or any other script."""
    target = entrypoint(argv)
    return "trainer" if target is not None and target.module == TRAINER_MODULE else "script"


def thread_count(env: dict[str, str]) -> int | None:
    """OMP_NUM_THREADS as one positive number; None where it is unset or a list (OpenMP's nesting)."""
    value = env.get(THREADS, "")
    return int(value) if value.isdigit() and int(value) > 0 else None


def unfit(argv: list[str], server_env: dict[str, str], env: dict[str, str]) -> str | None:
    """Why a fork server started with `server_env` cannot run this launch; None when it can."""
    if entrypoint(argv) is None:
        return "the entrypoint is not `python -m module` or `python script.py` with the agent's interpreter"
    changed = sorted(
        key
        for key in server_env.keys() | env.keys()
        if server_env.get(key) != env.get(key)
        and key.startswith(IMPORT_TIME)
        and not key.startswith(RUNTIME)
        and not (key == THREADS and thread_count(env) is not None)
    )
    if changed:
        return f"variables read at start-up differ from the fork server's: {', '.join(changed)}"
    return None


def warm(profile: str) -> None:
    """Import what a rank of this kind imports; run nothing (see the module's docstring: no thread
    pool to fork)."""
    for name in PROFILES[profile]:
        importlib.import_module(name)


def become(assignment: Assignment) -> None:
    """Turn this process into the rank: the same files, environment, argv and sys.path as a cold start."""
    target = entrypoint(assignment.argv)
    if target is None:  # the agent checks first; this is the last line of defence
        raise SystemExit(f"a forked rank cannot run {assignment.argv}")
    sys.stdout.flush()
    sys.stderr.flush()
    log = os.open(assignment.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    null = os.open(os.devnull, os.O_RDONLY)  # start_rank gives ranks /dev/null as stdin
    os.dup2(null, 0)
    os.close(null)
    os.chdir(assignment.cwd)
    os.environ.clear()  # exactly the rank's environment, nothing left over from the server's
    os.environ.update(assignment.env)
    if (threads := thread_count(assignment.env)) is not None:
        import torch  # warm: the server imported it

        torch.set_num_threads(threads)
    if target.module is not None:
        sys.path[0] = os.getcwd()  # what `python -m` puts first
        sys.argv = [target.module, *target.args]  # run_module replaces argv[0] with the module's file
        sys.modules.pop(target.module, None)  # the server's copy: __main__ is a fresh one, as in a cold start
        runpy.run_module(target.module, run_name="__main__", alter_sys=True)
    else:
        assert target.script is not None
        sys.path[0] = os.path.dirname(os.path.abspath(target.script))  # what `python script.py` puts first
        sys.argv = [target.script, *target.args]
        runpy.run_path(target.script, run_name="__main__")


def serve(report: int) -> Assignment | None:
    """Fork a child for every assignment read on stdin and report on `report` what became of it.
    Returns in a forked child (its assignment), or in the server when stdin closes (None)."""
    children: dict[int, int] = {}  # pidfd: pid, for every child not yet reaped
    selector = selectors.DefaultSelector()
    selector.register(0, selectors.EVENT_READ)
    pending = b""
    while True:
        for key, _ in selector.select():
            if key.fd != 0:  # a child exited
                pid = children.pop(key.fd)
                selector.unregister(key.fd)
                os.close(key.fd)
                _, status = os.waitpid(pid, 0)
                _say(report, f"exited {pid} {os.waitstatus_to_exitcode(status)}")
                continue
            data = os.read(0, 1 << 16)
            if not data:
                return None
            *lines, pending = (pending + data).split(b"\n")
            for line in lines:
                assignment = Assignment.model_validate_json(line)
                child = _fork(assignment, report, closing=[*children, report])
                if child == 0:
                    selector.close()
                    return assignment
                if child is not None:
                    pidfd = os.pidfd_open(child)
                    children[pidfd] = child
                    selector.register(pidfd, selectors.EVENT_READ)
                    _say(report, f"started {assignment.seq} {child}")


def _fork(assignment: Assignment, report: int, closing: list[int]) -> int | None:
    """Fork the rank's process: 0 in the child (detached, `closing` closed), its pid in the server
    once it leads its own process group, None if the fork failed (reported)."""
    sys.stdout.flush()  # what an import left buffered is the server's, not every child's
    sys.stderr.flush()
    detached_r, detached_w = os.pipe()
    try:
        pid = os.fork()
    except OSError as exc:  # out of processes or memory: the agent starts this rank cold
        os.close(detached_r)
        os.close(detached_w)
        _say(report, f"failed {assignment.seq} {exc}")
        return None
    if pid == 0:
        for fd in (*closing, detached_r):
            os.close(fd)
        _detach()
        os.close(detached_w)  # the server may say it started: it can be stopped as a rank now
        return 0
    os.close(detached_w)
    os.read(detached_r, 1)  # EOF once the child leads its own process group (or died)
    os.close(detached_r)
    return pid


def _detach() -> None:
    """In a fresh child: lead a session of its own (the agent stops a rank by its process group) and
    die with the server, as a cold rank dies with its agent."""
    server = os.getppid()
    os.setsid()
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != server:  # the server died before the death signal was armed
        os._exit(1)


def _say(report: int, line: str) -> None:
    os.write(report, line.encode() + b"\n")


def main() -> None:
    profile = sys.argv[1] if len(sys.argv) > 1 else "trainer"
    report = os.dup(1)  # the protocol's own descriptor; anything an import prints goes to the log
    os.dup2(2, 1)
    warm(profile)
    # What the server imported is shared by every child until written to; a child's first full
    # collection would write to every object's header and copy all of it. Frozen, the GC skips them.
    gc.freeze()
    _say(report, "ready")
    assignment = serve(report)
    if assignment is not None:  # a forked child: run the rank, then exit as its interpreter would
        become(assignment)


if __name__ == "__main__":
    main()
