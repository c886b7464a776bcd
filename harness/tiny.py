"""The tiny GPT run that the tests and the benches start, and the state its checkpoints hold."""

from __future__ import annotations

from pathlib import Path

import torch

from stayalive.core.run.spec import RunSpec
from stayalive.core.run.status import CheckpointRecord
from stayalive.training.checkpoint import DCP_METADATA, read_dcp_manifest
from stayalive.training.dcp_load import load_dcp_metadata, load_dcp_tensors

# Ranks forked from a warm server take their first step within a second, and the tiny GPT's step is a
# few milliseconds of host work: 15 ms of simulated device time keeps a run long enough that a test
# acting "mid-run" (a kill at step 23, a drain, a pause) acts before the run has finished.
TINY_ENTRYPOINT = [
    "python",
    "-m",
    "stayalive.training.train",
    "--preset",
    "tiny",
    "--global-batch",
    "8",
    "--device-ms",
    "15",
]


def tiny_spec(checkpoint_root: Path, **overrides: object) -> RunSpec:
    """4 ranks of the tiny GPT on n1 and n2: a real run that finishes in seconds on two cores."""
    spec: dict[str, object] = {
        "name": "tiny",
        "world_size": 4,
        "ranks_per_node": 2,
        "nodes": ["n1", "n2"],
        "spare_nodes": ["n3"],
        "min_nodes": 2,  # keep the width: results compare bitwise with a run of the same world size
        "entrypoint": TINY_ENTRYPOINT,
        "target_step": 40,
        "checkpoint": {"root": str(checkpoint_root), "interval": "10 steps"},
    }
    return RunSpec.model_validate(spec | overrides)


REFERENCE_STEPS = 60  # the length of the reference run (tests/e2e/conftest.py) that interrupted runs compare with


def final_state(checkpoints: list[CheckpointRecord], step: int = REFERENCE_STEPS) -> dict[str, torch.Tensor]:
    """Model and optimizer tensors of the run's validated checkpoint of `step`, whole."""
    final = next(c for c in checkpoints if c.step == step and c.validated)
    return checkpoint_state(Path(final.path), step)


def checkpoint_state(directory: Path, step: int) -> dict[str, torch.Tensor]:
    """Model and optimizer tensors of the checkpoint of `step` at `directory` (DCP's files), whole."""
    assert read_dcp_manifest(directory).step == step
    tensors = load_dcp_tensors(directory, load_dcp_metadata((directory / DCP_METADATA).read_bytes()))
    return {name: t for name, t in tensors.items() if name.startswith(("model.", "optim."))}
