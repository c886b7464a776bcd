"""What an emulated run leaves on storage at a checkpoint step (sim/emulated_rank.py): a checkpoint as
stayalive's ranks commit one, so that the real keeper judges it as it judges a trained model's —
the manifest's digests, DCP's metadata against the manifest, a test load in the supervisor's
validator, the norm band. DCP's files of a small state, written by the run's rank 0 for the whole
world (the other ranks' records name no files), sealed by the manifest and renamed into place whole.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from stayalive.training.checkpoint import (
    DCP_METADATA,
    MANIFEST,
    DcpManifest,
    FileRecord,
    RankRecord,
    checkpoint_dirname,
    fsync_dir,
    sha256_file,
    write_atomically,
)
from stayalive.training.dcp_load import load_dcp_metadata, tensor_entries
from stayalive.training.supervision import SupervisionConfig

WEIGHTS = 64  # the emulated model: one tensor, the same at every step (its norm stays in the band)


def commit(config: SupervisionConfig, step: int, world_size: int) -> Path:
    """Write and commit the checkpoint of `step`; its directory. Blocking: run it off the event loop."""
    name = checkpoint_dirname(step, config.generation)
    final, staging = config.checkpoint_dir / name, config.checkpoint_dir / f".{name}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    config.checkpoint_dir.mkdir(parents=True, exist_ok=True)
    dcp.save({"model.weight": torch.ones(WEIGHTS)}, checkpoint_id=staging, no_dist=True)
    files = [
        FileRecord(file=path.name, rank=0, size=path.stat().st_size, sha256=sha256_file(path))
        for path in sorted(staging.iterdir())
    ]
    metadata = load_dcp_metadata((staging / DCP_METADATA).read_bytes())
    manifest = DcpManifest(
        run_id=config.run_id,
        step=step,
        generation=config.generation,
        world_size=world_size,
        config_digest=config.config_digest,
        created_at=time.time(),
        tensors=tensor_entries(metadata),
        ranks=[RankRecord(rank=r, files=files if r == 0 else [], blocking_s=0.0) for r in range(world_size)],
    ).sealed()
    write_atomically(staging / MANIFEST, manifest.model_dump_json().encode())
    os.rename(staging, final)
    fsync_dir(config.checkpoint_dir)
    return final
