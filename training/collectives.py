"""Every collective a rank's training issues goes through here, and is counted where its node agent
can read the count without the rank's help (core/hangs.py reads it to name a hang's culprit).

A rank blocked inside a C++ collective runs no Python signal handler, and its threads may be starved,
so nothing in the rank can be asked. The counts live instead in a small file the rank memory-maps
(STAYALIVE_PROGRESS_FILE, next to its stack file): an entered and a completed count per generation,
the step it computes and where it issued its newest collective, as int64s. The page cache the map
writes into is what the agent's read sees, at once, whatever the rank is doing. A collective costs
three stores into the map.

Every rank issues the same collectives in the same order (the loop is synchronous), so equal counts
mean the same collective on every rank. A process that lives through several generations keeps the
file it opened (as it keeps its stack file) and starts the counts again at each: a new group numbers
its collectives from the first.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from stayalive.core.hangs import COMPLETED, ENTERED, GENERATION, PROGRESS_BYTES, PROGRESS_FIELDS, SITE, STEP, Site


@dataclass(frozen=True)
class _Stall:
    """An injected collective hang (training/faults.py): the rank's next all-reduce goes to `group`,
    whose other member never joins, from the same call site as every healthy one."""

    group: dist.ProcessGroup
    counted: bool  # True: the rank counts it as entered (its data is lost inside the collective)


_words: memoryview | None = None  # this rank's progress fields, in the shared map
_stall: _Stall | None = None


def track(path: Path) -> None:
    """Count this process's collectives into `path` from now on (once per process)."""
    global _words
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.ftruncate(descriptor, PROGRESS_BYTES)
        mapped = mmap.mmap(descriptor, PROGRESS_BYTES)  # the map keeps the file open for the process's life
    finally:
        os.close(descriptor)
    _words = memoryview(mapped).cast("q")


def begin(generation: int) -> None:
    """A new generation's group: nothing entered in it yet. The generation reads as none while the
    counts reset, so a reader never pairs the new generation with the last one's counts."""
    if _words is not None:
        _words[GENERATION] = -1
        for field in range(1, len(PROGRESS_FIELDS)):
            _words[field] = 0
        _words[GENERATION] = generation


def at_step(step: int) -> None:
    if _words is not None:
        _words[STEP] = step


def stall_next(group: dist.ProcessGroup, counted: bool) -> None:
    """Fault injection: this rank's next all-reduce never completes (see _Stall)."""
    global _stall
    _stall = _Stall(group, counted)


def all_reduce(
    tensor: torch.Tensor,
    site: Site,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
) -> None:
    group, counted = _stalled_or(group)
    if counted:
        _entered(site)
    # One call site for the healthy collective and the injected stall: faulthandler's frames of a
    # stalled rank are those of its peers, which is the case the counters exist for.
    dist.all_reduce(tensor, op=op, group=group)
    _completed()


def ddp_all_reduce(
    group: dist.ProcessGroup | None,
    bucket: dist.GradBucket,
    rider: torch.Tensor | None = None,
    arrived: Callable[[torch.Tensor], None] = lambda _: None,
    per_tensor: bool = False,
    reduced_to: Callable[[torch.Tensor], None] = lambda _: None,
) -> torch.futures.Future[torch.Tensor]:
    """A DistributedDataParallel communication hook's body: DDP's own averaging all-reduce of a
    gradient bucket, counted (the user's loop keeps its collective calls). A `rider` (the step's
    command vote) is summed in the same all-reduce, and `arrived` gets the sum: no collective of its own.
    `per_tensor`: sum each gradient on its own first, in an order that does not depend on the bucket.
    `reduced_to` sees the bucket's all-reduced gradient (the SDC invariants' norm)."""
    target, counted = _stalled_or(group)
    if counted:
        _entered(Site.GRADIENTS)
    gradients = bucket.buffer().div_(dist.get_world_size(group))
    if per_tensor:
        # Each gradient at offset 0 of an all-reduce of its own (they are views into the bucket): a
        # ring all-reduce sums an element in an order that depends on its offset, and DDP buckets a
        # process's first step (a resumed one's) differently from its later ones.
        summed = rider.clone() if rider is not None else None
        tensors = [*bucket.gradients(), *([summed] if summed is not None else [])]
        for work in [dist.all_reduce(t, group=target, async_op=True) for t in tensors]:
            work.wait()
        _completed()
        if summed is not None:
            arrived(summed)
        reduced_to(gradients)
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(gradients)
        return done
    flat = gradients if rider is None else torch.cat([gradients, rider.to(gradients.dtype)])
    future = dist.all_reduce(flat, group=target, async_op=True).get_future()

    def completed(done: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        _completed()
        (reduced,) = done.value()
        if rider is not None:
            arrived(reduced[gradients.numel() :].to(rider.dtype))
        reduced_to(reduced[: gradients.numel()])
        return reduced[: gradients.numel()]

    return future.then(completed)


def _stalled_or(group: dist.ProcessGroup | None) -> tuple[dist.ProcessGroup | None, bool]:
    """Where the next all-reduce goes, and whether it counts as entered: `group`, unless a stall is due."""
    global _stall
    if _stall is None:
        return group, True
    stall, _stall = _stall, None
    return stall.group, stall.counted


def _entered(site: Site) -> None:
    if _words is not None:
        _words[ENTERED] += 1
        _words[SITE] = site


def _completed() -> None:
    if _words is not None:
        _words[COMPLETED] += 1
