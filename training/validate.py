"""Test-load a checkpoint in a fresh process: `python -m training.validate DIR` prints one JSON verdict.

A fresh process, because the load must not borrow anything from the process that wrote it: the
model is rebuilt from the manifest's config, and every tensor must fit it exactly.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
from pydantic import BaseModel

from training.checkpoint import CheckpointError, load_checkpoint
from training.gpt import GPT, GPTConfig
from training.state import TrainState


class TestLoad(BaseModel):
    ok: bool
    problems: list[str] = []
    param_norm: float | None = None
    step: int | None = None


def test_load(directory: Path) -> TestLoad:
    try:
        manifest, tensors = load_checkpoint(directory)
        model = GPT(GPTConfig(**manifest.model))
        state = TrainState(model, torch.optim.AdamW(model.parameters()))
        state.restore(manifest, tensors)
    except (CheckpointError, RuntimeError, ValueError, KeyError) as exc:
        return TestLoad(ok=False, problems=[str(exc)])
    nonfinite = [n for n, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if nonfinite:
        return TestLoad(ok=False, problems=[f"non-finite values in {', '.join(nonfinite[:5])}"], step=manifest.step)
    norm = math.sqrt(sum(float(p.detach().double().pow(2).sum()) for p in model.parameters()))
    return TestLoad(ok=True, param_norm=norm, step=manifest.step)


if __name__ == "__main__":
    print(test_load(Path(sys.argv[1])).model_dump_json())
