"""The checkpoint format of the public training API: `torch.distributed.checkpoint` (DCP) files under
stayalive's manifest.

    <root>/<run>/step-00000400-g1/
        manifest.json        step, world size, every file's size and SHA-256 and the node agents that
                             hold it in host memory, the DCP keys with their shapes and dtypes
        .metadata            DCP's plan of where each tensor's chunks lie (written by rank 0)
        __0_0.distcp ...     each rank's share of the state, as DCP writes it (sharded or deduplicated),
                             and its own state under `ranks/<rank>/`: RNG streams, data loader position

DCP brings what a user's state needs: any nesting, FSDP2's DTensors, and loading at another world
size (resharded). stayalive adds what DCP lacks: the atomic commit, digests, the host-memory tier and
its replica, and loading that never runs code. DCP unpickles its `.metadata` and `torch.load`s
non-tensor values with `weights_only=False`; here every file is checked against the sealed manifest
first, `.metadata` goes through an unpickler that builds DCP's own metadata classes and nothing else,
and non-tensor values load with `weights_only=True`.
"""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import warnings
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed.checkpoint as dcp
from pydantic import BaseModel
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element  # what DefaultLoadPlanner.load_bytes uses
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from stayalive.training.checkpoint import CheckpointError, read_sealed, sha256_file

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
    return read_sealed(directory, DcpManifest)


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


# -- loading that runs no code ---------------------------------------------------------------------

_METADATA_MODULES = ("torch.distributed.checkpoint.", "torch.distributed._shard.")
_TORCH_CONSTANTS = (torch.dtype, torch.layout, torch.memory_format)
_BUILTINS = {"set", "frozenset", "tuple", "list", "dict", "slice", "bytes", "bytearray", "int", "float", "complex"}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata dataclasses, torch.Size, dtypes and plain containers; refuses any other
    global, which is how a pickle runs code."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = (
            module.startswith(_METADATA_MODULES)
            or (module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), _TORCH_CONSTANTS)))
            or (module == "torch.serialization" and name == "_get_layout")  # how torch.strided pickles
            or (module == "builtins" and name in _BUILTINS)
            or (module == "collections" and name == "OrderedDict")
            or (module == "enum" and name == "Enum")
            or (module == "pathlib" and name in {"PosixPath", "PurePosixPath"})  # StorageMeta.checkpoint_id
        )
        if not allowed:
            raise CheckpointError(f"{DCP_METADATA} names {module}.{name}, which a checkpoint's metadata never holds")
        return super().find_class(module, name)


def load_dcp_metadata(data: bytes) -> Metadata:
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except CheckpointError:
        raise
    except Exception as exc:  # any malformed pickle: it is refused, whatever the unpickler tripped on
        raise CheckpointError(f"{DCP_METADATA} is not DCP metadata ({exc}): use another checkpoint") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{DCP_METADATA} holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


class SafeReader(FileSystemReader):
    """DCP's file reader, with its metadata read by `_MetadataUnpickler`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = load_dcp_metadata((Path(self.path) / DCP_METADATA).read_bytes())
        storage_meta = metadata.storage_meta = metadata.storage_meta or StorageMeta()
        storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """DCP's planner, loading non-tensor values (optimizer hyperparameters, counters) with weights_only."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def tensor_entries(metadata: Metadata) -> dict[str, TensorEntry]:
    return {
        key: TensorEntry(shape=list(item.size), dtype=str(item.properties.dtype).removeprefix("torch."))
        for key, item in metadata.state_dict_metadata.items()
        if isinstance(item, TensorStorageMetadata)
    }


def load_dcp_tensors(directory: Path, metadata: Metadata) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint, whole, in this one process (no model, no group): what a
    validation or a comparison reads. Check the files against the manifest first (verify_files)."""
    tensors = {
        key: torch.empty(item.size, dtype=item.properties.dtype)
        for key, item in metadata.state_dict_metadata.items()
        if isinstance(item, TensorStorageMetadata)
    }
    with warnings.catch_warnings():  # no_dist=True: DCP warns that it loads in one process, as asked
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(tensors, storage_reader=SafeReader(directory), planner=SafePlanner(), no_dist=True)
    return tensors
