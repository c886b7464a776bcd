"""How long a checkpoint stops training: stayalive's async checkpoint against torch.save and DCP's async_save.

A checkpoint costs a run the seconds its step is blocked (the `C` of Young/Daly), so that is the number
to beat. One run measures, for the same ≥100M-parameter model with populated AdamW state:

    stayalive    what `stayalive.Run.checkpoint()` does on one rank: get_state_dict's model + optimizer
                 state dicts and the rank's RNG streams, staged into CPU buffers kept between saves
                 (training/state_checkpointer.py), then dcp.save into the tmpfs tier, then copied to
                 fsynced storage and committed with its manifest (training/commit.py)
    torch_save   synchronous torch.save of model + optimizer state dicts to one file, flushed and fsynced
    dcp_async    torch.distributed.checkpoint.async_save of get_state_dict's model + optimizer state dicts

stayalive's checkpointer is driven directly (a StateCheckpointer and its Committer, built the way
`Run` builds them), not through `Run`: `Run` has a host-memory tier only with a node agent
(STAYALIVE_AGENT, which its channel connects to), and without the tier the checkpoint would stage
on storage instead of in memory. The checkpointer itself needs no agent for a tier on one node with
one rank: nothing fetches from it, and there is no replica to send to.

Each method runs in its own process, so its peak memory is its own: the growth of the peak resident set
over the peak right after the state was built (one fused-AdamW step, gradients included), i.e. how far
checkpointing lifts training's own peak. "tmpfs MiB" is what stays in host memory outside the process
(stayalive's memory tier keeps the last two checkpoints). Blocking time counts from handing the state
over (state dicts included) until training may continue; total time until the checkpoint is durable
(stayalive's: committed). Each method saves several times with a training step in between; "steady"
is the median of the saves after the first (staging buffers already allocated where the method keeps
them; DCP's async_save makes a fresh stager, so fresh memory, for every save). The bar: stayalive's
steady blocking time is at most 10% of torch.save's and no worse than async_save's.

    python -m bench.checkpoint [--quick] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from rich.console import Console
from rich.table import Table
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from stayalive.training.commit import Committer
from stayalive.training.faults import FaultInjector
from stayalive.training.loop_state import LoopState
from stayalive.training.memory import MemoryTier
from stayalive.training.state_checkpointer import StateCheckpointer

HIDDEN = 4096
LAYERS = 6  # 6 × (4096² + 4096) = 100.7M parameters; with AdamW's two moments, 1.2 GB of state
BATCH = 8
REPO = Path(__file__).resolve().parent.parent
RUN_ID = "bench/00000000"  # the memory tier takes only run ids of stayalive's form


@dataclass
class Measured:
    params: int
    blocking_s: list[float]
    total_s: list[float]
    peak_mib: float
    tmpfs_mib: float = 0.0  # left in host memory outside the process (stayalive's memory tier)

    @property
    def steady_blocking_s(self) -> float:
        return statistics.median(self.blocking_s[1:])

    @property
    def steady_total_s(self) -> float:
        return statistics.median(self.total_s[1:])


# ── in the worker process: one method ────────────────────────────────────────────────────────────────


@dataclass
class Training:
    """What a checkpoint saves: the model, its optimizer, and the last step completed."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    step: int = 0


SaveFn = Callable[[Training], tuple[float, float]]  # one checkpoint → (blocking s, total s)


def build_training() -> Training:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(LAYERS)))
    training = Training(model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True))
    train_step(training)  # AdamW allocates exp_avg / exp_avg_sq on its first step
    return training


def train_step(training: Training) -> None:
    loss = training.model(torch.randn(BATCH, HIDDEN)).pow(2).mean()
    loss.backward()
    training.optimizer.step()
    training.optimizer.zero_grad()
    training.step += 1


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


@contextmanager
def stayalive(storage: Path, tmpfs: Path) -> Iterator[SaveFn]:
    # A single-rank gloo group, as `Run` has; its checkpointer plans DCP's writes on a group of its own.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    committer = Committer(
        directory=storage,
        run_id=RUN_ID,
        generation=0,
        store=dist.HashStore(),
        # One rank on one node: no agent serves this tier (nothing fetches from it), and no replica.
        tier=MemoryTier(directory=tmpfs, hub="127.0.0.1:0", replica_hub=None, token=""),
        faults=FaultInjector([], 0, 0),
    )
    checkpointer = StateCheckpointer(
        committer,
        rank=0,
        world_size=1,
        group=dist.new_group(backend="gloo"),
        config_digest="bench",
        on_commit=lambda manifest, path: None,
        on_outage=lambda step, since, error: None,
        durable=None,
    )

    def save(training: Training) -> tuple[float, float]:
        started = time.perf_counter()
        loop = LoopState(training.model, training.optimizer)
        checkpointer.save(training.step, lambda: loop.state(rank=0))  # what `run.checkpoint()` blocks the step for
        blocking = time.perf_counter() - started
        checkpointer.wait()
        return blocking, time.perf_counter() - started

    try:
        yield save
    finally:
        dist.destroy_process_group()


