"""Fault injection inside a rank: the failures of the run spec's fault plan, made real."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import structlog
import torch.distributed as dist

from core.faults import CorruptCheckpoint, Crash, Fault, Hang, Slowdown, Straggler
from training.checkpoint import MANIFEST, shard_filename

log = structlog.get_logger()


class FaultInjector:
    def __init__(self, faults: list[Fault], rank: int, generation: int) -> None:
        self.rank = rank
        self.faults = [f for f in faults if f.fires_in(generation) and getattr(f, "rank", rank) == rank]

    def before_collective(self, step: int, compute_s: float) -> None:
        """After backward, before the gradient all-reduce: where a dying, hanging or slow GPU shows.
        `compute_s` is this step's compute so far: a slow rank stretches it by its factor."""
        for fault in self.faults:
            if isinstance(fault, Straggler | Slowdown) and step >= fault.from_step:
                time.sleep(compute_s * (fault.factor - 1))
            elif isinstance(fault, Hang) and fault.at_step == step:
                log.warning("injected hang: entering a collective no peer joins")
                dist.barrier()  # the peers are in the gradient all-reduce: nobody completes
        self._crash(step, "step")

    def checkpoint_writing(self, step: int) -> None:
        """Half of this rank's shard is on storage."""
        self._crash(step, "checkpoint_write")

    def checkpoint_committed(self, step: int, directory: Path) -> None:
        for fault in self.faults:
            if isinstance(fault, CorruptCheckpoint) and fault.at_step == step:
                log.warning("injected checkpoint damage", damage=fault.damage, checkpoint=directory.name)
                _damage(directory, fault)

    def _crash(self, step: int, during: str) -> None:
        for fault in self.faults:
            if isinstance(fault, Crash) and fault.at_step == step and fault.during == during:
                log.warning("injected crash", during=during, exit_code=fault.exit_code)
                os._exit(fault.exit_code)


def _damage(directory: Path, fault: CorruptCheckpoint) -> None:
    shard = directory / shard_filename(fault.shard)
    manifest = directory / MANIFEST
    if fault.damage == "truncate_shard":
        os.truncate(shard, shard.stat().st_size // 2)
    elif fault.damage == "flip_byte":
        with open(shard, "r+b") as f:
            f.seek(shard.stat().st_size // 2)
            byte = f.read(1)[0]
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte ^ 0x01]))
    elif fault.damage == "delete_shard":
        shard.unlink()
    elif fault.damage == "delete_manifest":
        manifest.unlink()
    else:  # edit_manifest: someone "fixes" the step by hand
        body = json.loads(manifest.read_text())
        body["step"] += 1
        manifest.write_text(json.dumps(body))
