"""The checkpoint format, as every part of stayalive reads it without torch: directory names, the
run's fence, atomic writes, digests, and the sealed manifest a commit writes last.

    <root>/<run>/step-00000400-g1/   one committed checkpoint: step 400, written by generation 1
        manifest.json        written last, sealed by its own digest: step, world size, every file's
                             size and SHA-256 and the node agents that hold it in host memory, the
                             state's tensors with their shapes and dtypes
        .metadata            DCP's plan of where each tensor's chunks lie (written by rank 0)
        __0_0.distcp ...     each rank's share of the state, as `torch.distributed.checkpoint` (DCP)
                             writes it (sharded or deduplicated), and its own state under
                             `ranks/<rank>/`: RNG streams, data loader position

Reading the tensors themselves is training/dcp_load.py's, which needs torch.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, Literal

from pydantic import BaseModel, ValidationError

from stayalive.core.decisions.fencing import FENCE_FILE, raised

MANIFEST = "manifest.json"


class CheckpointError(Exception):
    """A checkpoint that must not be resumed from; the message says why and what to do."""


def checkpoint_dirname(step: int, generation: int) -> str:
    return f"step-{step:08d}-g{generation}"


def parse_checkpoint_dirname(name: str) -> tuple[int, int]:
    """`step-00000400-g1` → (400, 1): step and generation, as `checkpoint_dirname` wrote them."""
    step, generation = name.removeprefix("step-").split("-g")
    return int(step), int(generation)


def read_fence(directory: Path) -> int | None:
    """The run's fence (core/decisions/fencing.py): the newest generation launched; None where there is none."""
    try:
        return int((directory / FENCE_FILE).read_text())
    except (FileNotFoundError, ValueError):
        return None


def write_fence(directory: Path, generation: int) -> int:
    """Raise the run's fence to `generation` (never lower it); returns where it stands."""
    fence = raised(read_fence(directory), generation)
    write_atomically(directory / FENCE_FILE, str(fence).encode())
    return fence


def within_root(root: str | Path, path: str | Path) -> Path:
    """Resolve `path` and refuse it unless it lies inside `root` (no `..`, no symlink escapes)."""
    base = Path(root).resolve()
    resolved = Path(path).resolve()
    if not resolved.is_relative_to(base):
        raise CheckpointError(
            f"{path} is outside the checkpoint root {base}: resume only from checkpoints this run wrote"
        )
    return resolved


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: Path, data: bytes, opened: Callable[[BinaryIO], None] = lambda _: None) -> None:
    """Write under a temporary name, fsync, rename: a reader sees the whole file or none of it.
    `opened` sees the file before it is written (where a storage fault is injected). The temporary
    name is the writer's own: two ranks of a node may land the same file at once."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        opened(f)
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


FORMAT: Literal["stayalive-dcp/1"] = "stayalive-dcp/1"
DCP_METADATA = ".metadata"


def dcp_file(rank: int) -> str:
    """The file DCP's FileSystemWriter writes `rank`'s share into (one file: one writer thread)."""
    return f"__{rank}_0.distcp"


class FileRecord(BaseModel):
    file: str
    rank: int  # the rank that wrote it
    size: int
    sha256: str
    hubs: list[str] = []  # node agents whose host-memory tier holds a copy, in the order a restore asks them


class RankRecord(BaseModel):
    rank: int
    files: list[FileRecord]
    blocking_s: float


class TensorEntry(BaseModel):
    """A tensor of the saved state as DCP recorded it: what a test load must read back."""

    shape: list[int]
    dtype: str


class DcpManifest(BaseModel):
    format: Literal["stayalive-dcp/1"] = FORMAT
    run_id: str
    step: int
    generation: int
    world_size: int
    config_digest: str
    created_at: float
    last_verified_step: int = 0
    tensors: dict[str, TensorEntry]
    ranks: list[RankRecord]
    digest: str = ""

    def body_digest(self) -> str:
        body = self.model_dump(exclude={"digest"})
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()

    def sealed(self) -> DcpManifest:
        return self.model_copy(update={"digest": self.body_digest()})

    def files(self) -> list[FileRecord]:
        return [f for r in self.ranks for f in r.files]

    @property
    def blocking_s(self) -> float:
        return max(r.blocking_s for r in self.ranks)


def read_dcp_manifest(directory: Path) -> DcpManifest:
    """The committed manifest of `directory`."""
    path = directory / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{directory} has no {MANIFEST}: the write never committed; use an earlier checkpoint")
    return parse_manifest(path.read_bytes(), str(path))


def parse_manifest(data: bytes, where: str) -> DcpManifest:
    try:
        manifest = DcpManifest.model_validate_json(data)
    except ValidationError as exc:
        raise CheckpointError(
            f"{where} is not a valid manifest ({exc.error_count()} errors): use another checkpoint"
        ) from None
    if manifest.digest != manifest.body_digest():
        raise CheckpointError(f"{where} was edited after it was written (digest mismatch): use another checkpoint")
    return manifest


def verify_files(directory: Path, manifest: DcpManifest) -> list[str]:
    """Every file present with the size and SHA-256 the manifest promises, and DCP's metadata among
    them, and every rank of the saved world accounted for. Returns the problems."""
    problems = []
    if sorted(r.rank for r in manifest.ranks) != list(range(manifest.world_size)):
        problems.append(f"manifest accounts for {len(manifest.ranks)} ranks of {manifest.world_size}")
    if DCP_METADATA not in {f.file for f in manifest.files()}:
        problems.append(f"manifest lists no {DCP_METADATA}: DCP cannot find the state's chunks")
    for record in manifest.files():
        path = directory / record.file
        if not path.is_file():
            problems.append(f"{record.file} is missing")
        elif (size := path.stat().st_size) != record.size:
            problems.append(f"{record.file} is {size} bytes, manifest says {record.size} (truncated or overwritten)")
        elif sha256_file(path) != record.sha256:
            problems.append(f"{record.file} does not match its SHA-256 (corrupted on storage)")
    return problems
