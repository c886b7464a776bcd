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
from pathlib import Path

import pytest
import torch

from harness.hung_rank import stop_blocked_rank
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


def test_a_rank_stopped_in_a_collective_aborts_its_communicators_first(unused_tcp_port: int) -> None:
    """The agent's SIGTERM reaches a rank whose main thread is blocked in a collective (no Python
    handler runs there): its communicators are aborted at once, then it exits as SIGTERM's (143)."""
    stopped = stop_blocked_rank("gloo", unused_tcp_port, settle_s=0.5)
    assert stopped.blocked, stopped.output
    assert stopped.exit_code == 128 + signal.SIGTERM
    assert stopped.seconds < 10
    assert stopped.aborted
