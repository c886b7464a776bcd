"""Every collective a rank's training issues goes through here, and is counted where its node agent
can read the count without the rank's help (core/judgement/hangs.py reads it to name a hang's culprit).

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

import functools
import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from stayalive.core.judgement.hangs import (
    COMPLETED,
    ENTERED,
    GENERATION,
    PROGRESS_BYTES,
    PROGRESS_FIELDS,
    SITE,
    STEP,
    Site,
)


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
    _issue([tensor], group, op).wait()
    _completed()


@dataclass
class BucketAllReduce:
    """A DistributedDataParallel gradient bucket's all-reduce, issued and counted as entered: DDP's own
    averaging all-reduce (the user's loop keeps its collective calls), with a `rider` (the step's command
    vote) summed in it, so agreeing on commands costs no collective of its own. `future` is the one DDP
    waits on; `finish()` completes it."""

    reduced: torch.Tensor  # where the bucket's all-reduced gradient lands
    rider: torch.Tensor | None  # where the rider's sum lands
    works: list[dist.Work]
    future: torch.futures.Future[torch.Tensor] = field(default_factory=torch.futures.Future)

    def finish(self) -> None:
        """Wait for it (on NCCL, this orders the streams only), count it completed, and hand DDP the
        reduced gradient. Not a callback on the work's future: that runs on the communication thread,
        whose wait for the GIL cost a rank on gloo 0.1 ms of CPU a step, half of what the API cost."""
        for work in self.works:
            work.wait()
        _completed()
        self.future.set_result(self.reduced)


@dataclass(frozen=True, slots=True)
class Carrier:
    """Where a bucket and its rider are all-reduced together, kept from step to step: a fresh tensor
    and its two views each step cost the step five torch ops, and a torch op costs a step on a shared
    host some 10 µs of CPU (bench.api). DDP copies each gradient out of `reduced` before the next
    step's hook writes it again."""

    flat: torch.Tensor
    reduced: torch.Tensor  # the bucket's part
    summed: torch.Tensor  # the rider's part
    rider_last: torch.Tensor  # the rider's last value (a slot the caller fills after the all-reduce)

    @classmethod
    def fitting(cls, gradients: torch.Tensor, rider: torch.Tensor) -> Carrier:
        flat = torch.empty(gradients.numel() + rider.numel(), dtype=gradients.dtype, device=gradients.device)
        reduced, summed = flat.split([gradients.numel(), rider.numel()])
        return cls(flat, reduced, summed, summed[-1])


def bucket_all_reduce(
    bucket: dist.GradBucket,
    world_size: int,
    rider: torch.Tensor | None = None,
    per_tensor: bool = False,
    carrier: Carrier | None = None,
) -> BucketAllReduce:
    """Issue `bucket`'s all-reduce on the default group (DDP's, averaged over its `world_size`), `rider`
    at its end, in `carrier` (made to fit the bucket and the rider). `per_tensor`: sum each gradient on
    its own, in an order that does not depend on the bucket."""
    target, counted = _stalled_or(None)
    if counted:
        _entered(Site.GRADIENTS)
    gradients = bucket.buffer()
    if per_tensor:
        # Each gradient at offset 0 of an all-reduce of its own (they are views into the bucket): a
        # ring all-reduce sums an element in an order that depends on its offset, and DDP buckets a
        # process's first step (a resumed one's) differently from its later ones.
        gradients.div_(world_size)
        summed = rider.to(gradients.device, copy=True) if rider is not None else None  # the bucket's device
        tensors = [*bucket.gradients(), *([summed] if summed is not None else [])]
        return BucketAllReduce(gradients, summed, [_issue([t], target) for t in tensors])
    if carrier is not None and rider is not None:
        # Averaged on its way into the carrier: one pass over the bucket, not two (a division in
        # place, then a copy), and the bucket keeps this rank's own gradient.
        torch.div(gradients, world_size, out=carrier.reduced)
        carrier.summed.copy_(rider)
        return BucketAllReduce(carrier.reduced, carrier.summed, [_issue([carrier.flat], target)])
    return BucketAllReduce(gradients.div_(world_size), None, [_issue([gradients], target)])


def _issue(
    tensors: list[torch.Tensor], group: dist.ProcessGroup | None, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
) -> dist.Work:
    """The process group's own all-reduce, as DDP's C++ hook calls it: dist.all_reduce's checks and
    logging cost a rank on a shared host 40 µs of CPU a call, a fifth of what the API adds to a step."""
    target = group or dist.group.WORLD
    assert target is not None
    return target.allreduce(tensors, _options(op))


@functools.cache
def _options(op: dist.ReduceOp.RedOpType) -> dist.AllreduceOptions:
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp(op)
    return options


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
