"""Test-load checkpoints in a process of their own: `python -m stayalive.training.validate` reads one checkpoint
directory per line on stdin and answers one JSON verdict per line on stdout.

A separate process, because the load must not borrow anything from the process that wrote it. A
checkpoint (DCP's files and stayalive's manifest, training/checkpoint.py) needs no model to be
judged: the run's own check (CheckpointSpec.validation) can load it into one. A long-lived process,
because importing torch for every checkpoint would cost more than loading it.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from stayalive.core.decisions.checkpoints import TestLoad
from stayalive.training.checkpoint import DCP_METADATA, CheckpointError, read_dcp_manifest, verify_files
from stayalive.training.dcp_load import load_dcp_metadata, load_dcp_tensors, tensor_entries


def test_load(directory: Path) -> TestLoad:
    """Every file matches its digest, DCP's metadata lists what the manifest recorded, and every
    tensor reads back, finite, with its recorded shape and dtype."""
    try:
        manifest = read_dcp_manifest(directory)
        if problems := verify_files(directory, manifest):
            return TestLoad(ok=False, problems=problems, step=manifest.step)
        metadata = load_dcp_metadata((directory / DCP_METADATA).read_bytes())
        if (recorded := tensor_entries(metadata)) != manifest.tensors:
            differing = sorted(set(manifest.tensors) ^ set(recorded))[:5]
            problem = f"DCP metadata disagrees with the manifest on {differing}"
            return TestLoad(ok=False, problems=[problem], step=manifest.step)
        tensors = load_dcp_tensors(directory, metadata)
    except (CheckpointError, dcp.CheckpointException, RuntimeError, ValueError, KeyError, OSError) as exc:
        return TestLoad(ok=False, problems=[str(exc)])
    nonfinite = [n for n, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if nonfinite:
        return TestLoad(ok=False, problems=[f"non-finite values in {', '.join(nonfinite[:5])}"], step=manifest.step)
    weights = [t for n, t in tensors.items() if n.startswith("model.") and t.is_floating_point()]
    norm = math.sqrt(sum(float(t.double().pow(2).sum()) for t in weights))
    return TestLoad(ok=True, param_norm=norm, step=manifest.step)


if __name__ == "__main__":
    torch.set_num_threads(1)
    for line in sys.stdin:
        print(test_load(Path(line.strip())).model_dump_json(), flush=True)
