"""A run's own checkpoint check (CheckpointSpec.validation) for tests/training/api_loop.py's model:
load the checkpoint's weights into the model and run a forward pass.

    python tests/training/api_check.py [--reject-step N] <checkpoint directory>

Exit 0 accepts; otherwise the last line of stderr says why. `--reject-step` rejects that step's
checkpoint as if its forward pass had gone wrong (what a test needs to see a rejection honoured).
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reject-step", type=int)
    parser.add_argument("checkpoint", type=Path)
    args = parser.parse_args()
    step = json.loads((args.checkpoint / "manifest.json").read_text())["step"]
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=args.checkpoint, no_dist=True)
    model.load_state_dict(state["model"])
    output = model(torch.randn(8, 16, generator=torch.Generator().manual_seed(0)))
    if step == args.reject_step or not bool(torch.isfinite(output).all()):
        sys.exit(f"step {step}: the forward pass is not what this model should give")


if __name__ == "__main__":
    main()
