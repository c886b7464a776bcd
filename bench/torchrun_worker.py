"""One worker of bench/recovery.py's torchrun side: `training.train`, restartable the way a torchrun
script must be, plus the timestamp the benchmark needs.

    torchrun --nnodes 1 --nproc-per-node 4 --max-restarts 3 -m bench.torchrun_worker --preset tiny ...

torchrun restarts every worker after a failure, with TORCHELASTIC_RESTART_COUNT = n. The trainer
resumes only when STAYALIVE_RESUME_FROM names a checkpoint, so a restarted worker points it at the
newest committed `step-*` directory (what a torchrun script does with its own checkpoints) and runs
as generation n, so the crash the fault plan gives generation 0 does not fire again. Nothing else of
the trainer changes; without STAYALIVE_AGENT its `stayalive.Run` has no telemetry channel.

Each attempt's first completed step goes to the JSON-lines file BENCH_EVENTS (appends of one short
line are atomic), with the StepReport time of the trainer's `stayalive.Run`, which is what stayalive's
run monitor reads for its first step: {"event": "step", "restart": n, "rank": r, "step": s, "at": t}.
The crash time is the trainer's own "injected crash" log line.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from stayalive.core.protocol.telemetry import RankSteps
from stayalive.training import train
from stayalive.training.checkpoint import CheckpointError, parse_checkpoint_dirname, read_dcp_manifest
from stayalive.training.run import Run


def record(event: str, **fields: object) -> None:
    line = json.dumps({"event": event, **fields}) + "\n"
    with open(os.environ["BENCH_EVENTS"], "a") as events:
        events.write(line)


def committed(checkpoint: Path) -> bool:
    """Whether `checkpoint` has its sealed DCP manifest, which the commit writes last (training/commit.py)."""
    try:
        read_dcp_manifest(checkpoint)
    except CheckpointError:
        return False
    return True


def newest_checkpoint(directory: Path) -> Path | None:
    """The newest committed checkpoint: a `step-*` directory with its manifest."""
    checkpoints = [p for p in directory.glob("step-*") if committed(p)]
    return max(checkpoints, key=lambda p: parse_checkpoint_dirname(p.name), default=None)


def instrument(restart: int) -> None:
    """Record this attempt's first step where the trainer's `Run` sends it, without changing what it sends."""
    send = Run._send
    first = True

    def sending(self: Run, messages: list[Any]) -> None:
        nonlocal first
        batch = next((m for m in messages if isinstance(m, RankSteps)), None)
        if first and batch is not None:
            first = False
            record("step", restart=restart, rank=batch.rank, step=batch.step[0], at=batch.at[0])
        send(self, messages)

    Run._send = sending  # type: ignore[method-assign]


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
