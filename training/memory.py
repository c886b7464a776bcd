"""The host-memory tier: checkpoint files kept in a node's RAM (tmpfs), outside the rank processes.

A rank writes its shard here before storage. The file outlives the rank, so a crashed rank's
replacement reads it back at memory speed, but not the host, so every shard also has a replica on
the node of rank (r − W/2) mod W, another failure domain (docs/architecture.md §8). A node agent serves its tier to
ranks on other hosts; ranks on the same host read it directly, and prune it after each checkpoint.

While storage is away the tier is the only copy of the checkpoints written since, and the newest
checkpoint known whole on storage (the one a restart resumes from: only those are validated) is
kept besides the newest KEEP, so that a restart during the outage reads it from here.

A rank learns its replica's agent from the generation's store (training/hub_names.py), and the
manifest records which agents hold each shard.
"""

from __future__ import annotations

import re
import shutil
import socket
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import structlog
from pydantic import ValidationError

from stayalive.core.messages.control import Refused
from stayalive.core.protocol.telemetry import FileHeader, GetFile, PutFile
from stayalive.training.checkpoint import CheckpointError, parse_checkpoint_dirname, within_root
from stayalive.training.hub_client import connect_hub

log = structlog.get_logger()

# Checkpoints per run kept in memory: the newest, and the one before it while the newest is validated.
KEEP = 2
_RUN = re.compile(r"^[a-z0-9][a-z0-9._-]*/[0-9a-f]{8}$")
_CHECKPOINT = re.compile(r"^step-\d{8}-g\d+$")
# DCP's files and the manifest (training/checkpoint.py).
_FILE = re.compile(r"^(__\d+_\d+\.distcp|\.metadata|manifest\.json)$")
_CHUNK = 1 << 22


@dataclass(frozen=True)
class MemoryTier:
    """This rank's view of the tier: its node's directory and agent, its replica's agent (None: same
    node), and its run's token, which any agent's tier takes for this run's files only."""

    directory: Path
    hub: str
    replica_hub: str | None
    token: str

    @property
    def holders(self) -> list[str]:
        """The agents that keep this rank's shard in memory, as its manifest entry lists them."""
        return [self.hub] if self.replica_hub is None else [self.hub, self.replica_hub]


def holder(rank: int, world_size: int) -> int:
    """The rank whose node keeps rank `rank`'s replica: rank r keeps the shard of r + W/2 (docs/architecture.md §8)."""
    return (rank - world_size // 2) % world_size


def memory_path(root: Path, run_id: str, checkpoint: str, file: str) -> Path:
    """Where a file lives in the tier; names arrive over the network, so each part is checked."""
    if not (_RUN.match(run_id) and _CHECKPOINT.match(checkpoint) and _FILE.match(file)):
        raise CheckpointError(f"refusing memory-tier path {run_id}/{checkpoint}/{file}: not a checkpoint file name")
    return within_root(root, root / run_id / checkpoint / file)


def prune(root: Path, run_id: str, also: Collection[str | None] = (), keep: int = KEEP) -> None:
    """Drop all but the newest `keep` checkpoints of the run, and those named in `also`."""
    run = root / run_id
    if run.is_dir():
        # Oldest first in the order they were written: by generation, then step (the generation after
        # a rollback writes lower steps than the one before it, and those are the newest).
        checkpoints = sorted(
            (d for d in run.iterdir() if _CHECKPOINT.match(d.name)),
            key=lambda d: parse_checkpoint_dirname(d.name)[::-1],
        )
        for stale in checkpoints[:-keep]:
            if stale.name not in also:
                shutil.rmtree(stale, ignore_errors=True)


def put(hub: str, token: str, run_id: str, checkpoint: str, path: Path) -> None:
    """Send a file to another node's tier (the replica), streaming it from this node's tier."""
    header = PutFile(run_id=run_id, checkpoint=checkpoint, file=path.name, size=path.stat().st_size)
    conn, reader = connect_hub(hub, header, token, timeout=60)
    with conn, open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            conn.sendall(chunk)
        conn.shutdown(socket.SHUT_WR)
        if answer := reader.read():  # the hub closes once the file is in place, and says nothing
            raise ConnectionError(f"{hub} did not keep {path.name}: {Refused.model_validate_json(answer).error}")


def fetch(hub: str, token: str, run_id: str, checkpoint: str, file: str) -> bytes | None:
    """A file from another node's tier, or None when that node does not hold it (or is gone: the
    address comes from a manifest, which may be older than the agent now at that port)."""
    try:
        conn, reader = connect_hub(hub, GetFile(run_id=run_id, checkpoint=checkpoint, file=file), token, timeout=10)
        with conn:
            line = reader.readline()
            if line.startswith(b'{"t":"refused"'):
                log.warning("memory tier refused this rank", hub=hub, error=Refused.model_validate_json(line).error)
                return None
            header = FileHeader.model_validate_json(line)
            if header.size < 0:
                return None
            data = reader.read(header.size)
            return data if len(data) == header.size else None
    except (OSError, ValidationError):
        return None
