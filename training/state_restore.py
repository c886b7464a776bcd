"""Restore a DCP checkpoint (training/checkpoint.py) into any world size, host memory first.

Every rank gathers the whole checkpoint in its node's host-memory tier: the files its node already
holds, the rest from the agents the manifest lists for them (their writer's and its replica's), each
checked against its SHA-256. Only when some rank cannot gather every file does the whole group read
from storage, after checking every digest there. DCP then reads from that directory whatever chunks
this rank's (possibly resharded) state needs, with `SafeReader`/`SafePlanner`: nothing is unpickled
that could run code.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import structlog
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from stayalive.core.judgement.hangs import Site
from stayalive.training import collectives, memory
from stayalive.training.checkpoint import (
    MANIFEST,
    CheckpointError,
    DcpManifest,
    parse_manifest,
    read_dcp_manifest,
    verify_files,
    write_atomically,
)
from stayalive.training.dcp_load import SafePlanner, SafeReader
from stayalive.training.memory import MemoryTier

log = structlog.get_logger()

Source = Literal["memory", "storage"]


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


@dataclass(frozen=True)
class RestoredState:
    manifest: DcpManifest
    state: dict[str, Any]  # what `state_for` gave, loaded: DCP sets non-tensor values in it, not in place
    source: Source
    seconds: float


def _gathered(tier: MemoryTier | None, run_id: str, directory: Path, manifest: DcpManifest) -> Path | None:
    """This node's tier directory of the checkpoint, completed with every file the manifest lists;
    None when some file is in no tier (or matches no digest)."""
    if tier is None:
        return None
    for record in manifest.files():
        local = memory.memory_path(tier.directory, run_id, directory.name, record.file)
        if local.is_file() and local.stat().st_size == record.size:
            continue  # written on this node: its digest is checked below, with the fetched ones
        data = from_memory(tier, run_id, directory.name, record.file, record.sha256, record.hubs)
        if data is None:
            return None
        local.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(local, data)  # ranks of a node may fetch the same file: each lands whole
    gathered = memory.memory_path(tier.directory, run_id, directory.name, manifest.files()[0].file).parent
    return gathered if not verify_files(gathered, manifest) else None


def restore_state(
    directory: Path,
    run_id: str,
    rank: int,
    world_size: int,
    tier: MemoryTier | None,
    group: dist.ProcessGroup,
    state_for: Callable[[DcpManifest], dict[str, Any]],
) -> RestoredState:
    """Load the checkpoint at `directory` in place into `state_for(manifest)` (every rank of `group`,
    which is every rank, calls this); raise CheckpointError for a checkpoint that must not be used."""
    started = time.perf_counter()
    found = manifest_bytes(directory, tier, run_id, rank, world_size, group)
    manifest = read_dcp_manifest(directory) if found is None else parse_manifest(*found)
    if manifest.run_id != run_id:
        raise CheckpointError(f"{directory.name} is run {manifest.run_id}'s, not {run_id}'s: resume from this run's")
    gathered = _gathered(tier, run_id, directory, manifest)
    in_memory = torch.tensor([int(gathered is not None)])
    collectives.all_reduce(in_memory, Site.RESTORE, op=dist.ReduceOp.MIN, group=group)
    source: Source = "memory" if int(in_memory) else "storage"
    if source == "storage":
        if problems := verify_files(directory, manifest):
            raise CheckpointError(f"{directory.name}: " + "; ".join(problems))
        gathered = directory
    assert gathered is not None
    state = state_for(manifest)
    try:
        dcp.load(state, storage_reader=SafeReader(gathered), planner=SafePlanner(), process_group=group)
    except dcp.CheckpointException as exc:  # a BaseException, raised on every rank: what SafeReader refused, say
        reasons = "; ".join(str(error) for error, _ in exc.failures.values())
        raise CheckpointError(f"{directory.name} does not load ({reasons}): use another checkpoint") from None
    seconds = time.perf_counter() - started
    log.info("restored", checkpoint=directory.name, source=source, seconds=round(seconds, 3))
    return RestoredState(manifest=manifest, state=state, source=source, seconds=seconds)


def agreed_checkpoint(known: Path | None, rank: int, world_size: int, group: dist.ProcessGroup) -> Path | None:
    """The checkpoint every rank resumes from: the one the lowest rank that names one names. After
    a hold only the survivors know it (the workflow names none for a generation they rejoin), and
    newcomers (a spare) know nothing."""
    mine = str(known or "").encode()
    lengths = torch.zeros(world_size, dtype=torch.int64)
    lengths[rank] = len(mine)
    dist.all_reduce(lengths, group=group)
    source = next((r for r in range(world_size) if lengths[r] > 0), None)
    if source is None:
        return None
    buffer = torch.zeros(int(lengths[source]), dtype=torch.uint8)
    if rank == source:
        buffer[:] = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
    dist.broadcast(buffer, src=source, group=group)
    agreed = buffer.numpy().tobytes()
    if mine and mine != agreed:
        log.warning("resuming from the group's checkpoint, not this rank's", own=mine.decode())
    return Path(agreed.decode())
