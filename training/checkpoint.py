"""Where checkpoints live and how their files land: directory names, the run's fence, atomic writes,
digests, and the sealed manifest a commit writes last (its format: training/dcp_format.py).

    <root>/<run>/step-00000400-g1/      one committed checkpoint: step 400, written by generation 1
        manifest.json                   written last, sealed by its own digest
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, Protocol, TypeVar, cast

from pydantic import BaseModel, ValidationError

from stayalive.core.fencing import FENCE_FILE, raised

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


def read_sealed(directory: Path, format: type[M]) -> M:
    """The committed manifest of `directory`, in `format`."""
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
