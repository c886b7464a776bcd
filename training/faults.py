"""Fault injection inside a rank: the failures of the run spec's fault plan, made real."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import structlog
import torch
import torch.distributed as dist
from torch.utils.hooks import RemovableHandle

from stayalive.core.run.faults import (
    BitFlip,
    CollectiveHang,
    CorruptCheckpoint,
    Crash,
    DiskFull,
    Fault,
    FlakyRank,
    GradSpike,
    Hang,
    NanLoss,
    Slowdown,
    StorageOutage,
    Straggler,
    WeightFlip,
    WrongRank,
)
from stayalive.training import collectives
from stayalive.training.checkpoint import MANIFEST, dcp_file

log = structlog.get_logger()


class FaultInjector:
    def __init__(self, faults: list[Fault], rank: int, generation: int, world_size: int = 1) -> None:
        self.rank = rank
        planned = [f for f in faults if f.fires_in(generation)]
        self.faults = [f for f in planned if getattr(f, "rank", rank) == rank]
        self.corrupts_gradients = any(isinstance(f, BitFlip | FlakyRank | GradSpike | NanLoss) for f in self.faults)
        self._hooks: list[RemovableHandle] = []
        self._storage_faults_fired: set[int] = set()  # the steps whose storage fault began: a retry is no new fault
        self._full_until = 0.0  # monotonic: until then every write to storage fails with ENOSPC
        # A collective hang stalls in a group of its own, with a peer that never joins it. Creating a
        # group takes every rank of the world, so each one does, for every such fault planned.
        self._stalls = {
            fault: _stall_group(fault, world_size) for fault in planned if isinstance(fault, CollectiveHang)
        }

    # -- silent data corruption: wrong numbers, no error ----------------------------------------------

    def attach(self, model: torch.nn.Module) -> None:
        """A deterministically wrong GPU: the first block's output scaled by 1 + ε on every forward (the
        first module of the model's first ModuleList, or else of its first Sequential)."""
        for fault in self.faults:
            if isinstance(fault, WrongRank):
                modules = list(model.modules())
                lists = [m for m in modules if isinstance(m, torch.nn.ModuleList)]
                block = lists[0][0] if lists else next(m for m in modules if isinstance(m, torch.nn.Sequential))[0]
                self._hooks.append(block.register_forward_hook(_scaled_by(1.0 + fault.epsilon)))

    def detach(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def after_backward(self, step: int, grads: list[torch.Tensor]) -> None:
        """Corrupt this step's gradient as a faulty GPU would (not its replays: a transient fault)."""
        for fault in self.faults:
            transient = isinstance(fault, BitFlip) and fault.at_step == step
            flaky = isinstance(fault, FlakyRank) and random.Random(f"{self.rank}/{step}").random() < fault.probability
            if isinstance(fault, BitFlip | FlakyRank) and (transient or flaky):
                _flip_bit(grads, step, fault.bit, "gradient")
            elif isinstance(fault, GradSpike) and fault.at_step == step:
                log.warning("injected gradient spike", factor=fault.factor)
                for grad in grads:
                    grad.mul_(fault.factor)
            elif isinstance(fault, NanLoss) and fault.at_step == step:
                log.warning("injected NaN loss: its backward leaves every gradient NaN")
                for grad in grads:
                    grad.mul_(math.nan)

    def before_update(self, step: int, params: list[torch.nn.Parameter]) -> None:
        """Corrupt this rank's weights, once its gradient is all-reduced (a memory fault): its replica
        goes its own way from here."""
        for fault in self.faults:
            if isinstance(fault, WeightFlip) and fault.at_step == step:
                _flip_bit([p.data for p in params], step, fault.bit, "weights")

    def before_collective(self, step: int, compute_s: float) -> None:
        """After backward, before the gradient all-reduce: where a dying, hanging or slow GPU shows.
        `compute_s` is this step's compute so far: a slow rank stretches it by its factor."""
        for fault in self.faults:
            if isinstance(fault, Straggler | Slowdown) and step >= fault.from_step:
                time.sleep(compute_s * (fault.factor - 1))
            elif isinstance(fault, Hang) and fault.at_step == step:
                log.warning("injected hang: entering a collective no peer joins")
                dist.barrier()  # the peers are in the gradient all-reduce: nobody completes
            elif isinstance(fault, CollectiveHang) and fault.at_step == step:
                log.warning("injected collective hang: the gradient all-reduce never completes", where=fault.where)
                collectives.stall_next(self._stalls[fault], counted=fault.where == "inside")
        self._crash(step, "step")

    def checkpoint_writing(self, step: int, directory: Path, file: BinaryIO) -> None:
        """Half of this rank's shard is in `file`, on storage under `directory` (the run's): a crash,
        or storage failing from here on, the rest of this very write included."""
        self._crash(step, "checkpoint_write")
        if step in self._storage_faults_fired:
            return
        for fault in self.faults:
            if isinstance(fault, StorageOutage) and fault.at_step == step and self.rank == 0:
                self._storage_faults_fired.add(step)
                _take_away(directory, fault.seconds)
            elif isinstance(fault, DiskFull) and fault.at_step == step:
                self._storage_faults_fired.add(step)
                log.warning("injected full disk", seconds=fault.seconds)
                self._full_until = time.monotonic() + fault.seconds
                self.writing_to_storage(file)

    def writing_to_storage(self, file: BinaryIO) -> None:
        """`file` was just opened on storage for writing: on a full disk its writes fail. Linux's
        /dev/full answers every write with ENOSPC, so putting it behind the file's descriptor makes
        the writer's own write(2) fail as it does on a full filesystem."""
        if time.monotonic() < self._full_until:
            full = os.open("/dev/full", os.O_WRONLY)
            os.dup2(full, file.fileno())
            os.close(full)

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


def _take_away(directory: Path, seconds: float) -> None:
    """The run's checkpoint directory vanishes for `seconds`, as a dropped mount does, then comes back
    whole. No writer recreates it meanwhile (training/state_checkpointer.py), so every write and read under
    it fails with ENOENT. A detached process of its own brings it back, whatever becomes of this rank
    (a crash, or the restart that stops it)."""
    away = directory.with_name(f".{directory.name}.away")
    directory.rename(away)
    log.warning("injected storage outage: checkpoint directory unreachable", directory=str(directory), seconds=seconds)
    back = "import os, sys, time; time.sleep(float(sys.argv[1])); os.rename(sys.argv[2], sys.argv[3])"
    subprocess.Popen(
        [sys.executable, "-c", back, str(seconds), str(away), str(directory)],
        start_new_session=True,
        stdin=subprocess.DEVNULL,
    )


def _stall_group(fault: CollectiveHang, world_size: int) -> dist.ProcessGroup:
    """A group of the hanging rank and its neighbour, which never issues anything in it."""
    peer = (fault.rank + 1) % world_size
    return dist.new_group([fault.rank, peer])


def _scaled_by(scale: float) -> Callable[[torch.nn.Module, object, torch.Tensor], torch.Tensor]:
    return lambda _module, _inputs, output: output * scale


def _flip_bit(tensors: list[torch.Tensor], step: int, bit: int, what: str) -> None:
    """Flip `bit` of one float32 element, chosen by the step (its own RNG: the run's stays untouched)."""
    candidates = [t for t in tensors if t.dtype == torch.float32 and t.numel() > 0]
    choice = random.Random(step)
    tensor = candidates[choice.randrange(len(candidates))]
    index = choice.randrange(tensor.numel())
    words = tensor.view(-1).view(torch.int32)
    words[index] ^= 1 << bit if bit < 31 else -(1 << 31)
    log.warning("injected bit flip", of=what, bit=bit, element=index, value=float(tensor.view(-1)[index]))


def _damage(directory: Path, fault: CorruptCheckpoint) -> None:
    shard = directory / dcp_file(fault.shard)
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
