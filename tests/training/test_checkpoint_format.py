"""The checkpoint format on its own: atomic commit, digests, safe loading, confinement to the root."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from stayalive.activities.checkpoints import validate
from stayalive.core.fencing import FENCE_FILE
from stayalive.core.telemetry import CheckpointCommitted
from stayalive.training.checkpoint import (
    MANIFEST,
    CheckpointError,
    load_checkpoint,
    partition,
    read_fence,
    read_manifest,
    shard_filename,
    verify_shards,
    within_root,
    write_fence,
)
from stayalive.training.checkpointer import Checkpointer, Identity
from stayalive.training.faults import FaultInjector
from stayalive.training.gpt import GPT, PRESETS, GPTConfig
from stayalive.training.state import TrainState
from stayalive.training.validate import test_load as load_for_validation

CONFIG = GPTConfig(vocab_size=20, **PRESETS["tiny"])


def tiny_state() -> TrainState:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 20, (2, PRESETS["tiny"]["block_size"]))
    model(x, x).sum().backward()
    optimizer.step()
    return TrainState(model, optimizer, step=7)


def single_rank_writer(directory: Path, committed: list[Path], durable: str | None = None) -> Checkpointer:
    """The real asynchronous writer of one rank of generation 0, telling `committed` what it commits."""
    return Checkpointer(
        directory,
        rank=0,
        world_size=1,
        store=dist.HashStore(),
        identity=Identity("test/0000abcd", 0, "digest", CONFIG.model_dump(), 8),
        tier=None,
        faults=FaultInjector([], 0, 0),
        on_commit=lambda manifest, path: committed.append(path),
        durable=durable,
    )


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    """A committed single-rank checkpoint of the tiny GPT, written by the real asynchronous writer."""
    committed: list[Path] = []
    writer = single_rank_writer(tmp_path / "ckpt", committed)
    writer.save(tiny_state())
    writer.wait()
    assert committed and not list((tmp_path / "ckpt").glob(".*")), "no temporary left once committed"
    return committed[0]


def test_partition_is_deterministic_balanced_and_complete() -> None:
    sizes = {f"t{i}": (i * 7919) % 1000 + 1 for i in range(50)}
    owner = partition(sizes, 4)
    assert owner == partition(dict(reversed(list(sizes.items()))), 4)
    loads = [sum(s for n, s in sizes.items() if owner[n] == r) for r in range(4)]
    assert set(owner.values()) == {0, 1, 2, 3}
    assert max(loads) - min(loads) <= max(sizes.values())


def test_a_committed_checkpoint_loads_back_bitwise(checkpoint: Path) -> None:
    manifest, tensors = load_checkpoint(checkpoint)
    assert manifest.step == 7 and manifest.world_size == 1
    original = tiny_state().tensors()
    assert all(torch.equal(original[name], tensors[name]) for name in original)
    assert load_for_validation(checkpoint).ok


def test_an_edited_manifest_is_refused(checkpoint: Path) -> None:
    path = checkpoint / MANIFEST
    path.write_text(path.read_text().replace('"step": 7', '"step": 8'))
    with pytest.raises(CheckpointError, match="edited after it was written"):
        read_manifest(checkpoint)


def test_a_flipped_byte_fails_its_digest(checkpoint: Path) -> None:
    shard = checkpoint / shard_filename(0)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    assert verify_shards(checkpoint, read_manifest(checkpoint)) == [
        f"{shard.name} does not match its SHA-256 (corrupted on storage)"
    ]


def test_a_pickled_callable_is_refused_even_when_the_manifest_vouches_for_it(checkpoint: Path) -> None:
    """The attacker rewrote the shard as a pickle that would run a command, and fixed up the digests."""
    shard = checkpoint / shard_filename(0)
    payload = pickle.dumps({"model/wte.weight": os.system})
    shard.write_bytes(payload)
    manifest = read_manifest(checkpoint)
    forged = manifest.model_copy(
        update={
            "shards": [
                s.model_copy(update={"size": len(payload), "sha256": hashlib.sha256(payload).hexdigest()})
                for s in manifest.shards
            ]
        }
    ).sealed()
    (checkpoint / MANIFEST).write_text(forged.model_dump_json())
    with pytest.raises(CheckpointError, match="never unpickles"):
        load_checkpoint(checkpoint)
    verdict = load_for_validation(checkpoint)
    assert not verdict.ok and "never unpickles" in verdict.problems[0]


def test_paths_outside_the_checkpoint_root_are_refused(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "run").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (root / "run" / "escape").symlink_to(tmp_path / "elsewhere")
    assert within_root(root, root / "run") == (root / "run").resolve()
    for outside in (root / ".." / "elsewhere", root / "run" / "escape", Path("/etc")):
        with pytest.raises(CheckpointError, match="outside the checkpoint root"):
            within_root(root, outside)


def test_committed_messages_carry_the_blocking_time() -> None:
    message = CheckpointCommitted(rank=0, generation=0, step=5, path="/x", blocking_s=0.25)
    assert message.blocking_s == 0.25


def test_a_manifest_written_before_shards_listed_their_hubs_still_loads(checkpoint: Path) -> None:
    path = checkpoint / MANIFEST
    body = json.loads(path.read_text())
    for shard in body["shards"]:
        del shard["hubs"]
    path.write_text(json.dumps(body))
    assert [shard.hubs for shard in read_manifest(checkpoint).shards] == [[]]


def test_a_generation_behind_the_fence_commits_nothing(tmp_path: Path) -> None:
    """A node back from a partition still runs generation 0's ranks; the run has launched generation 1
    (the launch raised the fence): their checkpoint is not renamed into place, nor announced."""
    directory = tmp_path / "ckpt"
    directory.mkdir()
    write_fence(directory, 1)
    committed: list[Path] = []
    writer = single_rank_writer(directory, committed, durable="step-00000000-g0")
    writer.save(tiny_state())
    writer.wait()
    assert committed == []
    assert sorted(p.name for p in directory.iterdir()) == [FENCE_FILE], "nothing of generation 0 is left"
    assert read_fence(directory) == 1 and write_fence(directory, 0) == 1, "an older launch does not lower it"


async def test_the_keeper_refuses_a_checkpoint_behind_the_fence(checkpoint: Path) -> None:
    """Committed before the fence rose past its generation (or by a writer that did not look): not the run's."""
    first = await validate(str(checkpoint.parent.parent), str(checkpoint), None, heartbeat=lambda: None)
    assert first is not None and first.validated
    write_fence(checkpoint.parent, 1)
    verdict = await validate(str(checkpoint.parent.parent), str(checkpoint), None, heartbeat=lambda: None)
    assert verdict is not None and not verdict.validated
    assert verdict.reason == "fenced out: written by generation 0 after generation 1 was launched"
