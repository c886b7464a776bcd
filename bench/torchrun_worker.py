"""One worker of bench/recovery.py's torchrun side: `training.train`, restartable the way a torchrun
script must be, plus the two timestamps the benchmark needs.

    torchrun --nnodes 1 --nproc-per-node 4 --max-restarts 3 -m bench.torchrun_worker --preset tiny ...

torchrun restarts every worker after a failure, with TORCHELASTIC_RESTART_COUNT = n. The trainer
resumes only when STAYALIVE_RESUME_FROM names a checkpoint, so a restarted worker points it at the
newest committed `step-*` directory (what a torchrun script does with its own checkpoints) and runs
as generation n, so the crash the fault plan gives generation 0 does not fire again. Nothing else of
the trainer changes; without STAYALIVE_AGENT it has no telemetry channel.

Timestamps go to the JSON-lines file BENCH_EVENTS (appends of one short line are atomic):
  {"event": "crash", "rank": r, "step": s, "at": t}   just before the injected crash exits the process
  {"event": "step", "restart": n, "rank": r, "step": s, "at": t}   each attempt's first completed step,
      with the trainer's own StepReport time (what stayalive's run monitor reads for its first step)
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from pydantic import BaseModel

from core.faults import Crash
from core.telemetry import StepReport
from training import train
from training.checkpoint import MANIFEST, checkpoint_order
from training.faults import FaultInjector
from training.supervision import Supervision


def record(event: str, **fields: object) -> None:
    line = json.dumps({"event": event, **fields}) + "\n"
    with open(os.environ["BENCH_EVENTS"], "a") as events:
        events.write(line)


def newest_checkpoint(directory: Path) -> Path | None:
    """The newest committed checkpoint: a `step-*` directory with its manifest (written last)."""
    committed = [p for p in directory.glob("step-*") if (p / MANIFEST).is_file()]
    return max(committed, key=lambda p: checkpoint_order(p.name), default=None)


def instrument(restart: int) -> None:
    """Record the crash and the first step through the trainer's own hooks, without changing them."""
    before_collective = FaultInjector.before_collective
    report = Supervision.report
    first = True

    def crashing(self: FaultInjector, step: int) -> None:
        # The same match FaultInjector._crash makes for a crash in the middle of a step.
        if any(isinstance(f, Crash) and f.at_step == step and f.during == "step" for f in self.faults):
            record("crash", rank=self.rank, step=step, at=time.time())
        before_collective(self, step)

    def reporting(self: Supervision, message: BaseModel) -> None:
        nonlocal first
        if first and isinstance(message, StepReport):
            first = False
            record("step", restart=restart, rank=message.rank, step=message.step, at=message.at)
        report(self, message)

    FaultInjector.before_collective = crashing  # type: ignore[method-assign]
    Supervision.report = reporting  # type: ignore[method-assign]


def main() -> None:
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart > 0:
        os.environ["STAYALIVE_GENERATION"] = str(restart)
        if (newest := newest_checkpoint(Path(os.environ["STAYALIVE_CHECKPOINT_DIR"]))) is not None:
            os.environ["STAYALIVE_RESUME_FROM"] = str(newest)
    instrument(restart)
    train.main(sys.argv[1:])


if __name__ == "__main__":
    main()
