"""Restore a checkpoint into a (possibly resized) group: each rank reads a share, one collective assembles it.

The manifest comes from the memory of a node that holds it (the committing node's, or its
replica's), broadcast by the lowest rank there, and from storage only when no node has it. The saved
world's shards are read round-robin by the new ranks (shard p by rank p mod W). Every rank prefers
the host-memory tier: its own node's tmpfs, then the node agents the manifest lists as holding that
shard (its writer's and its replica's); only when some shard is in none of them does the whole group
read from storage. So while storage is away, a checkpoint whose every shard survives in memory is
restored all the same. Each shard is checked against the manifest's SHA-256 wherever it came from;
then each is broadcast from its reader, so every rank ends with the whole replicated state.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import structlog
import torch
import torch.distributed as dist

from stayalive.core.hangs import Site
from stayalive.training import collectives, memory
from stayalive.training.checkpoint import (
    MANIFEST,
    CheckpointError,
    Manifest,
    parse_manifest,
    parse_shard,
    read_manifest,
)
from stayalive.training.memory import MemoryTier

log = structlog.get_logger()

Source = Literal["memory", "storage"]


@dataclass(frozen=True)
class Restored:
    manifest: Manifest
    tensors: dict[str, torch.Tensor]
    source: Source
    seconds: float


def _local(tier: MemoryTier, run_id: str, name: str, file: str) -> bytes | None:
    path = memory.memory_path(tier.directory, run_id, name, file)
    return path.read_bytes() if path.is_file() else None


def _verified(data: bytes | None, sha256: str) -> bytes | None:
    return data if data is not None and hashlib.sha256(data).hexdigest() == sha256 else None


def from_memory(
    tier: MemoryTier | None, run_id: str, name: str, file: str, sha256: str, hubs: list[str]
) -> bytes | None:
    """A checkpoint file from this node's tier, else from the agents that hold a copy (`hubs`); a
    copy that does not match `sha256` counts as none."""
    if tier is None:
        return None
    if (data := _verified(_local(tier, run_id, name, file), sha256)) is not None:
        return data
    for hub in hubs:
        if hub == tier.hub:
            continue  # that agent's tier is the directory just read
        if (data := _verified(memory.fetch(hub, tier.token, run_id, name, file), sha256)) is not None:
            return data
    return None


def manifest_bytes(
    directory: Path, tier: MemoryTier | None, run_id: str, rank: int, world_size: int, group: dist.ProcessGroup | None
) -> tuple[bytes, str] | None:
    """The committed manifest, from the lowest rank whose node keeps it in memory, to every rank of
    `group` (the default group, or one of every rank), and where it came from; None when no node
    has it (read it from storage)."""
    data = _local(tier, run_id, directory.name, MANIFEST) if tier is not None else None
    holder = torch.tensor([rank if data is not None else world_size])
    dist.all_reduce(holder, op=dist.ReduceOp.MIN, group=group)
    source = int(holder)
    if source == world_size:
        return None
    sent = data if rank == source else None
    size = torch.tensor([len(sent) if sent is not None else 0])
    dist.broadcast(size, src=source, group=group)
    buffer = (
        torch.frombuffer(bytearray(sent), dtype=torch.uint8)
        if sent is not None
        else torch.empty(int(size), dtype=torch.uint8)
    )
    dist.broadcast(buffer, src=source, group=group)
    return buffer.numpy().tobytes(), f"memory copy of {directory.name}/{MANIFEST}"


def _manifest(directory: Path, tier: MemoryTier | None, run_id: str, rank: int, world_size: int) -> Manifest:
    found = manifest_bytes(directory, tier, run_id, rank, world_size, group=None)
    return read_manifest(directory) if found is None else parse_manifest(*found)


def restore(directory: Path, run_id: str, rank: int, world_size: int, tier: MemoryTier | None) -> Restored:
    started = time.perf_counter()
    manifest = _manifest(directory, tier, run_id, rank, world_size)
    shards = {s.rank: s for s in manifest.shards}
    mine = [p for p in range(manifest.world_size) if p % world_size == rank]
    name = directory.name
    blobs = {p: from_memory(tier, run_id, name, shards[p].file, shards[p].sha256, shards[p].hubs) for p in mine}
    in_memory = torch.tensor([int(tier is not None and all(b is not None for b in blobs.values()))])
    collectives.all_reduce(in_memory, Site.RESTORE, op=dist.ReduceOp.MIN)  # all from memory, or all from storage
    source: Source = "memory" if int(in_memory) else "storage"
    if source == "storage":
        blobs = {p: _verified((directory / shards[p].file).read_bytes(), shards[p].sha256) for p in mine}
        if bad := [shards[p].file for p, b in blobs.items() if b is None]:
            raise CheckpointError(f"{directory.name}: {', '.join(bad)} do not match the manifest's SHA-256")
    tensors: dict[str, torch.Tensor] = {}
    for p in range(manifest.world_size):
        blob = blobs.get(p)
        buffer = (
            torch.frombuffer(bytearray(blob), dtype=torch.uint8)
            if blob is not None
            else torch.empty(shards[p].size, dtype=torch.uint8)
        )
        collectives.broadcast(buffer, p % world_size, Site.RESTORE)
        tensors.update(parse_shard(buffer.numpy().tobytes(), shards[p].file))
    seconds = time.perf_counter() - started
    log.info("restored", checkpoint=directory.name, source=source, seconds=round(seconds, 3))
    return Restored(manifest=manifest, tensors=tensors, source=source, seconds=seconds)
