"""Where a rank computes, and the default process group it joins: the run spec's backend as its launch
set it (STAYALIVE_BACKEND), with what NCCL needs on a GPU host.

Under NCCL each rank takes the GPU its LOCAL_RANK names (set as the current device, and bound to the
group, which forms its communicator at once rather than at the first collective), with the spec's
`health.collective_timeout`: NCCL's watchdog aborts a collective that has not completed by then,
and with TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (set by the launch, core/run/launch.py) the rank's thread
gets an error instead of the process being torn down; when the node agent stops the rank (a hang, a
release), its communicators are aborted first (training/rank_process.py). Under gloo a rank computes
on the CPU and the group keeps torch's own timeout. The API's own groups (its command vote, DCP's
planning) are gloo groups either way (training/run.py).
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from stayalive.core.run.spec import HealthSpec
from stayalive.training import rank_process

COLLECTIVE_TIMEOUT_S = HealthSpec().collective_timeout  # outside a run, whose launch sets the spec's


def init_process_group() -> torch.device:
    """Join the generation's default group on the spec's backend (once per process); this rank's device,
    where the loop puts its model and its batches: cuda:LOCAL_RANK under NCCL (made the current
    device), else the CPU."""
    backend = os.environ.get("STAYALIVE_BACKEND", "gloo")
    if backend != "nccl":
        if not dist.is_initialized():
            dist.init_process_group(backend=backend)
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    if not dist.is_initialized():
        timeout = timedelta(seconds=float(os.environ.get("STAYALIVE_COLLECTIVE_TIMEOUT", COLLECTIVE_TIMEOUT_S)))
        dist.init_process_group(backend="nccl", device_id=device, timeout=timeout)
        rank_process.abort_on_terminate()
    return device
