"""Train the small GPT under stayalive: `python -m stayalive.training.train --preset small`.

The built-in trainer is a user of the public training API (`stayalive.Run`, training/run.py) like
any other loop: the checkpoints, commands, hang counts and SDC checks it gets are the ones a user's
loop gets.

Data parallel with one explicit gradient all-reduce per step (`run.all_reduce_gradients`), not
DistributedDataParallel: DDP overlaps its bucketed all-reduces with backward, which hides where a
rank's compute ends (the straggler signal, docs/architecture.md §9), and re-buckets after the first step (changing
the summation layout, so a resumed run would not be bitwise equal to an uninterrupted one). Bound to
no process group of its own, a held rank rejoins the next generation in place.

Every sample's loss is divided by the global batch, whoever computes it, so the summed gradient is
the global mean however the batch is split among ranks (evenly, or by speed once rebalanced).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import stayalive
from stayalive.core.judgement.escalation import rebalance
from stayalive.training.corpus import Corpus, SampleStream, generate_text
from stayalive.training.gpt import GPT, PRESETS, GPTConfig


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m stayalive.training.train", description=__doc__)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--global-batch", type=int, default=16, help="samples per step, across all ranks")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    parser.add_argument(
        "--device-ms",
        type=float,
        default=0.0,
        help="accelerator time to add to every step on a CPU-only machine: it makes compute times as steady as a "
        "GPU's, which the straggler detectors are tuned for (ranks sharing two cores jitter by tens of percent)",
    )
    return parser.parse_args(argv)


@dataclass
class Trainer:
    """One rank's model, optimizer and data: everything a step needs besides the run."""

    model: GPT
    optimizer: torch.optim.Optimizer
    stream: SampleStream
    device_s: float = 0.0  # simulated accelerator time per step (--device-ms)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # where the model and batches go
    params: list[torch.nn.Parameter] = field(init=False)  # listed once: walking the modules costs 0.2 ms a step

    def __post_init__(self) -> None:
        self.params = list(self.model.parameters())

    @classmethod
    def from_args(cls, args: argparse.Namespace, device: torch.device) -> Trainer:
        torch.set_num_threads(args.threads)
        corpus = Corpus(generate_text(args.seed))
        config = GPTConfig(vocab_size=corpus.vocab_size, **PRESETS[args.preset])
        torch.manual_seed(args.seed)  # the same initial weights on every rank
        model = GPT(config).to(device)
        # Fused: one kernel for every parameter, on the CPU too, where the per-tensor loop took a third
        # of the tiny model's step (1.2 of 3.6 ms); the other paths are the same arithmetic in more calls.
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, fused=True)
        stream = SampleStream(corpus, config.block_size, args.global_batch, args.seed)
        return cls(model, optimizer, stream, args.device_ms / 1000, device)

    def step(self, run: stayalive.Run, step: int) -> float:
        """One step of the loop, through the run: this rank's micro-batch, the replay the SDC checks
        may ask for, the gradient all-reduce, the update and the step's report; the mean loss of this
        rank's samples."""
        model, optimizer, stream = self.model, self.optimizer, self.stream
        if stream.global_batch < run.world_size:
            raise SystemExit(f"--global-batch {stream.global_batch} is smaller than the world size {run.world_size}")
        split = rebalance(run.speeds, stream.global_batch) if run.speeds is not None else None

        def backward(of_rank: int) -> torch.Tensor:
            """Forward and backward of `of_rank`'s micro-batch of `step` into fresh gradients; this
            rank's share of the global batch's mean loss."""
            optimizer.zero_grad(set_to_none=True)
            positions = stream.positions(step, of_rank, run.world_size, split)
            inputs, targets = stream.batch(positions)
            loss = model(inputs.to(self.device), targets.to(self.device)).sum() / stream.global_batch
            loss.backward()
            if self.device_s:  # an accelerator's time grows with the samples it computes
                time.sleep(self.device_s * len(positions) * run.world_size / stream.global_batch)
            return loss.detach()

        loss = backward(run.rank)
        run.replay_with(of_rank=backward)  # the SDC checks recompute any rank's micro-batch
        run.all_reduce_gradients(self.params, average=False)  # each loss is already its share of the mean
        optimizer.step()
        positions = stream.positions(step, run.rank, run.world_size, split)
        share = loss.item() * stream.global_batch / len(positions)  # the mean loss of this rank's samples
        run.record(share if math.isfinite(share) else None, samples=positions)
        return share


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = stayalive.init_process_group()  # cuda:LOCAL_RANK under NCCL, else the CPU
    trainer = Trainer.from_args(args, device)
    run = stayalive.Run(trainer.model, trainer.optimizer, rejoin_in_place=True)
    for step in run.steps():
        trainer.step(run, step)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # A finished rank leaves without the interpreter's teardown: everything that matters is done
    # (checkpoint writes joined, reports flushed to the agent, the group destroyed), and torch's and
    # gloo's destructors took 5-8 s after atexit on a loaded host, for every rank of every generation
    # that ends. An error or sys.exit never gets here: it exits the ordinary way, with its code.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
