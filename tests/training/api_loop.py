"""A user's DDP training loop with the public API's few lines (`stayalive.Run`), for the API's tests.

    torchrun --nproc-per-node 2 tests/training/api_loop.py --out final.pt [--fsdp]

Its data comes from a loader object with `state_dict`/`load_state_dict` (as torchdata's
StatefulDataLoader has): each rank draws its own samples, so only a restored position repeats none.
Every step appends `step rank samples` to --samples, and the last step's weights go to --out. The
step hands its forward and backward to the API for the SDC self-check's replay.
"""

import argparse
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import stayalive


class Loader:
    """Samples 0..size-1 in an order shuffled per epoch, this rank's stride of them, `batch` at a time."""

    def __init__(self, size: int, batch: int, rank: int, world: int) -> None:
        self.size, self.batch, self.rank, self.world = size, batch, rank, world
        self.epoch, self.position = 0, 0

    def next(self) -> list[int]:
        order = torch.randperm(self.size, generator=torch.Generator().manual_seed(self.epoch))
        mine = order[self.rank :: self.world].tolist()
        if self.position + self.batch > len(mine):
            self.epoch, self.position = self.epoch + 1, 0
            return self.next()
        taken = mine[self.position : self.position + self.batch]
        self.position += self.batch
        return taken

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.position = state["epoch"], state["position"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--samples", type=Path)
    parser.add_argument("--fsdp", action="store_true")
    parser.add_argument("--manual", action="store_true", help="no DDP: the loop all-reduces through the API")
    parser.add_argument(
        "--any-rank",
        action="store_true",
        help="noise from (step, rank) alone, so that any rank can replay any rank's micro-batch (the SDC "
        "cross-rank check); by default it comes from each rank's RNG streams, which a resume must restore",
    )
    parser.add_argument(
        "--in-place", action="store_true", help="with --manual: a held rank rejoins the next generation in its process"
    )
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP's gradient bucket size")
    parser.add_argument(
        "--bucket-sums", action="store_true", help="DDP's bucket sums, not the API's exact per-tensor ones"
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--step-ms", type=float, default=0.0, help="accelerator time to add to every step")
    parser.add_argument(
        "--hold",
        nargs=2,
        metavar=("STEP", "FILE"),
        help="before STEP, wait until FILE exists: a test's way to keep the ranks training at a known step",
    )
    args = parser.parse_args()

    dist.init_process_group("gloo")
    torch.set_num_threads(1)  # as torchrun's OMP_NUM_THREADS=1: the same reduction order under any launcher
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    random.seed(rank)
    np.random.seed(rank)
    inputs = torch.randn(256, 16)
    targets = inputs.sum(dim=1, keepdim=True)
    layers = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    model: torch.nn.Module
    if args.fsdp:
        for layer in layers:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(layers)
        model = layers
    elif args.manual:
        model = layers
    else:
        model = DistributedDataParallel(layers, bucket_cap_mb=args.bucket_cap_mb)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = Loader(len(inputs), 8, rank, world)

    exact = not args.bucket_sums
    run = stayalive.Run(
        model, optimizer, dataloader=loader, target_step=args.steps, exact_resume=exact, rejoin_in_place=args.in_place
    )
    for step in run.steps():
        if args.hold and step == int(args.hold[0]):
            while not Path(args.hold[1]).exists():
                time.sleep(0.05)
        rank, world = run.rank, run.world_size  # another place in another group, once rejoined in place
        loader.rank, loader.world = rank, world
        before = loader.state_dict()
        samples = loader.next()
        noise = 0.01 * torch.randn(len(samples), 1) + 0.01 * random.random() + 0.01 * float(np.random.rand())

        def samples_of(other: int, before: dict[str, Any] = before, world: int = world) -> list[int]:
            theirs = Loader(len(inputs), 8, other, world)
            theirs.load_state_dict(before)
            return theirs.next()

        def noise_of(other: int, step: int = step) -> torch.Tensor:
            return 0.01 * torch.randn(8, 1, generator=torch.Generator().manual_seed(step * 100 + other))

        if args.any_rank:
            noise = noise_of(rank)

        def forward(samples: list[int] = samples, noise: torch.Tensor = noise) -> torch.Tensor:
            return (model(inputs[samples]) - targets[samples] - noise).pow(2).mean()

        optimizer.zero_grad()
        loss = forward()
        loss.backward()
        if args.manual:
            run.all_reduce_gradients(model.parameters())
        if args.any_rank:  # the SDC checks' replays: of this rank's step, or of any rank's
            run.replay_with(of_rank=lambda other: forward(samples_of(other), noise_of(other)).backward())
        else:
            run.replay_with(lambda: forward().backward())
        optimizer.step()
        time.sleep(args.step_ms / 1000)
        run.record(loss, samples=samples)
        if args.samples is not None:
            with open(args.samples, "a") as f:
                f.write(f"{step} {rank} {' '.join(map(str, samples))}\n")

    weights = {name: t.full_tensor() if hasattr(t, "full_tensor") else t for name, t in model.state_dict().items()}
    if rank == 0:
        torch.save({k.removeprefix("module."): v.detach().clone() for k, v in weights.items()}, args.out)


if __name__ == "__main__":
    main()
    # Everything is on disk: leave without destroying the group or the interpreter's teardown. With
    # the DDP model still alive, torch 2.13's gloo now and then deadlocks in ~ProcessGroupGloo (a
    # plain run hung there once after writing its weights), and in the teardown it now and then
    # aborts ("terminate called without an active exception") after an FSDP2 run, which torchrun
    # would report as a failed rank.
    sys.stdout.flush()
    os._exit(0)
