"""Checkpoints of the public API (DCP files under stayalive's manifest) in one process, on a real
single-rank gloo group and real files: a committed checkpoint restores bitwise, what was tampered
with never loads, a fenced-out generation commits nothing, and storage failing costs no step."""

from __future__ import annotations

import errno
import hashlib
import os
import pickle
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from stayalive.activities.checkpoints import validate
from stayalive.core.decisions.fencing import FENCE_FILE
from stayalive.core.run.faults import DiskFull, Fault, StorageOutage
from stayalive.training import validate as validation
from stayalive.training.checkpoint import (
    DCP_METADATA,
    MANIFEST,
    CheckpointError,
    checkpoint_dirname,
    dcp_file,
    parse_checkpoint_dirname,
    read_dcp_manifest,
    read_fence,
    within_root,
    write_fence,
)
from stayalive.training.commit import Committer
from stayalive.training.faults import FaultInjector
from stayalive.training.gpt import GPT, PRESETS, GPTConfig
from stayalive.training.memory import MemoryTier
from stayalive.training.state_checkpointer import StateCheckpointer
from stayalive.training.state_restore import RestoredState, restore_state

RUN = "state/0000abcd"
CONFIG = GPTConfig(vocab_size=20, **PRESETS["tiny"])
# Long enough that the four saves and step 5's write to host memory all fall inside it on a loaded
# host: at 1.5 s, step 5 had not reached memory by the half-way look on a loaded two-core suite run.
OUTAGE_S = 4.0


def trained(seed: int = 0) -> tuple[GPT, torch.optim.Optimizer]:
    """The tiny GPT and its AdamW one step in: moments and a step count to checkpoint."""
    torch.manual_seed(seed)
    model = GPT(CONFIG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 20, (2, PRESETS["tiny"]["block_size"]))
    model(x, x).sum().backward()
    optimizer.step()
    return model, optimizer


