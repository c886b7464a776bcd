"""Reading a checkpoint's tensors without running its code (the format: training/checkpoint.py).

DCP brings what a user's state needs: any nesting, FSDP2's DTensors, and loading at another world
size (resharded). stayalive adds what DCP lacks: the atomic commit, digests, the host-memory tier and
its replica, and loading that never runs code. DCP unpickles its `.metadata` and `torch.load`s
non-tensor values with `weights_only=False`; here every file is checked against the sealed manifest
first (`verify_files`), `.metadata` goes through an unpickler that builds DCP's own metadata classes
and nothing else, and non-tensor values load with `weights_only=True`.
"""

from __future__ import annotations

import io
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element  # what DefaultLoadPlanner.load_bytes uses
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from stayalive.training.checkpoint import DCP_METADATA, CheckpointError, TensorEntry

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
