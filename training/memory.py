"""The host-memory tier: checkpoint files kept in a node's RAM (tmpfs), outside the rank processes.

A rank writes its shard here before storage. The file outlives the rank, so a crashed rank's
replacement reads it back at memory speed, but not the host, so every shard also has a replica on
the node of rank (r − W/2) mod W, another failure domain (seed R1). A node agent serves its tier to
ranks on other hosts; ranks on the same host read it directly.
"""

from __future__ import annotations

import re
import shutil
import socket
from pathlib import Path

from core.telemetry import FileHeader, GetFile, PutFile
from training.checkpoint import CheckpointError, parse_checkpoint_dirname, within_root

# Checkpoints per run kept in memory: the newest, and the one before it while the newest is validated.
KEEP = 2
_RUN = re.compile(r"^[a-z0-9][a-z0-9._-]*/[0-9a-f]{8}$")
_CHECKPOINT = re.compile(r"^step-\d{8}-g\d+$")
_FILE = re.compile(r"^(shard-\d{5}\.safetensors|manifest\.json)$")
_CHUNK = 1 << 22


def holder(rank: int, world_size: int) -> int:
    """The rank whose node keeps rank `rank`'s replica: rank r keeps the shard of r + W/2 (seed R1)."""
    return (rank - world_size // 2) % world_size


def memory_path(root: Path, run_id: str, checkpoint: str, file: str) -> Path:
    """Where a file lives in the tier; names arrive over the network, so each part is checked."""
    if not (_RUN.match(run_id) and _CHECKPOINT.match(checkpoint) and _FILE.match(file)):
        raise CheckpointError(f"refusing memory-tier path {run_id}/{checkpoint}/{file}: not a checkpoint file name")
    return within_root(root, root / run_id / checkpoint / file)


def prune(root: Path, run_id: str, keep: int = KEEP) -> None:
    run = root / run_id
    if run.is_dir():
        # Oldest first in the order they were written: by generation, then step (the generation after
        # a rollback writes lower steps than the one before it, and those are the newest).
        checkpoints = sorted(
            (d for d in run.iterdir() if _CHECKPOINT.match(d.name)),
            key=lambda d: parse_checkpoint_dirname(d.name)[::-1],
        )
        for stale in checkpoints[:-keep]:
            shutil.rmtree(stale, ignore_errors=True)


def put(hub: str, run_id: str, checkpoint: str, path: Path) -> None:
    """Send a file to another node's tier (the replica), streaming it from this node's tier."""
    host, port = hub.rsplit(":", 1)
    header = PutFile(run_id=run_id, checkpoint=checkpoint, file=path.name, size=path.stat().st_size)
    with socket.create_connection((host, int(port)), timeout=60) as conn, open(path, "rb") as f:
        conn.sendall(header.model_dump_json().encode() + b"\n")
        while chunk := f.read(_CHUNK):
            conn.sendall(chunk)
        conn.shutdown(socket.SHUT_WR)
        conn.recv(1)  # the hub closes once the file is in place


def fetch(hub: str, run_id: str, checkpoint: str, file: str) -> bytes | None:
    """A file from another node's tier, or None when that node does not hold it (or is gone)."""
    host, port = hub.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=10) as conn:
            conn.sendall(GetFile(run_id=run_id, checkpoint=checkpoint, file=file).model_dump_json().encode() + b"\n")
            reader = conn.makefile("rb")
            header = FileHeader.model_validate_json(reader.readline())
            if header.size < 0:
                return None
            data = reader.read(header.size)
            return data if len(data) == header.size else None
    except OSError:
        return None
