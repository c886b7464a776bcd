"""A DDP script shaped like the tutorials (a `Trainer` holding the DDP model, snapshots it resumes
from, `destroy_process_group()` at the end of `main()` while the model is still alive), on CPU under
gloo. It imports nothing of stayalive and does nothing to help it exit.

    torchrun --nproc-per-node 2 examples/tutorial_ddp.py --epochs 20 --snapshot /tmp/snapshot.pt
"""

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, get_rank, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class RandomRegression(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, size: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(size, 20, generator=generator)
        self.y = self.x.sum(dim=1, keepdim=True)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]


class Trainer:
    def __init__(self, model: torch.nn.Module, data: DataLoader, optimizer: torch.optim.Optimizer, snapshot: Path):
        self.rank = get_rank()
        self.data, self.optimizer, self.snapshot = data, optimizer, snapshot
        self.epochs_run = 0
        if snapshot.exists():
            state = torch.load(snapshot, weights_only=True)
            model.load_state_dict(state["model"])
            self.epochs_run = state["epochs_run"]
            print(f"rank {self.rank}: resuming from snapshot at epoch {self.epochs_run}", flush=True)
        self.model = DDP(model)

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor) -> None:
        self.optimizer.zero_grad()
        loss = F.mse_loss(self.model(source), targets)
        loss.backward()
        self.optimizer.step()

    def _run_epoch(self, epoch: int) -> None:
        assert isinstance(self.data.sampler, DistributedSampler)
        self.data.sampler.set_epoch(epoch)
        for source, targets in self.data:
            self._run_batch(source, targets)

    def _save_snapshot(self, epoch: int) -> None:
        tmp = self.snapshot.with_suffix(".tmp")
        torch.save({"model": self.model.module.state_dict(), "epochs_run": epoch + 1}, tmp)
        tmp.replace(self.snapshot)

    def train(self, max_epochs: int) -> None:
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if self.rank == 0:
                self._save_snapshot(epoch)
        print(f"rank {self.rank}: trained {max_epochs} epochs", flush=True)


def main(epochs: int, snapshot: Path) -> None:
    init_process_group(backend="gloo")
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    dataset = RandomRegression(512)
    data = DataLoader(dataset, batch_size=32, shuffle=False, sampler=DistributedSampler(dataset))
    trainer = Trainer(model, data, torch.optim.SGD(model.parameters(), lr=1e-3), snapshot)
    trainer.train(epochs)
    destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--snapshot", type=Path, required=True)
    args = parser.parse_args()
    main(args.epochs, args.snapshot)
