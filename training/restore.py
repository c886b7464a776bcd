"""Restore a checkpoint into a (possibly resized) group: each rank reads a share, one collective assembles it.

The saved world's shards are read round-robin by the new ranks (shard p by rank p mod W). Every
rank prefers the host-memory tier (its own node's tmpfs, then the other nodes' agents, which hold
the replicas); only when some shard is in no node's memory does the whole group read from storage.
Each shard is checked against the manifest's SHA-256 wherever it came from; then each is broadcast
from its reader, so every rank ends with the whole replicated state.
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

from training import memory
from training.checkpoint import MANIFEST, CheckpointError, Manifest, parse_manifest, parse_shard, read_manifest
from training.checkpointer import MemoryTier

log = structlog.get_logger()

Source = Literal["memory", "storage"]


@dataclass(frozen=True)
class Restored:
    manifest: Manifest
    tensors: dict[str, torch.Tensor]
    source: Source
    seconds: float


def _from_memory(tier: MemoryTier | None, run_id: str, name: str, file: str) -> bytes | None:
    if tier is None:
        return None
    local = memory.memory_path(tier.directory, run_id, name, file)
    if local.is_file():
        return local.read_bytes()
    for hub in tier.hubs:
        if (data := memory.fetch(hub, run_id, name, file)) is not None:
            return data
    return None


def _manifest(directory: Path, tier: MemoryTier | None, run_id: str) -> Manifest:
    if tier is not None and (data := _from_memory(tier, run_id, directory.name, MANIFEST)) is not None:
        return parse_manifest(data, f"memory copy of {directory.name}/{MANIFEST}")
    return read_manifest(directory)


def _verified(data: bytes | None, sha256: str) -> bytes | None:
    return data if data is not None and hashlib.sha256(data).hexdigest() == sha256 else None


def restore(directory: Path, run_id: str, rank: int, world_size: int, tier: MemoryTier | None) -> Restored:
    started = time.perf_counter()
    manifest = _manifest(directory, tier, run_id)
    shards = {s.rank: s for s in manifest.shards}
    mine = [p for p in range(manifest.world_size) if p % world_size == rank]
    blobs = {p: _verified(_from_memory(tier, run_id, directory.name, shards[p].file), shards[p].sha256) for p in mine}
    in_memory = torch.tensor([int(tier is not None and all(b is not None for b in blobs.values()))])
    dist.all_reduce(in_memory, op=dist.ReduceOp.MIN)  # all from memory, or all from storage
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
        dist.broadcast(buffer, src=p % world_size)
        tensors.update(parse_shard(buffer.numpy().tobytes(), shards[p].file))
    seconds = time.perf_counter() - started
    log.info("restored", checkpoint=directory.name, source=source, seconds=round(seconds, 3))
    return Restored(manifest=manifest, tensors=tensors, source=source, seconds=seconds)
