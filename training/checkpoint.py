"""The checkpoint format: one directory per checkpoint, one safetensors shard per rank, a manifest.

    <root>/<run>/step-00000400-g1/
        manifest.json          step, world size, config digest, every shard's size, SHA-256 and
                               the node agents that hold it in host memory
        shard-00000.safetensors   rank 0's share of model + optimizer tensors, and rank 0's RNG
        shard-00001.safetensors   ...

Everything is a tensor or JSON: loading never unpickles, so a checkpoint cannot run code. The
tensors of the (replicated) model and optimizer are split across ranks by size, so every rank
writes a share in parallel, and any world size can load the whole state back.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, Literal, Protocol, TypeVar, cast

import torch
from pydantic import BaseModel, ValidationError
from safetensors import SafetensorError
from safetensors.torch import load

from stayalive.core.fencing import FENCE_FILE, raised

MANIFEST = "manifest.json"


class CheckpointError(Exception):
    """A checkpoint that must not be resumed from; the message says why and what to do."""


class ShardRecord(BaseModel):
    file: str
    rank: int
    size: int
    sha256: str
    tensors: int
    python_rng: tuple[int, list[int], float | None]  # random.getstate()
    blocking_s: float
    # The node agents whose host-memory tier holds a copy (the writer's, then its replica's), in the
    # order a restore asks them; empty without a tier and in manifests written before it was recorded.
    hubs: list[str] = []


class Manifest(BaseModel):
    format: Literal["stayalive-checkpoint/1"] = "stayalive-checkpoint/1"
    run_id: str
    step: int
    generation: int
    world_size: int
    config_digest: str
    created_at: float
    samples_consumed: int
    last_verified_step: int = 0  # the newest step at which an SDC check had passed when this was written
    model: dict[str, int]
    optimizer_param_groups: list[dict[str, object]]
    shards: list[ShardRecord]
    digest: str = ""

    def body_digest(self) -> str:
        # A shard without hubs is digested without the field: manifests sealed before it existed still verify.
        unlisted = {i: {"hubs"} for i, shard in enumerate(self.shards) if not shard.hubs}
        body = self.model_dump(exclude={"digest": True, "shards": unlisted})
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()

    def sealed(self) -> Manifest:
        return self.model_copy(update={"digest": self.body_digest()})


def checkpoint_dirname(step: int, generation: int) -> str:
    return f"step-{step:08d}-g{generation}"


def parse_checkpoint_dirname(name: str) -> tuple[int, int]:
    """`step-00000400-g1` → (400, 1): step and generation, as `checkpoint_dirname` wrote them."""
    step, generation = name.removeprefix("step-").split("-g")
    return int(step), int(generation)


def read_fence(directory: Path) -> int | None:
    """The run's fence (core/fencing.py): the newest generation launched; None where there is none."""
    try:
        return int((directory / FENCE_FILE).read_text())
    except (FileNotFoundError, ValueError):
        return None


def write_fence(directory: Path, generation: int) -> int:
    """Raise the run's fence to `generation` (never lower it); returns where it stands."""
    fence = raised(read_fence(directory), generation)
    write_atomically(directory / FENCE_FILE, str(fence).encode())
    return fence


def shard_filename(rank: int) -> str:
    return f"shard-{rank:05d}.safetensors"


def partition(sizes: dict[str, int], world_size: int) -> dict[str, int]:
    """Tensor name → writing rank: largest first onto the least-loaded rank, the same on every rank."""
    load = [0] * world_size
    owner: dict[str, int] = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owner[name] = rank
        load[rank] += sizes[name]
    return owner


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


class Sealed(Protocol):
    digest: str

    def body_digest(self) -> str: ...


M = TypeVar("M", bound=BaseModel)


def read_manifest(directory: Path) -> Manifest:
    return read_sealed(directory, Manifest)


def parse_manifest(data: bytes, where: str) -> Manifest:
    return parse_sealed(data, where, Manifest)


def read_sealed(directory: Path, format: type[M]) -> M:
    """The committed manifest of `directory`, in `format` (the built-in trainer's, or the public API's)."""
    path = directory / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{directory} has no {MANIFEST}: the write never committed; use an earlier checkpoint")
    return parse_sealed(path.read_bytes(), str(path), format)


def parse_sealed(data: bytes, where: str, format: type[M]) -> M:
    try:
        manifest = format.model_validate_json(data)
    except ValidationError as exc:
        raise CheckpointError(
            f"{where} is not a valid manifest ({exc.error_count()} errors): use another checkpoint"
        ) from None
    sealed = cast(Sealed, manifest)
    if sealed.digest != sealed.body_digest():
        raise CheckpointError(f"{where} was edited after it was written (digest mismatch): use another checkpoint")
    return manifest


def verify_shards(directory: Path, manifest: Manifest) -> list[str]:
    """Every shard present, with the size and SHA-256 the manifest promises. Returns the problems."""
    problems = []
    expected = {shard_filename(r) for r in range(manifest.world_size)}
    if {s.file for s in manifest.shards} != expected:
        problems.append(f"manifest lists {len(manifest.shards)} shards, expected one per rank of {manifest.world_size}")
    for shard in manifest.shards:
        path = directory / shard.file
        if not path.is_file():
            problems.append(f"{shard.file} is missing")
        elif (size := path.stat().st_size) != shard.size:
            problems.append(f"{shard.file} is {size} bytes, manifest says {shard.size} (truncated or overwritten)")
        elif sha256_file(path) != shard.sha256:
            problems.append(f"{shard.file} does not match its SHA-256 (corrupted on storage)")
    return problems


def parse_shard(data: bytes, name: str) -> dict[str, torch.Tensor]:
    """Tensors from a safetensors shard; anything else (a pickle, say) is refused, never unpickled."""
    try:
        return load(data)
    except (SafetensorError, ValueError) as exc:
        raise CheckpointError(
            f"{name} is not a safetensors shard ({exc}); stayalive never unpickles checkpoint payloads, "
            "so this file is refused: use another checkpoint"
        ) from None


def load_checkpoint(directory: Path) -> tuple[Manifest, dict[str, torch.Tensor]]:
    """Verify, then read every shard into one flat dict of tensors (names keep their shard's rank for RNG)."""
    manifest = read_manifest(directory)
    if problems := verify_shards(directory, manifest):
        raise CheckpointError(f"{directory.name}: " + "; ".join(problems))
    tensors: dict[str, torch.Tensor] = {}
    for shard in manifest.shards:
        tensors.update(parse_shard((directory / shard.file).read_bytes(), shard.file))
    return manifest, tensors
