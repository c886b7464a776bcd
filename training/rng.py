"""Every random stream a rank draws from, as values `torch.load(weights_only=True)` reads back:
torch's (CPU and each CUDA device), numpy's global generator and Python's `random`."""

from __future__ import annotations

import hashlib
import random
from typing import Any

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    kind, keys, position, has_gauss, cached = np.random.get_state(legacy=True)
    assert not isinstance(keys, str)  # legacy=True: the MT19937 tuple
    version, internal, gauss_next = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, cached),
        "python": (version, list(internal), gauss_next),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    kind, keys, position, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, cached))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))


def reseed(step: int, rank: int) -> None:
    """A fresh, reproducible RNG stream for a rank that has no saved one (a newcomer, a wider world)."""
    seed = int.from_bytes(hashlib.blake2b(f"{step}:{rank}".encode(), digest_size=8).digest(), "little")
    random.seed(seed)
    torch.manual_seed(seed)
