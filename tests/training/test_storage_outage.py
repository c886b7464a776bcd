"""The checkpoint writer through a storage outage: real files, real failures (the run's directory gone,
so every write under it fails with ENOENT; or a full disk, every write failing with ENOSPC), the
training thread never told. The checkpoints stay in host memory, the newest reaches storage once it
is back, and the one a restart would resume from is kept in memory meanwhile."""

from __future__ import annotations

import errno
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from stayalive.core.faults import DiskFull, Fault, StorageOutage
from stayalive.training.checkpoint import checkpoint_dirname, load_checkpoint
from stayalive.training.checkpointer import Checkpointer, Identity
from stayalive.training.faults import FaultInjector
from stayalive.training.memory import MemoryTier
from stayalive.training.state import TrainState
from tests.training.test_checkpoint_format import CONFIG, tiny_state

RUN = "outage/0000abcd"
OUTAGE_S = 1.5


class Rank:
    """One rank's writer, and what it told the rank: commits and outages."""

    def __init__(self, root: Path, rank: int, world_size: int, store: dist.Store, faults: list[Fault]) -> None:
        self.committed: list[int] = []
        self.outages: list[tuple[int, OSError]] = []
        self.tier = MemoryTier(
            directory=root / f"memory-{rank}", hub=f"127.0.0.1:{rank + 1}", replica_hub=None, token="no hub here"
        )
        self.writer = Checkpointer(
            root / "ckpt",
            rank=rank,
            world_size=world_size,
            store=store,
            identity=Identity(RUN, 0, "digest", CONFIG.model_dump(), 8),
            tier=self.tier,
            faults=FaultInjector(faults, rank, 0),
            on_commit=lambda manifest, path: self.committed.append(manifest.step),
            on_outage=lambda step, since, error: self.outages.append((step, error)),
        )

    def in_memory(self) -> list[str]:
        return sorted(p.name for p in (self.tier.directory / RUN).iterdir())


def at_step(state: TrainState, step: int) -> TrainState:
    state.step = step
    return state


@pytest.mark.parametrize(
    ("fault", "code"),
    [(StorageOutage(at_step=2, seconds=OUTAGE_S), errno.ENOENT), (DiskFull(at_step=2, seconds=OUTAGE_S), errno.ENOSPC)],
    ids=["unreachable", "disk_full"],
)
def test_training_goes_on_through_an_outage_and_the_newest_checkpoint_lands_once_storage_is_back(
    tmp_path: Path, fault: Fault, code: int
) -> None:
    rank = Rank(tmp_path, 0, 1, dist.HashStore(), [fault])
    state = tiny_state()
    rank.writer.save(at_step(state, 1))
    rank.writer.wait()
    assert rank.committed == [1]

    began = time.monotonic()
    for step in (2, 3, 4, 5):  # storage fails halfway through step 2's shard; the saves go on
        rank.writer.save(at_step(state, step))
        time.sleep(0.05)
    assert time.monotonic() - began < OUTAGE_S, "no save waited for storage"
    assert rank.committed == [1]
    [(step, error)] = rank.outages
    assert (step, error.errno) == (2, code), "told once, at the first failure, with the real error"
    # Memory holds the newest two and the one a restart would resume from (the newest on storage).
    assert rank.in_memory() == [checkpoint_dirname(s, 0) for s in (1, 4, 5)]

    rank.writer.wait()  # until storage is back and the newest checkpoint is on it
    assert time.monotonic() - began >= OUTAGE_S
    assert rank.committed == [1, 5], "steps 2-4 were superseded by the newer checkpoint"
    run_dir = tmp_path / "ckpt"
    assert sorted(p.name for p in run_dir.iterdir()) == [checkpoint_dirname(s, 0) for s in (1, 5)]
    manifest, tensors = load_checkpoint(run_dir / checkpoint_dirname(5, 0))
    original = tiny_state().tensors()
    assert manifest.step == 5 and all(torch.equal(original[name], tensors[name]) for name in original)


def test_a_checkpoint_other_ranks_counted_in_is_superseded_whole_and_its_partial_write_removed(tmp_path: Path) -> None:
    # Rank 1's storage fails during step 2; rank 0's does not, so step 2 holds rank 0's shard only.
    # Step 3 supersedes it on rank 1, commits, and takes step 2's partial directory away with it.
    store = dist.HashStore()
    ranks = [Rank(tmp_path, 0, 2, store, []), Rank(tmp_path, 1, 2, store, [DiskFull(at_step=2, seconds=OUTAGE_S)])]
    state = tiny_state()
    for step in (2, 3):
        for rank in ranks:
            rank.writer.save(at_step(state, step))
        time.sleep(0.2)
    for rank in ranks:
        rank.writer.wait()
    assert sorted(ranks[0].committed + ranks[1].committed) == [3]
    assert [s for s, _ in ranks[1].outages] == [2] and not ranks[0].outages
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [checkpoint_dirname(3, 0)]
