"""What the public training API (`stayalive.Run`) costs a user's loop, against the same loop without it.

Two measurements, each with real ranks under torchrun (2 ranks, gloo), in one run:

    step overhead   the tiny GPT under DDP, with the tests' 15 ms of simulated device time per step,
                    stepped in turn, BLOCK_STEPS steps at a time, by a plain loop and by `run.steps()`
                    (its command vote, SDC checks, counted all-reduces, and step reports sent to an
                    agent that reads them every 0.1 s: on two cores, an agent woken by every report
                    takes the ranks' CPU, which on a GPU node it does not). Each API block is compared
                    with its plain neighbour, by their mean steps (the API's batched reports and its
                    periodic SDC checks are in them); the figure is the median of those differences,
                    against the median plain step (and the same in the training thread's CPU time, a
                    steadier figure). Bar: the API adds at most 1%. Blocks, not single steps in turn:
                    a plain step between two API steps doubled the time from one to the next, so the
                    API batched its reports by 8 steps instead of the 16 of the tiny model's own step
                    time (training/step_reports.py) and paid twice their share (+1.02% where blocks
                    measured +0.55%, at 1,600 steps). Two identical plain loops, measured this way at
                    1,600 steps, differed by −0.07% and +0.48%: the noise of a shared two-core host,
                    which the full run's 3,200 steps narrow.
    checkpoint      a 2-layer 1024-wide MLP with populated AdamW state (25 MB a rank): the seconds a
                    save blocks the loop, through `run.checkpoint()` (host memory, replica, storage,
                    commit): the state dicts' making, and the next update's wait for the copy of their
                    tensors, which runs meanwhile, against plain `dcp.save` and `dcp.async_save` of the
                    same state dicts. A step has the step phase's 15 ms of device time, before its
                    update (where a GPU copies beside the kernels). Each save follows a training step,
                    and every earlier save's write has landed (as it has over a real checkpoint
                    interval); medians of the saves after the first. Bar:
                    the API's blocking is at most 10% of `dcp.save`'s and below `dcp.async_save`'s.

    python -m bench.api [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from itertools import islice
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.nn.parallel import DistributedDataParallel

import stayalive
from bench.supervision import serve_sink
from stayalive.training.gpt import GPT, PRESETS, GPTConfig

RANKS = 2
DEVICE_S = 0.015  # the tiny GPT's simulated device time in the tests (harness/tiny.py)
BLOCK_STEPS = 16  # a report batch at the tiny model's step time
VOCAB = 64


def _gpt_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    tokens = torch.randint(0, VOCAB, (4, PRESETS["tiny"]["block_size"] + 1))
    loss = model(tokens[:, :-1], tokens[:, 1:]).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    time.sleep(DEVICE_S)
    return loss.detach()


def step_overhead(steps: int) -> dict[str, float]:
    """The median step seconds of the plain loop, and the median of what a step through `run.steps()`
    took more, block by block: in wall time, and in the training thread's CPU time (which no wait for
    the other rank is in: a steadier figure of the same cost)."""
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        model = DistributedDataParallel(GPT(GPTConfig(vocab_size=VOCAB, **PRESETS["tiny"])))
        models.append((model, torch.optim.AdamW(model.parameters(), lr=1e-3)))
    (plain, plain_optimizer), (supervised, supervised_optimizer) = models
    run = stayalive.Run(supervised, supervised_optimizer)
    steps_of_run = run.steps()

    def plain_step() -> None:
        _gpt_step(plain, plain_optimizer)

    def api_step() -> None:  # a step through the API ends (its bookkeeping) when the next one is asked for
        for _ in islice(steps_of_run, 1):
            run.record(_gpt_step(supervised, supervised_optimizer))

    api_step()
    blocks: dict[str, list[float]] = {"plain": [], "api": []}  # mean step seconds of each block
    cpu: dict[str, list[float]] = {"plain": [], "api": []}  # the training thread's CPU seconds, likewise
    # The two loops step in turn, a block each, each first every other block, and each API block is
    # compared with its plain neighbour: two ranks on two cores drift.
    for i in range(steps // BLOCK_STEPS):
        for name, step in [("plain", plain_step), ("api", api_step)][:: 1 if i % 2 else -1]:
            started, started_cpu = time.perf_counter(), time.thread_time()
            for _ in range(BLOCK_STEPS):
                step()
            blocks[name].append((time.perf_counter() - started) / BLOCK_STEPS)
            cpu[name].append((time.thread_time() - started_cpu) / BLOCK_STEPS)
    added = [api - plain for api, plain in zip(blocks["api"], blocks["plain"], strict=True)]
    added_cpu = [api - plain for api, plain in zip(cpu["api"], cpu["plain"], strict=True)]
    return {
        "plain": statistics.median(blocks["plain"]),
        "added": statistics.median(added),
        "added_cpu": statistics.median(added_cpu),
    }


def checkpoint_blocking(saves: int, directory: Path) -> dict[str, float]:
    """Median seconds a save blocked the step, after the first, for each way of saving."""
    torch.manual_seed(0)
    layers = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024))
    model = DistributedDataParallel(layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    run = stayalive.Run(model, optimizer)

    def train() -> None:
        model(torch.randn(8, 1024)).pow(2).mean().backward()
        time.sleep(DEVICE_S)  # the device's share of the step (as in the step phase), before its update
        optimizer.step()
        optimizer.zero_grad()

    blocking: dict[str, list[float]] = {"api": [], "api_wait": [], "dcp_save": [], "dcp_async_save": []}
    for i in range(saves):
        train()
        at_call = run.checkpoint()  # the state dicts made, the copy begun
        train()  # its update waits for whatever of the copy is left
        blocking["api"].append(run.checkpointer.blocking_s)
        blocking["api_wait"].append(run.checkpointer.blocking_s - at_call)
        # Its write lands before the next save is timed, as it has over a checkpoint interval: a write
        # still under way made the plain `dcp.save` beside it 60% slower, and the API's share look smaller.
        run.checkpointer.wait()
        train()
        started = time.perf_counter()
        model_state, optimizer_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optim": optimizer_state}, checkpoint_id=directory / f"save-{i}")
        blocking["dcp_save"].append(time.perf_counter() - started)
        train()
        started = time.perf_counter()
        model_state, optimizer_state = get_state_dict(model, optimizer)
        pending = dcp.async_save({"model": model_state, "optim": optimizer_state}, checkpoint_id=directory / f"a-{i}")
        blocking["dcp_async_save"].append(time.perf_counter() - started)
        pending.result()  # type: ignore[union-attr]
    run.checkpointer.wait()
    return {name: statistics.median(seconds[1:]) for name, seconds in blocking.items()}


def rank_main(phase: str, quick: bool, out: Path) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    if phase == "steps":
        figures = step_overhead(steps=320 if quick else 3200)
    else:
        figures = checkpoint_blocking(saves=4 if quick else 10, directory=out.parent / "plain")
    if dist.get_rank() == 0:
        out.write_text(json.dumps(figures))
    dist.destroy_process_group()
    os._exit(0)  # the checkpoint writer's groups need no teardown: everything is on disk


def launch(phase: str, quick: bool, work: Path, agent: str) -> dict[str, float]:
    out = work / phase / "figures.json"
    out.parent.mkdir(parents=True)
    env = os.environ | {
        "STAYALIVE_RUN_ID": f"bench-api-{phase}/00000000",
        "STAYALIVE_AGENT": agent,
        "STAYALIVE_TARGET_STEP": "1000000",
        "STAYALIVE_CHECKPOINT_DIR": str(work / phase / "checkpoints"),
        "STAYALIVE_CHECKPOINT_EVERY_STEPS": "1000000",  # the step phase never checkpoints
    }
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(RANKS), "-m", "bench.api"]
    subprocess.run([*argv, "--rank", phase, *(["--quick"] if quick else []), "--out", str(out)], env=env, check=True)
    return dict(json.loads(out.read_text()))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.api", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer steps and saves: about a minute")
    parser.add_argument("--rank", choices=["steps", "checkpoint"], help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        rank_main(args.rank, args.quick, args.out)
        return
    with tempfile.TemporaryDirectory(prefix="bench-api-") as work:
        agent = serve_sink(every_s=0.1)
        steps = launch("steps", args.quick, Path(work), agent)
        blocking = launch("checkpoint", args.quick, Path(work), agent)
    overhead = steps["added"] / steps["plain"]
    to_save = blocking["api"] / blocking["dcp_save"]
    print(
        f"step: plain {steps['plain'] * 1e3:.2f} ms, the API {steps['added'] * 1e6:+.0f} µs ({overhead:+.2%}), "
        f"{steps['added_cpu'] * 1e6:+.0f} µs of the training thread's CPU"
    )
    print(
        f"checkpoint blocking: API {blocking['api'] * 1e3:.2f} ms (of which its update's wait for the copy "
        f"{blocking['api_wait'] * 1e3:.2f} ms), dcp.save {blocking['dcp_save'] * 1e3:.2f} ms, "
        f"dcp.async_save {blocking['dcp_async_save'] * 1e3:.2f} ms"
    )
    bar = overhead <= 0.01 and to_save <= 0.10 and blocking["api"] < blocking["dcp_async_save"]
    figures = {
        "step_plain_ms": round(steps["plain"] * 1e3, 3),
        "step_added_us": round(steps["added"] * 1e6, 1),
        "step_overhead": round(overhead, 4),
        "step_added_cpu_us": round(steps["added_cpu"] * 1e6, 1),
        "blocking_api_ms": round(blocking["api"] * 1e3, 3),
        "blocking_api_wait_ms": round(blocking["api_wait"] * 1e3, 3),
        "blocking_dcp_save_ms": round(blocking["dcp_save"] * 1e3, 3),
        "blocking_dcp_async_save_ms": round(blocking["dcp_async_save"] * 1e3, 3),
        "blocking_api_over_dcp_save": round(to_save, 4),
        "bar": bar,
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
