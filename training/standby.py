"""A warm standby for a rank: `python -m training.standby READY_FD`, started by the node agent's pool.

After a crash every rank restarts, and most of a restart is not training: Python start-up, `import
torch` and the first optimizer step (which imports torch._dynamo) take seconds per process (see
FIELD-NOTES). A standby does all of that ahead of time, says so on READY_FD, then blocks reading ONE
launch assignment (JSON on stdin). When it arrives the process becomes the rank: its stdout and
stderr go to the rank's log, its environment, argv, cwd and sys.path become what a cold
`python -m module ...` or `python script.py ...` would have had, and the entrypoint runs in-process
through runpy. Everything is pre-warmed except the weights.

Limits (checked by `unfit` before a standby is used; the agent starts the rank cold otherwise):
- Only `python -m module args...` and `python script.py args...` with this interpreter: interpreter
  options (`-u`, `-X`, `-O`, `-c`) are fixed when the process starts.
- Variables read when the interpreter or torch starts (PYTHON*, LD_*, OMP_*/MKL_*/KMP_* thread
  counts, CUDA_*/NVIDIA_*/HIP_* device visibility, PYTORCH_*/TORCH* settings other than
  TORCHELASTIC_*) must have the values the standby started with: `import torch` has already read
  them. The agent starts standbys with its own environment, so only a spec's `env` can differ.
- A standby never initialises CUDA (the warm-up runs on CPU), so CUDA_VISIBLE_DEVICES and the
  device a rank picks from LOCAL_RANK are still the rank's own choice.
- Modules imported during the warm-up stay imported; a rank's code sees the same files a cold
  start would, but module-level state of torch (e.g. the default thread pool, set again by
  `torch.set_num_threads`) was initialised under the standby's environment.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import runpy
import sys
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel

# What a rank of stayalive's trainer imports; a foreign script still gains torch and torch.distributed.
WARM_MODULES = ("torch", "torch.distributed", "safetensors.torch", "training.train")

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


class Assignment(BaseModel):
    """What the agent hands a standby: the rank's whole launch, as start_rank would have run it."""

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


def unfit(argv: list[str], standby_env: dict[str, str], env: dict[str, str]) -> str | None:
    """Why a standby started with `standby_env` cannot run this launch; None when it can."""
    if entrypoint(argv) is None:
        return "the entrypoint is not `python -m module` or `python script.py` with the agent's interpreter"
    changed = sorted(
        key
        for key in standby_env.keys() | env.keys()
        if standby_env.get(key) != env.get(key) and key.startswith(IMPORT_TIME) and not key.startswith(RUNTIME)
    )
    if changed:
        return f"variables read at start-up differ from the standby's: {', '.join(changed)}"
    return None


def warm() -> None:
    """Import what a rank imports and take one training step on CPU: a process's first forward,
    backward and optimizer step import torch._dynamo and set up autograd, ~1 s the rank then skips."""
    for name in WARM_MODULES:
        importlib.import_module(name)
    import torch

    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(2, 8)).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def become(assignment: Assignment) -> None:
    """Turn this process into the rank: the same files, environment, argv and sys.path as a cold start."""
    target = entrypoint(assignment.argv)
    if target is None:  # the agent checks first; this is the last line of defence
        raise SystemExit(f"a standby cannot run {assignment.argv}")
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
    os.environ.clear()  # exactly the rank's environment, nothing left over from the standby's
    os.environ.update(assignment.env)
    if target.module is not None:
        sys.path[0] = os.getcwd()  # what `python -m` puts first
        sys.argv = [target.module, *target.args]  # run_module replaces argv[0] with the module's file
        runpy.run_module(target.module, run_name="__main__", alter_sys=True)
    else:
        assert target.script is not None
        sys.path[0] = os.path.dirname(os.path.abspath(target.script))  # what `python script.py` puts first
        sys.argv = [target.script, *target.args]
        runpy.run_path(target.script, run_name="__main__")


def main() -> None:
    ready = int(sys.argv[1])
    warm()
    with contextlib.suppress(BrokenPipeError):  # the agent stopped waiting; it may still assign us
        os.write(ready, b"ready\n")
    os.close(ready)
    data = sys.stdin.buffer.read()  # until the agent closes the pipe: one assignment, or none at shutdown
    if not data:
        return
    become(Assignment.model_validate_json(data))


if __name__ == "__main__":
    main()
