"""A plain torchrun training script: it imports nothing of stayalive.

    torchrun --nproc-per-node 2 examples/plain_ddp.py --steps 200 --checkpoint-dir /tmp/ckpt

Like any restartable torchrun script it saves its own checkpoints and, when started again,
resumes from the newest one. Under stayalive (spec `"hooks": false`) a crash restarts it the way
`torchrun --max-restarts` would.
"""

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--checkpoint-dir", type=Path, required=True)
    parser.add_argument("--checkpoint-every", type=int, default=20)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    args.checkpoint_dir.mkdir(parents=True, exist_ok=True)

    start = 0
    saved = sorted(args.checkpoint_dir.glob("step-*.pt"))
    if saved:
        state = torch.load(saved[-1], weights_only=True)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
        print(f"rank {rank}: resumed from {saved[-1].name}", flush=True)

    for step in range(start + 1, args.steps + 1):
        generator = torch.Generator().manual_seed(step * world + rank)
        x = torch.randn(16, 32, generator=generator)
        loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if rank == 0 and step % args.checkpoint_every == 0:
            tmp = args.checkpoint_dir / f".step-{step:06d}.pt.tmp"
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, tmp)
            os.replace(tmp, args.checkpoint_dir / f"step-{step:06d}.pt")
        dist.barrier()  # every rank has seen the checkpoint before anyone moves on
    print(f"rank {rank}: done at step {args.steps}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