@contextmanager
def torch_save(storage: Path, tmpfs: Path) -> Iterator[SaveFn]:
    def save(training: Training) -> tuple[float, float]:
        started = time.perf_counter()
        with open(storage / f"step-{training.step:08d}.pt", "wb") as f:
            torch.save({"model": training.model.state_dict(), "optimizer": training.optimizer.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())
        elapsed = time.perf_counter() - started
        return elapsed, elapsed

    yield save


@contextmanager
def dcp_async(storage: Path, tmpfs: Path) -> Iterator[SaveFn]:
    # A single-rank gloo group, as a real job would have; without one DCP falls back to a no-dist save.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

    def save(training: Training) -> tuple[float, float]:
        started = time.perf_counter()
        model, optimizer = get_state_dict(training.model, training.optimizer)
        response = dcp.async_save(
            {"model": model, "optimizer": optimizer}, checkpoint_id=storage / f"step-{training.step:08d}"
        )
        blocking = time.perf_counter() - started
        upload = response.upload_completion if isinstance(response, AsyncSaveResponse) else response
        upload.result()
        return blocking, time.perf_counter() - started

    try:
        yield save
    finally:
        dist.destroy_process_group()


SAVERS: dict[str, Callable[[Path, Path], AbstractContextManager[SaveFn]]] = {
    "stayalive": stayalive,
    "torch_save": torch_save,
    "dcp_async": dcp_async,
}


def run_method(method: str, saves: int, storage: Path, tmpfs: Path) -> Measured:
    training = build_training()
    baseline = peak_rss_mib()
    timings: list[tuple[float, float]] = []
    with SAVERS[method](storage, tmpfs) as save:
        for index in range(saves):
            if index:
                train_step(training)
            timings.append(save(training))
    return Measured(
        params=sum(p.numel() for p in training.model.parameters()),
        blocking_s=[blocking for blocking, _ in timings],
        total_s=[total for _, total in timings],
        peak_mib=peak_rss_mib() - baseline,
    )


# ── in the parent process: every method in its own worker, then the comparison ──────────────────────


def measure(method: str, saves: int, storage_root: Path, tmpfs_root: Path) -> Measured:
    storage, tmpfs = storage_root / method, tmpfs_root / method
    storage.mkdir()
    tmpfs.mkdir()
    argv = [sys.executable, "-m", "bench.checkpoint", "--worker", method, "--saves", str(saves)]
    argv += ["--storage", str(storage), "--tmpfs", str(tmpfs)]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{method} failed (exit {done.returncode}):\n{done.stderr}")
    measured = Measured(**json.loads(done.stdout.splitlines()[-1]))
    measured.tmpfs_mib = sum(f.stat().st_size for f in tmpfs.rglob("*") if f.is_file()) / 2**20
    return measured


@contextmanager
def scratch(storage_parent: str) -> Iterator[tuple[Path, Path]]:
    """A storage directory under `storage_parent` and a host-memory one on /dev/shm, both removed after."""
    with (
        tempfile.TemporaryDirectory(dir=storage_parent, prefix="stayalive-bench-") as storage,
        tempfile.TemporaryDirectory(dir="/dev/shm", prefix="stayalive-bench-") as tmpfs,
    ):
        yield Path(storage), Path(tmpfs)


def summary(results: dict[str, Measured], saves: int) -> dict[str, object]:
    line: dict[str, object] = {"bench": "checkpoint", "params": results["stayalive"].params, "saves": saves}
    for method, measured in results.items():
        line[f"{method}_blocking_first_s"] = round(measured.blocking_s[0], 4)
        line[f"{method}_blocking_s"] = round(measured.steady_blocking_s, 4)
        line[f"{method}_total_s"] = round(measured.steady_total_s, 3)
        line[f"{method}_peak_mib"] = round(measured.peak_mib)
    line["stayalive_tmpfs_mib"] = round(results["stayalive"].tmpfs_mib)
    steady = {method: measured.steady_blocking_s for method, measured in results.items()}
    line["blocking_vs_torch_save"] = round(steady["stayalive"] / steady["torch_save"], 4)
    line["blocking_vs_dcp_async"] = round(steady["stayalive"] / steady["dcp_async"], 4)
    line["bar"] = steady["stayalive"] <= min(0.10 * steady["torch_save"], steady["dcp_async"])
    return line


def table(results: dict[str, Measured], saves: int) -> Table:
    params = next(iter(results.values())).params
    grid = Table(title=f"Checkpoint of {params / 1e6:.1f}M parameters + AdamW state, {saves} saves per method")
    for column in ("method", "blocking s (first)", "blocking s (steady)", "total s (steady)", "peak +MiB", "tmpfs MiB"):
        grid.add_column(column, justify="left" if column == "method" else "right")
    for method, m in results.items():
        grid.add_row(
            method,
            f"{m.blocking_s[0]:.3f}",
            f"{m.steady_blocking_s:.3f}",
            f"{m.steady_total_s:.2f}",
            f"{m.peak_mib:.0f}",
            f"{m.tmpfs_mib:.0f}",
        )
    return grid


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 saves per method instead of 5 (same model)")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the storage temp dir goes")
    parser.add_argument("--worker", choices=SAVERS, help=argparse.SUPPRESS)
    parser.add_argument("--saves", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--storage", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--tmpfs", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(asdict(run_method(args.worker, args.saves, args.storage, args.tmpfs))))
        return
    saves = 3 if args.quick else 5
    with scratch(args.dir) as (storage, tmpfs):
        results = {method: measure(method, saves, storage, tmpfs) for method in SAVERS}
    Console().print(table(results, saves))
    print(json.dumps(summary(results, saves)))


if __name__ == "__main__":
    main()
