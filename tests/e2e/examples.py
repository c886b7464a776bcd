"""The published training scripts under examples/ (nanoGPT, PyTorch's FSDP2 example), run under
stayalive as their users would run them: a working directory of their own, the script's own
command line, the API's lines added (each example's stayalive.patch) and nothing else."""

from __future__ import annotations

import pickle
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from stayalive.core.protocol.telemetry import StepReport
from stayalive.core.run.spec import RunSpec
from tests.helpers import ROOT

EXAMPLES = ROOT / "examples"
VOCAB = 65  # a character-level vocabulary, as nanoGPT's shakespeare_char


def nanogpt_workdir(where: Path) -> Path:
    """nanoGPT's files and a tiny tokenized dataset (`data/tiny`: train.bin, val.bin, meta.pkl, the
    layout its prepare.py scripts write), in a directory of its own: it reads its configurator and
    data relative to where it runs."""
    where.mkdir(parents=True)
    for name in ("train.py", "model.py", "configurator.py"):
        shutil.copy(EXAMPLES / "nanogpt" / name, where / name)
    data = where / "data" / "tiny"
    data.mkdir(parents=True)
    tokens = np.random.default_rng(0).integers(0, VOCAB, 60_000, dtype=np.uint16)
    tokens[:50_000].tofile(data / "train.bin")
    tokens[50_000:].tofile(data / "val.bin")
    (data / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": VOCAB}))
    return where


def nanogpt_argv(target_step: int) -> list[str]:
    """nanoGPT on CPU: a 2-layer model, one micro-batch per rank at 4 ranks."""
    return [
        "python", "train.py", "--device=cpu", "--backend=gloo", "--compile=False", "--dtype=float32",
        "--dataset=tiny", "--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=32", "--batch_size=4",
        "--gradient_accumulation_steps=4", f"--max_iters={target_step - 1}", "--eval_interval=100000",
        "--eval_iters=2", "--log_interval=100000", "--warmup_iters=5", f"--lr_decay_iters={target_step}",
    ]  # fmt: skip


def fsdp2_workdir(where: Path) -> Path:
    where.mkdir(parents=True)
    for name in ("example.py", "model.py", "utils.py", "checkpoint.py"):
        shutil.copy(EXAMPLES / "fsdp2" / name, where / name)
    return where


@dataclass(frozen=True)
class Example:
    name: str
    workdir: Callable[[Path], Path]  # a fresh copy of its files (and data) under the given directory
    argv: Callable[[int], list[str]]  # its command line, to train until the given step
    hang_in: str  # the collective a rank hangs in at a step, as the hang's record names it
    steps: int  # a run long enough to act on while it runs (its step time is the script's own)

    def spec(self, workdir: Path, checkpoints: Path, target_step: int, **overrides: object) -> RunSpec:
        """4 ranks on 2 nodes plus a spare, the example's own command line in its own directory."""
        spec: dict[str, object] = {
            "name": self.name,
            "world_size": 4,
            "ranks_per_node": 2,
            "nodes": ["n1", "n2"],
            "spare_nodes": ["n3"],
            "min_nodes": 2,
            "entrypoint": self.argv(target_step),
            "workdir": str(workdir),
            "target_step": target_step,
            "checkpoint": {"root": str(checkpoints), "interval": "5 steps"},
        }
        return RunSpec.model_validate(spec | overrides)


# nanoGPT's step costs a tenth of a second here: 40 steps leave some 30 after the last thing a test does
# mid-run (the rollback once the killed rank's generation runs, near step 10; the drain at step 10).
NANOGPT = Example("nanogpt", nanogpt_workdir, nanogpt_argv, "the gradient all-reduce", steps=40)
# FSDP2's own collectives are not counted; the API's vote after each step is, and a hang stalls it.
FSDP2 = Example("fsdp2", fsdp2_workdir, lambda _: ["python", "example.py"], "the step's command vote", steps=25)


def losses_as_they_stand(reports: list[StepReport]) -> dict[tuple[int, int], float | None]:
    """(step, rank) → the loss the rank reported for the step, from the newest generation that
    trained it: a step trained again after a restart replaces what the lost generation trained."""
    newest: dict[tuple[int, int], StepReport] = {}
    for report in reports:
        key = (report.step, report.rank)
        if key not in newest or report.generation >= newest[key].generation:
            newest[key] = report
    return {key: report.loss for key, report in newest.items()}
