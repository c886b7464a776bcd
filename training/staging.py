"""A checkpoint's copy of a state dict: its tensors into CPU buffers kept from save to save (pinned on
a GPU host), copied on a thread of its own while the loop goes on (training/state_checkpointer.py).
Two sets of buffers, used in turn: a save stages into one while the last save's write still reads
the other, so a save waits for the write two saves back, not for the last one.

DCP's own stagers copy tensor storages with the GIL held: on this path the training thread's Python
stood still for the whole copy (4–5 ms for 25 MB on two cores, `python -m bench.api`), overlapping
nothing. `torch._foreach_copy_` releases the GIL, so the loop goes on into its next forward while
the copy runs. An FSDP2 model's DTensors are copied shard by shard, and put back as DTensors on
the same mesh and placements for DCP to plan and reshard. Everything else in the state dict (the
optimizer's param groups, a scheduler's numbers) is copied at once, before `stage` returns.

On a GPU host the copy waits on an event recorded on the caller's stream, so it reads the state as
the step's last kernels left it, and then runs on the copying thread's default stream: the host goes
on, the device does the copy among its kernels. A copy stream of its own, beside the kernels, is
the next step, to be measured on a GPU.
"""

from __future__ import annotations

import copy
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.tensor import DTensor


class Stager:
    def __init__(self, gpu: bool) -> None:
        self.gpu = gpu  # buffers pinned; the copy ordered after the caller's stream
        self._sets: tuple[dict[str, torch.Tensor], ...] = ({}, {})  # buffers by the tensor's path, two sets
        self._next = 0  # the set the next stage copies into
        self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stayalive-staging")

    def stage(self, state: dict[str, Any]) -> Future[dict[str, Any]]:
        """The state dict with every tensor in a buffer of the next set, once the copy is done (the
        buffers are this stager's: the caller is done with what it staged two stages back)."""
        sources: list[torch.Tensor] = []
        buffers: list[torch.Tensor] = []
        into, self._next = self._sets[self._next], 1 - self._next
        staged = self._mirror(state, "", sources, buffers, into)
        after = torch.cuda.current_stream().record_event() if self.gpu else None
        return self._copier.submit(_copied, staged, buffers, sources, after)

    def _mirror(
        self,
        value: Any,
        path: str,
        sources: list[torch.Tensor],
        buffers: list[torch.Tensor],
        into: dict[str, torch.Tensor],
    ) -> Any:
        if isinstance(value, dict):
            return {k: self._mirror(v, f"{path}/{k}", sources, buffers, into) for k, v in value.items()}
        if isinstance(value, list | tuple):
            items = [self._mirror(v, f"{path}/{i}", sources, buffers, into) for i, v in enumerate(value)]
            return items if isinstance(value, list) else tuple(items)
        if not isinstance(value, torch.Tensor):
            return copy.deepcopy(value)
        local = value.to_local() if isinstance(value, DTensor) else value
        buffer = self._buffer(into, path, local)
        sources.append(local.detach())
        buffers.append(buffer)
        if isinstance(value, DTensor):
            return DTensor.from_local(
                buffer, value.device_mesh, value.placements, run_check=False, shape=value.shape, stride=value.stride()
            )
        return buffer

    def _buffer(self, into: dict[str, torch.Tensor], path: str, local: torch.Tensor) -> torch.Tensor:
        buffer = into.get(path)
        if buffer is None or buffer.shape != local.shape or buffer.dtype != local.dtype:
            buffer = into[path] = torch.empty(local.shape, dtype=local.dtype, device="cpu", pin_memory=self.gpu)
        return buffer


def _copied(
    staged: dict[str, Any], buffers: list[torch.Tensor], sources: list[torch.Tensor], after: torch.cuda.Event | None
) -> dict[str, Any]:
    if after is not None:
        torch.cuda.current_stream().wait_event(after)
    if buffers:
        with torch.no_grad():
            torch._foreach_copy_(buffers, sources)  # into pageable or pinned memory: done when it returns
    return staged
