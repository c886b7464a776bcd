"""Each rank computes where `stayalive.init_process_group()` puts it: the CPU under gloo, the GPU its
LOCAL_RANK names under NCCL (the current device too), and the built-in trainer's GPT steps there, its
replicas agreeing after the all-reduce (training/accelerator.py). The NCCL case runs wherever two CUDA
devices are, and is skipped here saying so. A rank stopped while blocked in a collective aborts its
communicators before it goes (training/rank_process.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import ROOT

LOOP = "harness/device_loop.py"
RANKS = 2


@pytest.mark.parametrize(
    "backend",
    [
        "gloo",
        pytest.param(
            "nccl",
            marks=pytest.mark.skipif(
                torch.cuda.device_count() < RANKS,
                reason="no CUDA" if not torch.cuda.is_available() else f"fewer than {RANKS} GPUs",
            ),
        ),
    ],
)
def test_each_rank_steps_on_its_own_device(backend: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STAYALIVE_")} | {"STAYALIVE_BACKEND": backend}
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(RANKS), LOOP, "--out", str(tmp_path)]
    subprocess.run(argv, env=env, cwd=ROOT, check=True, capture_output=True, timeout=300)
    ranks = [json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in range(RANKS)]
    if backend == "nccl":
        assert [(r["device"], r["current"]) for r in ranks] == [(f"cuda:{i}", i) for i in range(RANKS)]
    else:
        assert {r["device"] for r in ranks} == {"cpu"}
    assert len({r["weights"] for r in ranks}) == 1, "the replicas differ after the all-reduce"
    for rank in ranks:
        assert len(rank["losses"]) == 6 and rank["losses"][-1] < rank["losses"][0]


# Rank 0 blocks in an all-reduce that rank 1 never enters, as a hung rank's peers do.
BLOCKED = """
import os, sys, time, torch, torch.distributed as dist
from stayalive.training import rank_process
dist.init_process_group("gloo")
if dist.get_rank() == 1:
    time.sleep(60)
rank_process.abort_on_terminate()
print("blocked", flush=True)
dist.all_reduce(torch.ones(1))
"""


def test_a_rank_stopped_in_a_collective_aborts_its_communicators_first(unused_tcp_port: int) -> None:
    """The agent's SIGTERM reaches a rank whose main thread is blocked in a collective (no Python
    handler runs there): its communicators are aborted at once, then it exits as SIGTERM's (143)."""
    env = os.environ | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(unused_tcp_port), "WORLD_SIZE": "2"}
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", BLOCKED],
            env=env | {"RANK": str(rank)},
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    blocked = ranks[0]
    try:
        assert blocked.stdout is not None and blocked.stdout.readline().strip() == "blocked"
        time.sleep(0.5)  # inside the all-reduce
        started = time.monotonic()
        blocked.send_signal(signal.SIGTERM)
        assert blocked.wait(timeout=20) == 128 + signal.SIGTERM
        assert time.monotonic() - started < 10
        assert "aborting this rank's communicators" in blocked.stdout.read()
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait()
