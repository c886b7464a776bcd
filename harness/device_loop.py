"""The built-in trainer's step on the device `stayalive.init_process_group()` names, for the accelerator's
test and bench.gpu: `torchrun --nproc-per-node N harness/device_loop.py --out DIR` (STAYALIVE_BACKEND
picks gloo or nccl). Outside a run, `Run` only counts the steps; the gradient all-reduce is the loop's own on
the default group. Each rank writes its device, its losses and a digest of its final weights."""

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

import stayalive
from stayalive.training.train import Trainer, parse_args

STEPS = 6

parser = argparse.ArgumentParser()
parser.add_argument("--out", type=Path, required=True)
args = parser.parse_args()
device = stayalive.init_process_group()
trainer = Trainer.from_args(parse_args(["--preset", "tiny", "--global-batch", "8"]), device)
run = stayalive.Run(trainer.model, trainer.optimizer, target_step=STEPS)
losses = [trainer.step(run, step) for step in run.steps()]
weights = torch.cat([p.detach().reshape(-1).cpu() for p in trainer.model.parameters()])
rank = dist.get_rank()
current = torch.cuda.current_device() if device.type == "cuda" else None
figures = {"device": str(device), "current": current, "losses": losses, "weights": weights.double().sum().item()}
(args.out / f"rank-{rank}.json").write_text(json.dumps(figures | {"local_rank": int(os.environ["LOCAL_RANK"])}))
dist.destroy_process_group()
