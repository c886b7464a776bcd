"""A PyTorch Lightning training script with stayalive's callback, for the adapter's tests.

    torchrun --nproc-per-node 2 tests/training/lightning_loop.py --out final.pt [--samples s.txt]

DDP on gloo, a tiny model with dropout (a resume must restore the RNG too) and torchdata's
StatefulDataLoader with its StatefulDistributedSampler, built in `train_dataloader` (the process group
exists there): 96 samples shuffled per epoch, 4 a batch, so at 4 ranks an epoch is 6 steps and a run
crosses several. Every step appends `step rank samples`
to --samples, and the last step's weights go to --out.
"""

import argparse
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from stayalive.training.lightning import StayaliveCallback

SAMPLES = 96


class Numbered(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.inputs = torch.randn(SAMPLES, 16, generator=generator)
        self.targets = self.inputs.sum(dim=1, keepdim=True)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.inputs[i], self.targets[i], i


class Regression(pl.LightningModule):
    def __init__(self, samples: Path | None, step_ms: float) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1)
        )
        self.samples, self.step_ms = samples, step_ms

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets, indices = batch
        loss = (self.net(inputs) - targets).pow(2).mean()
        time.sleep(self.step_ms / 1000)
        if self.samples is not None:
            with open(self.samples, "a") as f:
                f.write(f"{self.trainer.global_step + 1} {self.global_rank} {' '.join(map(str, indices.tolist()))}\n")
        return loss

    def train_dataloader(self) -> StatefulDataLoader:
        dataset = Numbered()
        return StatefulDataLoader(dataset, batch_size=4, sampler=StatefulDistributedSampler(dataset, seed=0))

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--samples", type=Path)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--step-ms", type=float, default=0.0, help="accelerator time to add to every step")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", ".*does not have many workers.*")

    torch.set_num_threads(1)  # as torchrun's OMP_NUM_THREADS=1: the same reduction order under any launcher
    torch.manual_seed(0)
    local, world = int(os.environ["LOCAL_WORLD_SIZE"]), int(os.environ["WORLD_SIZE"])
    module = Regression(args.samples, args.step_ms)
    trainer = pl.Trainer(
        accelerator="cpu",
        strategy=DDPStrategy(process_group_backend="gloo"),
        devices=local,
        num_nodes=world // local,
        max_steps=args.steps,  # the run spec's target_step
        callbacks=[StayaliveCallback()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(module)

    if trainer.global_rank == 0:
        torch.save({k: v.detach().clone() for k, v in module.net.state_dict().items()}, args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # As tests/training/api_loop.py: everything is on disk, leave without gloo's teardown.
    sys.stdout.flush()
    os._exit(0)