def state_of(model: GPT, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What a checkpoint holds, as the public API builds it (training/run.py)."""
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state}


def tensors_of(model: GPT, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of the model and the optimizer, flat: what bitwise equality compares."""
    flat = {f"model/{k}": v for k, v in model.state_dict().items()}
    for index, moments in optimizer.state_dict()["state"].items():
        flat |= {f"optim/{index}/{k}": torch.as_tensor(v) for k, v in moments.items()}
    return flat


class Writer:
    """One rank's real asynchronous writer of generation 0, and what it told the rank."""

    def __init__(
        self,
        directory: Path,
        group: dist.ProcessGroup,
        tier: MemoryTier | None = None,
        faults: list[Fault] | None = None,
        durable: str | None = None,
    ) -> None:
        self.committed: list[int] = []
        self.outages: list[tuple[int, OSError]] = []
        committer = Committer(directory, RUN, 0, dist.HashStore(), tier, FaultInjector(faults or [], 0, 0))
        self.checkpointer = StateCheckpointer(
            committer,
            rank=0,
            world_size=1,
            group=group,
            config_digest="digest",
            on_commit=lambda manifest, path: self.committed.append(manifest.step),
            on_outage=lambda step, since, error: self.outages.append((step, error)),
            durable=durable,
        )


def restore(checkpoint: Path, group: dist.ProcessGroup) -> tuple[RestoredState, dict[str, torch.Tensor]]:
    """Restore `checkpoint` into a fresh, differently seeded model and optimizer: how the restore went,
    and every tensor they hold once loaded."""
    model, optimizer = trained(seed=1)
    restored = restore_state(checkpoint, RUN, 0, 1, None, group, lambda manifest: state_of(model, optimizer))
    loaded = restored.state
    set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    return restored, tensors_of(model, optimizer)


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    assert [name for name in a if not torch.equal(a[name], b[name])] == []


@pytest.fixture
def committed(tmp_path: Path, group: dist.ProcessGroup) -> tuple[Path, float]:
    """A committed checkpoint of step 7, written by the real writer; and the seconds its save blocked."""
    writer = Writer(tmp_path / "ckpt", group)
    model, optimizer = trained()
    blocking = writer.checkpointer.save(7, lambda: state_of(model, optimizer))
    writer.checkpointer.wait()
    assert writer.committed == [7]
    checkpoint = tmp_path / "ckpt" / checkpoint_dirname(7, 0)
    assert sorted(p.name for p in checkpoint.parent.iterdir()) == [checkpoint.name], "no temporary left"
    return checkpoint, blocking


def test_a_committed_checkpoint_restores_bitwise(committed: tuple[Path, float], group: dist.ProcessGroup) -> None:
    checkpoint, _ = committed
    original, fresh = tensors_of(*trained()), tensors_of(*trained(seed=1))
    assert any(not torch.equal(original[name], fresh[name]) for name in original), "a restore that loads nothing fails"
    restored, tensors = restore(checkpoint, group)
    assert (restored.manifest.step, restored.manifest.world_size, restored.source) == (7, 1, "storage")
    assert_bitwise_equal(tensors, original)
    assert validation.test_load(checkpoint).ok


def test_the_manifest_carries_the_time_the_save_blocked(committed: tuple[Path, float]) -> None:
    """What the committed message reports (training/run.py) and the keeper files with its verdict."""
    checkpoint, blocking = committed
    assert 0 < read_dcp_manifest(checkpoint).blocking_s == blocking


def test_an_edited_manifest_is_refused(committed: tuple[Path, float], group: dist.ProcessGroup) -> None:
    checkpoint, _ = committed
    path = checkpoint / MANIFEST
    path.write_text(path.read_text().replace('"step": 7', '"step": 8'))
    with pytest.raises(CheckpointError, match="edited after it was written"):
        restore(checkpoint, group)


def test_a_flipped_byte_fails_its_digest_before_anything_loads(
    committed: tuple[Path, float], group: dist.ProcessGroup
) -> None:
    checkpoint, _ = committed
    data = bytearray((checkpoint / dcp_file(0)).read_bytes())
    data[len(data) // 2] ^= 0x01
    (checkpoint / dcp_file(0)).write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{dcp_file(0)} does not match its SHA-256"):
        restore(checkpoint, group)


class RunsACommand:
    """Unpickled, it runs `touch marker`: a command anyone can see ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_that_runs_code_is_refused_even_when_the_manifest_vouches_for_it(
    committed: tuple[Path, float], group: dist.ProcessGroup, tmp_path: Path
) -> None:
    """The attacker rewrote DCP's metadata as a pickle that runs a command, and fixed up the digests."""
    checkpoint, _ = committed
    marker = tmp_path / "the command ran"
    payload = pickle.dumps(RunsACommand(marker))
    (checkpoint / DCP_METADATA).write_bytes(payload)
    forged = read_dcp_manifest(checkpoint)
    [metadata] = [record for record in forged.files() if record.file == DCP_METADATA]
    metadata.size, metadata.sha256 = len(payload), hashlib.sha256(payload).hexdigest()
    (checkpoint / MANIFEST).write_text(forged.sealed().model_dump_json())
    with pytest.raises(CheckpointError, match=r"names (posix|os)\.system"):
        restore(checkpoint, group)
    verdict = validation.test_load(checkpoint)
    assert not verdict.ok and "system" in verdict.problems[0]
    assert not marker.exists()


def test_paths_outside_the_checkpoint_root_are_refused(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "run").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (root / "run" / "escape").symlink_to(tmp_path / "elsewhere")
    assert within_root(root, root / "run") == (root / "run").resolve()
    for outside in (root / ".." / "elsewhere", root / "run" / "escape", Path("/etc")):
        with pytest.raises(CheckpointError, match="outside the checkpoint root"):
            within_root(root, outside)


def test_a_generation_behind_the_fence_commits_nothing(tmp_path: Path, group: dist.ProcessGroup) -> None:
    """A node back from a partition still runs generation 0's ranks; the run has launched generation 1
    (the launch raised the fence): their checkpoint is not renamed into place, nor announced."""
    directory = tmp_path / "ckpt"
    directory.mkdir()
    write_fence(directory, 1)
    writer = Writer(directory, group, durable=checkpoint_dirname(0, 0))
    model, optimizer = trained()
    writer.checkpointer.save(7, lambda: state_of(model, optimizer))
    writer.checkpointer.wait()
    assert writer.committed == []
    assert sorted(p.name for p in directory.iterdir()) == [FENCE_FILE], "nothing of generation 0 is left"
    assert read_fence(directory) == 1 and write_fence(directory, 0) == 1, "an older launch does not lower it"


async def test_the_keeper_refuses_a_checkpoint_behind_the_fence(committed: tuple[Path, float]) -> None:
    """Committed before the fence rose past its generation (or by a writer that did not look): not the run's."""
    checkpoint, _ = committed
    root = str(checkpoint.parent.parent)
    first = await validate(root, str(checkpoint), None, heartbeat=lambda: None)
    assert first is not None and first.validated
    write_fence(checkpoint.parent, 1)
    verdict = await validate(root, str(checkpoint), None, heartbeat=lambda: None)
    assert verdict is not None and not verdict.validated
    assert verdict.reason == "fenced out: written by generation 0 after generation 1 was launched"


@pytest.mark.parametrize(
    ("fault", "code"),
    [(StorageOutage(at_step=2, seconds=OUTAGE_S), errno.ENOENT), (DiskFull(at_step=2, seconds=OUTAGE_S), errno.ENOSPC)],
    ids=["unreachable", "disk_full"],
)
def test_training_goes_on_through_an_outage_and_the_newest_checkpoint_lands_once_storage_is_back(
    tmp_path: Path, group: dist.ProcessGroup, fault: Fault, code: int
) -> None:
    """Storage fails halfway through step 2's file (the run's directory gone: ENOENT; or full: ENOSPC)."""
    tier = MemoryTier(directory=tmp_path / "memory", hub="127.0.0.1:1", replica_hub=None, token="no hub here")
    writer = Writer(tmp_path / "ckpt", group, tier=tier, faults=[fault])
    model, optimizer = trained()
    state = state_of(model, optimizer)
    writer.checkpointer.save(1, lambda: state)
    writer.checkpointer.wait()
    assert writer.committed == [1]

    began = time.monotonic()
    for step in (2, 3, 4, 5):
        writer.checkpointer.save(step, lambda: state)
        time.sleep(0.05)
    assert time.monotonic() - began < OUTAGE_S, "no save waited for storage"
    assert writer.committed == [1]
    [(step, error)] = writer.outages
    assert (step, error.errno) == (2, code), "told once, at the first failure, with the real error"

    # Memory holds the newest two and the one a restart would resume from (the newest on storage), and
    # of the others at most step 3: storage was still being tried with it when step 5 pruned the tier.
    def in_memory() -> set[int]:
        return {parse_checkpoint_dirname(p.name)[0] for p in (tier.directory / RUN).iterdir()}

    while 5 not in in_memory() and time.monotonic() - began < OUTAGE_S / 2:
        time.sleep(0.01)  # step 5's write to memory follows step 4's (one write at a time)
    assert {1, 4, 5} <= in_memory() <= {1, 3, 4, 5}

    writer.checkpointer.wait()  # until storage is back and the newest checkpoint is on it
    assert time.monotonic() - began >= OUTAGE_S
    assert writer.committed == [1, 5], "steps 2-4 were superseded by the newer checkpoint"
    run_dir = tmp_path / "ckpt"
    assert sorted(p.name for p in run_dir.iterdir()) == [checkpoint_dirname(s, 0) for s in (1, 5)]
    restored, tensors = restore(run_dir / checkpoint_dirname(5, 0), group)
    assert restored.manifest.step == 5
    assert_bitwise_equal(tensors, tensors_of(*trained()))
