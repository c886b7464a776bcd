"""The explicit training state: what a checkpoint holds, as flat named tensors plus JSON.

Model and optimizer tensors are the same on every rank (data parallel); RNG state is per rank.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

import torch

from stayalive.training.checkpoint import Manifest


def _json_safe(value: object) -> object:
    return list(value) if isinstance(value, tuple) else value


@dataclass
class TrainState:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    step: int = 0
    last_verified: int = 0  # the newest step at which an SDC check passed: how far back this state is trusted

    def tensors(self) -> dict[str, torch.Tensor]:
        flat = {f"model/{name}": t for name, t in self.model.state_dict().items()}
        for index, per_param in self.optimizer.state_dict()["state"].items():
            for key, value in per_param.items():
                flat[f"optim/{index}/{key}"] = value
        return flat

    def param_groups(self) -> list[dict[str, object]]:
        return [{k: _json_safe(v) for k, v in g.items()} for g in self.optimizer.state_dict()["param_groups"]]

    def restore(self, manifest: Manifest, tensors: dict[str, torch.Tensor]) -> None:
        self.load(manifest.step, manifest.optimizer_param_groups, tensors)
        self.last_verified = manifest.last_verified_step

    def load(self, step: int, param_groups: list[dict[str, object]], tensors: dict[str, torch.Tensor]) -> None:
        model = {name.removeprefix("model/"): t for name, t in tensors.items() if name.startswith("model/")}
        self.model.load_state_dict(model, strict=True)
        optim: dict[int, dict[str, torch.Tensor]] = {}
        for name, t in tensors.items():
            if name.startswith("optim/"):
                _, index, key = name.split("/", 2)
                optim.setdefault(int(index), {})[key] = t
        self.optimizer.load_state_dict({"state": optim, "param_groups": param_groups})
        self.step = step


def rng_tensors(rank: int) -> dict[str, torch.Tensor]:
    tensors = {f"rng/{rank}/torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for device, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng/{rank}/cuda/{device}"] = state
    return tensors


def python_rng() -> tuple[int, list[int], float | None]:
    version, internal, gauss_next = random.getstate()
    return version, list(internal), gauss_next


def reseed(step: int, rank: int) -> None:
    """A fresh, reproducible RNG stream for a rank that has no saved one (a newcomer, a wider world)."""
    seed = int.from_bytes(hashlib.blake2b(f"{step}:{rank}".encode(), digest_size=8).digest(), "little")
    random.seed(seed)
    torch.manual_seed(seed)


def restore_rng(manifest: Manifest, tensors: dict[str, torch.Tensor], rank: int) -> None:
    """Restore this rank's RNG streams; a rank the checkpoint did not have gets a fresh, reproducible seed."""
    if (state := tensors.get(f"rng/{rank}/torch")) is None:
        reseed(manifest.step, rank)
        return
    torch.set_rng_state(state)
    if torch.cuda.is_available():
        cuda = [tensors[f"rng/{rank}/cuda/{d}"] for d in range(torch.cuda.device_count())]
        torch.cuda.set_rng_state_all(cuda)
    shard = next(s for s in manifest.shards if s.rank == rank)
    version, internal, gauss_next = shard.python_rng
    random.setstate((version, tuple(internal), gauss_next))
