"""Test-load checkpoints in a process of their own: `python -m stayalive.training.validate` reads one checkpoint
directory per line on stdin and answers one JSON verdict per line on stdout.

A separate process, because the load must not borrow anything from the process that wrote it: the
model is rebuilt from the manifest's config, and every tensor must fit it exactly. A long-lived one,
because importing torch for every checkpoint would cost more than loading it.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
from pydantic import BaseModel

from stayalive.training.checkpoint import CheckpointError, load_checkpoint
from stayalive.training.gpt import GPT, GPTConfig
from stayalive.training.state import TrainState


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
    except (CheckpointError, RuntimeError, ValueError, KeyError, OSError) as exc:
        return TestLoad(ok=False, problems=[str(exc)])
    nonfinite = [n for n, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if nonfinite:
        return TestLoad(ok=False, problems=[f"non-finite values in {', '.join(nonfinite[:5])}"], step=manifest.step)
    norm = math.sqrt(sum(float(p.detach().double().pow(2).sum()) for p in model.parameters()))
    return TestLoad(ok=True, param_norm=norm, step=manifest.step)


if __name__ == "__main__":
    torch.set_num_threads(1)
    for line in sys.stdin:
        print(test_load(Path(line.strip())).model_dump_json(), flush=True)
