"""Interleaved blocks: the way bench/sdc.py and bench/supervision.py measure an overhead of about
one percent on a shared two-core host.

Real ranks (gloo, the tiny GPT with `--device-ms` of simulated accelerator time per micro-batch, so
compute dominates a step as it does on a GPU) run blocks of steps, cycling through a plan of
variants in the same processes. The host's noise is white over a few steps and drifts beyond that
(4 ranks on 2 cores: means of 100 steps spread twice as much as white noise would leave), so short
blocks in a symmetric plan cancel the drift, and many cycles average the white part. The overhead
is the ratio of the variant's mean block time to the baseline's over all counted cycles, with a 95%
interval from resampling whole cycles (a cycle's blocks share their moment on the machine). The
first cycle warms up and is not counted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.queues import Queue

import numpy as np
import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

import stayalive
from stayalive.training.train import Trainer, parse_args
from stayalive.workers.devstack import free_port

WORLD_SIZE = 4
DEVICE_MS = 20
RESAMPLES = 4000

Block = tuple[int, str, float]  # (cycle, variant, seconds)
# rank, its trainer (training/train.py's, model and data), cycles, scratch dir, results
RankBody = Callable[[int, Trainer, int, str, "Queue[Block]"], None]


def trainer_for(rank: int, port: int) -> Trainer:
    """This rank's trainer in a fresh gloo group of WORLD_SIZE ranks on this host."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE), LOCAL_WORLD_SIZE="4"
    )
    args = parse_args(["--preset", "tiny", "--global-batch", "8", "--device-ms", str(DEVICE_MS)])
    trainer = Trainer.from_args(args, torch.device("cpu"))
    store = dist.TCPStore("127.0.0.1", port, WORLD_SIZE, is_master=rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD_SIZE)
    return trainer


def supervised(trainer: Trainer, directory: str, env: dict[str, str]) -> stayalive.Run:
    """The trainer's `stayalive.Run`, as a rank under stayalive has it (`env`: the variant's settings
    beyond a run that checkpoints only when asked)."""
    os.environ.update(
        {
            "STAYALIVE_RUN_ID": "bench/00000000",
            "STAYALIVE_TARGET_STEP": str(10**9),
            "STAYALIVE_CHECKPOINT_DIR": directory,
            "STAYALIVE_CHECKPOINT_EVERY_STEPS": str(10**9),
        }
        | env
    )
    return stayalive.Run(trainer.model, trainer.optimizer)


def _rank(body: RankBody, rank: int, port: int, cycles: int, directory: str, results: Queue[Block]) -> None:
    body(rank, trainer_for(rank, port), cycles, directory, results)
    dist.destroy_process_group()


def measure(body: RankBody, cycles: int, blocks_per_cycle: int) -> list[Block]:
    """Run `body` on WORLD_SIZE spawned ranks; rank 0 puts one Block per block it times."""
    context = multiprocessing.get_context("spawn")
    results: Queue[Block] = context.Queue()
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="bench-") as directory:
        ranks = [
            context.Process(target=_rank, args=(body, rank, port, cycles, directory, results))
            for rank in range(WORLD_SIZE)
        ]
        for process in ranks:
            process.start()
        blocks = [results.get(timeout=600) for _ in range(cycles * blocks_per_cycle)]
        for process in ranks:
            process.join()
            if process.exitcode != 0:
                raise SystemExit(f"a rank exited with {process.exitcode}")
    return blocks


@contextlib.contextmanager
def timed_block(rank: int, cycle: int, variant: str, results: Queue[Block]) -> Iterator[None]:
    """Time one block from a common start on every rank; rank 0 reports it."""
    dist.barrier()
    started = time.perf_counter()
    yield
    if rank == 0:
        results.put((cycle, variant, time.perf_counter() - started))


@dataclass(frozen=True)
class Overhead:
    """How much longer `variant` blocks took than `baseline` blocks, with a 95% interval."""

    point: float
    low: float
    high: float

    def interval(self) -> list[float]:
        return [round(self.low, 4), round(self.high, 4)]


def counted_cycles(blocks: list[Block]) -> list[int]:
    return sorted({cycle for cycle, _, _ in blocks})[1:]


def mean_block_s(blocks: list[Block], cycle: int, variant: str) -> float:
    """The mean time of the cycle's blocks of `variant`."""
    return statistics.fmean(s for c, name, s in blocks if c == cycle and name == variant)


def ratio(blocks: list[Block], numerator: str, denominator: str) -> Overhead:
    """Σ over counted cycles of the mean block time of `numerator`, against the same of
    `denominator`'s; the interval resamples cycles (seeded, so a rerun on the same blocks agrees)."""
    per_cycle = np.array(
        [[mean_block_s(blocks, c, numerator), mean_block_s(blocks, c, denominator)] for c in counted_cycles(blocks)]
    )
    picks = np.random.default_rng(0).integers(0, len(per_cycle), (RESAMPLES, len(per_cycle)))
    resampled = per_cycle[picks].sum(axis=1)
    low, high = np.percentile(resampled[:, 0] / resampled[:, 1], [2.5, 97.5])
    totals = per_cycle.sum(axis=0)
    return Overhead(point=float(totals[0] / totals[1]), low=float(low), high=float(high))


def overhead(blocks: list[Block], variant: str, baseline: str) -> Overhead:
    """How much longer the variant's blocks took than the baseline's: their ratio, less one."""
    times = ratio(blocks, variant, baseline)
    return Overhead(point=times.point - 1, low=times.low - 1, high=times.high - 1)


def median_step_s(blocks: list[Block], variant: str, block_steps: int) -> float:
    counted = counted_cycles(blocks)
    return statistics.median(s / block_steps for c, name, s in blocks if c in counted and name == variant)


def cycles(doc: str | None, quick: int, full: int) -> int:
    """The command line of an interleaved bench: `--quick` runs `quick` cycles instead of `full`."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"{quick} cycles instead of {full} (about a minute)")
    return quick if parser.parse_args().quick else full


def report(title: str, rows: list[tuple[str, str]], result: dict[str, object]) -> None:
    """The figures as a table on stderr, then the one JSON line on stdout."""
    table = Table(title=title, title_justify="left")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for row in rows:
        table.add_row(*row)
    Console(stderr=True).print(table)
    print(json.dumps(result))
