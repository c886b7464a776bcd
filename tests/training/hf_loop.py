"""A Hugging Face Trainer script with stayalive's callback, for the adapter's tests.

    torchrun --nproc-per-node 2 tests/training/hf_loop.py --out final.pt [--samples s.txt]

DDP on gloo (CPU), a tiny model with dropout (a resume must restore the RNG too), a linear LR
schedule, and the Trainer's own shuffled, sharded data loader: 96 samples, 4 a batch, so at 4 ranks
an epoch is 6 steps and a run crosses several. Every step appends `step rank samples` to --samples,
and the last step's weights go to --out.
"""

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from stayalive.training.hf_trainer import StayaliveCallback

SAMPLES = 96


class Numbered(torch.utils.data.Dataset[dict[str, Any]]):
    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.inputs = torch.randn(SAMPLES, 16, generator=generator)
        self.targets = self.inputs.sum(dim=1, keepdim=True)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": self.inputs[i], "labels": self.targets[i], "idx": i}


class Regression(torch.nn.Module):
    """Returns its loss, as a Transformers model given labels does; notes the samples it trained on."""

    def __init__(self, step_ms: float) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1)
        )
        self.step_ms = step_ms
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor, labels: torch.Tensor, idx: torch.Tensor) -> dict[str, torch.Tensor]:
        self.seen += idx.tolist()
        time.sleep(self.step_ms / 1000)
        return {"loss": (self.net(x) - labels).pow(2).mean()}


class Samples(TrainerCallback):
    """Appends `step rank samples` for every optimizer step."""

    def __init__(self, model: Regression, path: Path) -> None:
        self.model, self.path = model, path

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        with open(self.path, "a") as f:
            f.write(f"{state.global_step} {args.process_index} {' '.join(map(str, self.model.seen))}\n")
        self.model.seen.clear()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--samples", type=Path)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--step-ms", type=float, default=0.0, help="accelerator time to add to every step")
    args = parser.parse_args()

    torch.set_num_threads(1)  # as torchrun's OMP_NUM_THREADS=1: the same reduction order under any launcher
    torch.manual_seed(0)
    model = Regression(args.step_ms)
    training = TrainingArguments(
        output_dir=str(args.out.parent / "trainer"),  # saves nothing (save_strategy "no"); in the test's folder
        max_steps=args.steps,  # the run spec's target_step
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        lr_scheduler_type="linear",
        use_cpu=True,
        ddp_backend="gloo",
        ddp_find_unused_parameters=False,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        logging_steps=5,
        seed=0,
    )
    trainer = Trainer(model=model, args=training, train_dataset=Numbered())
    trainer.add_callback(StayaliveCallback(trainer))
    if args.samples is not None:
        trainer.add_callback(Samples(model, args.samples))
    trainer.train()

    if dist.get_rank() == 0:
        torch.save({k: v.detach().clone() for k, v in model.net.state_dict().items()}, args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # As tests/training/api_loop.py: everything is on disk, leave without gloo's teardown.
    sys.stdout.flush()
    os._exit(0)
