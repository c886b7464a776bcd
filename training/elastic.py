"""Changing a group without restarting its processes.

At a hold every rank has finished the same step and no collective is pending, so a survivor can
destroy its process group and join the next generation's in-process (gloo cannot abort a pending
collective, which is why a crash restarts ranks instead). A newcomer (a spare taking a drained
node's place) gets the live state from rank 0 rather than from storage.
"""

from __future__ import annotations

import json

import torch
from safetensors.torch import load, save

from stayalive.core.hangs import Site
from stayalive.training import collectives
from stayalive.training.state import TrainState, reseed


def state_from_rank0(state: TrainState, rank: int) -> None:
    """Every rank ends with rank 0's model, optimizer state and step; newcomers get fresh RNG streams."""
    if rank == 0:
        blob = save({name: t.detach().clone() for name, t in state.tensors().items()})  # clone: tied weights
        meta = json.dumps(
            {"step": state.step, "last_verified": state.last_verified, "param_groups": state.param_groups()}
        ).encode()
        sizes = torch.tensor([len(blob), len(meta)], dtype=torch.int64)
    else:
        sizes = torch.zeros(2, dtype=torch.int64)
    collectives.broadcast(sizes, 0, Site.HANDOVER)
    blob_size, meta_size = (int(s) for s in sizes)
    buffer = (
        torch.frombuffer(bytearray(blob + meta), dtype=torch.uint8)
        if rank == 0
        else torch.empty(blob_size + meta_size, dtype=torch.uint8)
    )
    collectives.broadcast(buffer, 0, Site.HANDOVER)
    if rank != 0:
        data = buffer.numpy().tobytes()
        described = json.loads(data[blob_size:])
        state.load(described["step"], described["param_groups"], load(data[:blob_size]))
        state.last_verified = described["last_verified"]
        reseed(state.step, rank)
