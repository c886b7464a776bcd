"""A rank stopped while blocked in a collective, for the accelerator's test (gloo) and bench.gpu
(NCCL): two ranks on this host, rank 1 never entering the all-reduce rank 0 blocks in, as a hung
rank's peers do; rank 0 gets the agent's SIGTERM there (training/rank_process.py aborts its
communicators first)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

RANK = """
import time, torch, torch.distributed as dist
import stayalive
from stayalive.training import rank_process
device = stayalive.init_process_group()
if dist.get_rank() == 1:
    time.sleep(120)
rank_process.abort_on_terminate()  # installed by the NCCL group already; under gloo, here
print("blocked", flush=True)
dist.all_reduce(torch.ones(1, device=device))
"""


@dataclass
class Stopped:
    blocked: bool  # rank 0 reached the all-reduce
    exit_code: int | None
    seconds: float  # from SIGTERM to its exit
    output: str  # rank 0's stdout and stderr

    @property
    def aborted(self) -> bool:
        return "aborting this rank's communicators" in self.output


def stop_blocked_rank(backend: str, port: int, settle_s: float) -> Stopped:
    """Start the two ranks on `backend`, SIGTERM rank 0 `settle_s` after it blocks, and wait for it."""
    env = os.environ | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", RANK],
            env=env | {"RANK": str(rank), "LOCAL_RANK": str(rank), "STAYALIVE_BACKEND": backend},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    blocked = ranks[0]
    assert blocked.stdout is not None
    try:
        if blocked.stdout.readline().strip() != "blocked":
            return Stopped(blocked=False, exit_code=None, seconds=0.0, output=blocked.stdout.read()[-2000:])
        time.sleep(settle_s)  # inside the all-reduce
        started = time.perf_counter()
        blocked.send_signal(signal.SIGTERM)
        code = blocked.wait(timeout=120)
        return Stopped(True, code, time.perf_counter() - started, blocked.stdout.read())
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait()
